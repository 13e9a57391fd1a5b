"""Load (and save) Hugging Face checkpoint directories: config.json + safetensors, never pickles.

Weights: a single model.safetensors or shards listed in model.safetensors.index.json; bf16/fp16/fp32
on disk, cast to the requested dtype. Every error names the file and, where it applies, the tensor.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from safetensors import safe_open

from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig, read_json
from dflash_trt.hashing import sha256_files

if TYPE_CHECKING:  # torch only where weights load: the ORT path hashes checkpoints and reads tokenizers without it
    import torch

    from dflash_trt.export.drafter import Drafter
    from dflash_trt.export.target import TargetModel


class CheckpointError(ValueError):
    """A weight file is missing, unreadable, or lacks / mis-shapes a tensor."""


def _weight_files(d: str) -> list[str]:
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            wm = read_json(index).get("weight_map")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        files = sorted(set(wm.values()))
        for f in files:
            if not os.path.isfile(os.path.join(d, f)):
                raise CheckpointError(f"{index}: shard '{f}' is listed but {os.path.join(d, f)} does not exist")
        return [os.path.join(d, f) for f in files]
    if os.path.isfile(single):
        return [single]
    if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(d)):
        raise CheckpointError(f"{d}: only pickle weights (.bin/.pt) found; dflash-trt loads safetensors only")
    raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json")


class WeightSource:
    """Lazy view of all tensors of a checkpoint dir: name -> (file, loader)."""

    def __init__(self, d: str):
        self.files = _weight_files(d)
        self.where: dict[str, str] = {}
        for f in self.files:
            try:
                with safe_open(f, framework="pt") as h:
                    for k in h.keys():
                        self.where[k] = f
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        f = self.where[name]
        try:
            with safe_open(f, framework="pt") as h:
                return h.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{f}: tensor '{name}' could not be read ({e})") from None


def _where(src: WeightSource) -> str:
    """The checkpoint named in a missing-tensor message: its one weight file, else its directory."""
    return src.files[0] if len(src.files) == 1 else os.path.dirname(src.files[0])


def _bind(module: torch.nn.Module, src: WeightSource, name_of, dtype, what: str, built=None) -> None:
    """Copy every parameter of `module` from the checkpoint, checking presence and shape first.
    built: checkpoint key -> (tensor, file) for tensors assembled from others (stacked experts)."""
    import torch

    built = built or {}
    params = dict(module.named_parameters(remove_duplicate=True))
    missing = [name_of(p) for p in params if name_of(p) not in src.where and name_of(p) not in built]
    if missing:
        raise CheckpointError(
            f"{what} checkpoint {_where(src)}: "
            f"missing tensor '{missing[0]}'" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    for p_name, p in params.items():
        key = name_of(p_name)
        t, f = built[key] if key in built else (src.get(key), src.where[key])
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(
                f"{f}: tensor '{key}' has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.data = t.to(dtype).contiguous()


def _target_prefix(src: WeightSource) -> str:
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in src.where:
            return prefix
    raise CheckpointError(f"{src.files[0]}: missing tensor 'model.embed_tokens.weight' (not a Qwen3-Next/3.5 decoder?)")


def _stack_experts(model: TargetModel, src: WeightSource, prefix: str) -> dict:
    """Expert weights in the per-expert layout of released checkpoints (and of transformers' save_pretrained):
    mlp.experts.{e}.{gate,up,down}_proj.weight, stacked into our fused parameters (HF's in-memory layout,
    mlp.experts.gate_up_proj [E,2I,H] and mlp.experts.down_proj [E,H,I]). A layer whose fused tensors are in
    the checkpoint is bound from them directly. Each per-expert tensor is checked by name and shape here,
    so the error names the tensor the user has, not our stacked one."""
    import torch

    cfg, built = model.cfg, {}
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for i in cfg.moe_layers:
        base = f"{prefix}layers.{i}.mlp.experts."
        fused = [base + "gate_up_proj", base + "down_proj"]
        if all(k in src.where for k in fused):
            continue
        parts = {n: [] for n in ("gate_proj", "up_proj", "down_proj")}
        for e in range(E):
            for n, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
                key = f"{base}{e}.{n}.weight"
                if key not in src.where:
                    missing = fused[0] if fused[0] not in src.where else fused[1]
                    raise CheckpointError(f"target checkpoint {_where(src)}: missing tensor '{key}' "
                                          f"(layer {i} has {E} experts; no fused '{missing}' either)")
                t = src.get(key)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{src.where[key]}: tensor '{key}' has shape {tuple(t.shape)}, "
                                          f"expected {shape}")
                parts[n].append(t)
        f = src.where[f"{base}0.gate_proj.weight"]
        built[fused[0]] = (torch.stack([torch.cat([g, u]) for g, u in zip(parts["gate_proj"], parts["up_proj"])]), f)
        built[fused[1]] = (torch.stack(parts["down_proj"]), f)
    return built


def load_target(d: str, dtype=None) -> TargetModel:
    """dtype: a torch dtype (default float32)."""
    import torch

    from dflash_trt.export.target import TargetModel

    dtype = dtype or torch.float32
    cfg = TargetConfig.from_dict(read_json(os.path.join(d, "config.json")), os.path.join(d, "config.json"))
    src = WeightSource(d)
    prefix = _target_prefix(src)
    model = TargetModel(cfg)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in src.where
    if tied and not cfg.tie_word_embeddings:
        raise CheckpointError(f"{src.files[0]}: missing tensor 'lm_head.weight' and tie_word_embeddings is false")
    _bind(model, src, lambda n: "lm_head.weight" if n == "lm_head.weight" else prefix + n, dtype, "target",
          built=_stack_experts(model, src, prefix))
    return model.eval()


def load_drafter(d: str, target: TargetModel, dtype=None) -> Drafter:
    """dtype: a torch dtype (default float32)."""
    import torch

    from dflash_trt.export.drafter import Drafter

    dtype = dtype or torch.float32
    path = os.path.join(d, "config.json")
    cfg = DrafterConfig.from_dict(read_json(path), path)
    cfg.check_against(target.cfg, path)
    src = WeightSource(d)
    fc = src.where.get("fc.weight")
    if fc is not None:
        shape = tuple(src.get("fc.weight").shape)
        want = (cfg.hidden_size, len(cfg.target_layer_ids) * target.cfg.hidden_size)
        if shape != want:
            raise ConfigError(
                f"{fc}: fc.weight is {shape}; with {len(cfg.target_layer_ids)} taps of target hidden "
                f"{target.cfg.hidden_size} it must be {want} (drafter trained for another target?)"
            )
    # the drafter borrows the target's embedding and lm_head (DESIGN §2b): own ones, a mask-embedding override
    # or projection biases would be silently dropped by _bind, so they are refused by name
    own = [n for n in src.where if n.split(".")[0] in ("embed_tokens", "lm_head", "mask_embedding")
           or n.endswith("_proj.bias")]
    if own:
        raise ConfigError(f"{src.where[own[0]]}: drafter tensor '{own[0]}' is not supported (own embeddings, "
                          "lm_head, mask_embedding and biases are not implemented; the target's are used)")
    drafter = Drafter(cfg, target.cfg.hidden_size)
    _bind(drafter, src, lambda n: n, dtype, "drafter")
    return drafter.eval().bind_target(target)


def load_tokenizer(d: str):
    """tokenizer.json through the `tokenizers` library, or None when the directory has none."""
    p = os.path.join(d, "tokenizer.json")
    if not os.path.isfile(p):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(p)
    except Exception as e:
        raise CheckpointError(f"{p}: not a readable tokenizer ({e})") from None


def checkpoint_hash(d: str) -> str:
    """sha256 over config.json and the weight files' bytes (identifies the source of built artifacts);
    remembered per file state (dflash_trt.hashing), so a large checkpoint is hashed once."""
    return sha256_files([os.path.join(d, "config.json")] + _weight_files(d), with_names=True)[:16]


def save_checkpoint(module: torch.nn.Module, config: dict, d: str, prefix: str = "", dtype=None) -> None:
    """Write config.json + model.safetensors (used for the embedded demo models and by tests)."""
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    tensors = {}
    for n, p in module.named_parameters(remove_duplicate=True):
        key = n if n == "lm_head.weight" else prefix + n
        tensors[key] = (p.detach().to(dtype) if dtype else p.detach()).contiguous().clone()
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
