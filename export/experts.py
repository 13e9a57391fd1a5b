"""Routed experts in the per-expert layout of released checkpoints, stacked into the fused parameters the model
holds (export/checkpoint.py's load_target binds them); read lazily, only the slices a rank's cut names."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_trt.export.checkpoint import CheckpointError, WeightSource, named_in

if TYPE_CHECKING:
    from dflash_trt.modeling.target import TargetModel


def _expert_parts(experts) -> tuple[tuple[str, ...], dict]:
    """(per-expert tensor suffixes, fused name -> its whole checkpoint shape per expert) of one layer's experts
    module: 'weight' only, or with FP8 weights (modeling/fp8.Fp8Experts) also 'weight_scale_inv' and the fused
    scales. A parameter cut for a rank (.cut) names the whole shape it was cut from."""
    fused = {n: tuple(t.cut.full if hasattr(t, "cut") else t.shape)[1:] for n, t in experts.named_parameters()}
    return (("weight", "weight_scale_inv") if "down_proj_scale_inv" in fused else ("weight",)), fused


def stack_experts(model: TargetModel, src: WeightSource, prefix: str) -> dict:
    """Expert weights in the per-expert layout of released checkpoints (and of transformers' save_pretrained):
    mlp.experts.{e}.{gate,up,down}_proj.weight (+ .weight_scale_inv for FP8), stacked into our fused parameters
    (HF's in-memory layout, mlp.experts.gate_up_proj [E,2I,H] and mlp.experts.down_proj [E,H,I]; FP8 scales stacked
    alike, gate's block rows then up's). A layer whose fused tensors are in the checkpoint is bound from them
    directly. Each per-expert tensor is checked by name and shape here and by dtype and values as it is read, so
    the error names the tensor the user has, not our stacked one. The stacked tensors are read when bound, only
    the slices a rank's cut names (_stacked, export/experts.py)."""
    built = {}
    for i in model.cfg.moe_layers:
        base, experts = f"{prefix}layers.{i}.mlp.experts.", model.layers[i].mlp.experts
        suffixes, fused = _expert_parts(experts)
        if all(base + k in src.where for k in fused):
            continue
        for sfx in suffixes:
            tail = "" if sfx == "weight" else "_scale_inv"
            for name, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
                shape = list(fused[name + tail])
                shape[0] //= len(parts)
                keys = [[f"{base}{e}.{n}.{sfx}" for n in parts] for e in range(model.cfg.num_experts)]
                for k in (k for ks in keys for k in ks):
                    _expert_shape(src, k, tuple(shape), base + name + tail)
                built[base + name + tail] = (lambda like, keys=keys, rows=shape[0]: _stacked(src, keys, rows, like),
                                             src.where[keys[0][0]])
    return built


def _stacked(src: WeightSource, keys: list, rows: int, like):
    """The stacked tensor [E, parts·rows, ...] of per-expert tensors keys[e] (gate then up, or down), or only
    like.cut's slices of it: whole experts (dim 0) or rows / columns of each, each part read in slices."""
    import torch

    def read(dim, a, b):
        if dim == 0:
            return torch.stack([torch.cat([src.read_as(k, like) for k in keys[e]]) for e in range(a, b)])
        out = []
        for ks in keys:
            if dim > 1:
                out.append(torch.cat([src.read_as(k, like, (dim - 1, a, b)) for k in ks]))
                continue
            spans = [(j, max(a, j * rows), min(b, (j + 1) * rows)) for j in range(len(ks))]
            out.append(torch.cat([src.read_as(ks[j], like, (0, lo - j * rows, hi - j * rows))
                                  for j, lo, hi in spans if lo < hi]))
        return torch.stack(out)

    split = getattr(like, "cut", None)
    return read(0, 0, len(keys)) if split is None else split.take(read)


def _expert_shape(src: WeightSource, key: str, shape: tuple, fused: str) -> None:
    """One per-expert tensor is in the checkpoint with the given shape (from the file's header)."""
    if key not in src.where:
        raise CheckpointError(f"target checkpoint {named_in(src)}: missing tensor '{key}' (no fused '{fused}' either)")
    if src.shape(key) != shape:
        raise CheckpointError(f"{src.where[key]}: tensor '{key}' has shape {src.shape(key)}, expected {shape}")


def expert_keys(model: TargetModel, src: WeightSource, prefix: str) -> set:
    """The checkpoint names stack_experts reads: a layer's fused tensors when present, else its per-expert ones."""
    keys = set()
    for i in model.cfg.moe_layers:
        base = f"{prefix}layers.{i}.mlp.experts."
        suffixes, fused = _expert_parts(model.layers[i].mlp.experts)
        if not all(base + n in src.where for n in fused):
            keys |= {f"{base}{e}.{n}.{sfx}" for e in range(model.cfg.num_experts)
                     for n in ("gate_proj", "up_proj", "down_proj") for sfx in suffixes}
    return keys
