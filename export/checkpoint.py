"""Load (and save) Hugging Face checkpoint directories: config.json + safetensors, never pickles.

Weights: a single model.safetensors or shards listed in model.safetensors.index.json; bf16/fp16/fp32
on disk, cast to the requested dtype. FP8 block-wise checkpoints (dflash_trt.quant): the float8_e4m3fn weights
and their fp32 weight_scale_inv are bound as stored, never cast. Every error names the file and, where it
applies, the tensor.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from safetensors import safe_open

from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig, read_json
from dflash_trt.export.leftovers import why_unused
from dflash_trt.files import write_bytes, write_json
from dflash_trt.hashing import sha256_files

if TYPE_CHECKING:  # torch only where weights load (the ORT path needs none)
    import torch

    from dflash_trt.modeling.drafter import Drafter
    from dflash_trt.modeling.target import TargetModel


class CheckpointError(ValueError):
    """A weight file is missing, unreadable, or lacks / mis-shapes a tensor."""


_FLOAT_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")  # by name: torch loads lazily


def _inside(root: str, d: str, rel) -> bool:
    """An index entry names a file in the checkpoint directory: relative, and its folder resolves inside it.
    The file itself may be a symlink (the Hugging Face cache links snapshot files to its blob store)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        return False
    folder = os.path.realpath(os.path.dirname(os.path.join(d, rel)))
    return os.path.commonpath([root, folder]) == root


def _weight_map(d: str) -> tuple[list[str], dict[str, str] | None]:
    """(weight files, tensor name -> file as the index maps it, or None for a single model.safetensors)."""
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            wm = read_json(index).get("weight_map")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        root = os.path.realpath(d)
        for name, f in wm.items():
            if not _inside(root, d, f):
                raise CheckpointError(f"{index}: tensor '{name}' maps to {f!r}, which is not a file inside "
                                      f"the checkpoint directory {d}")
        for f in sorted(set(wm.values())):
            if not os.path.isfile(os.path.join(d, f)):
                raise CheckpointError(f"{index}: shard '{f}' is listed but {os.path.join(d, f)} does not exist")
        where = {k: os.path.normpath(os.path.join(d, f)) for k, f in wm.items()}
        return sorted(set(where.values())), where
    if os.path.isfile(single):
        return [single], None
    if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(d)):
        raise CheckpointError(f"{d}: only pickle weights (.bin/.pt) found; dflash-trt loads safetensors only")
    raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json")


def _weight_files(d: str) -> list[str]:
    return _weight_map(d)[0]


class WeightSource:
    """Lazy view of all tensors of a checkpoint dir: name -> (file, loader). With an index, each tensor is read
    from the shard the index names, and a shard holding a tensor the index does not map to it is refused
    (a second copy would otherwise be silently ignored or win, depending on the order)."""

    def __init__(self, d: str):
        self.files, index = _weight_map(d)
        self.where: dict[str, str] = {}
        for f in self.files:
            try:
                with safe_open(f, framework="pt") as h:
                    keys = list(h.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
            for k in keys:
                if index is not None and index.get(k) != f:
                    mapped = os.path.basename(index[k]) if k in index else "no shard"
                    raise CheckpointError(f"{f}: tensor '{k}' is in this shard but the index maps it to {mapped} "
                                          "(a tensor in two shards, or missing from the index, is ambiguous)")
                self.where[k] = f
        for k, f in (index or {}).items():
            if k not in self.where:
                raise CheckpointError(f"{f}: the index maps tensor '{k}' to this shard, which does not hold it")

    def get(self, name: str, part: tuple | None = None) -> torch.Tensor:
        """The tensor, or only its slice part = (dim, a, b): rows [a, b) of dim, read from the file alone."""
        f = self.where[name]
        try:
            with safe_open(f, framework="pt") as h:
                if part is None:
                    return h.get_tensor(name)
                dim, a, b = part
                return h.get_slice(name)[(slice(None),) * dim + (slice(a, b),)]
        except Exception as e:
            raise CheckpointError(f"{f}: tensor '{name}' could not be read ({e})") from None

    def shape(self, name: str) -> tuple:
        """The stored shape, from the file's header."""
        with safe_open(self.where[name], framework="pt") as h:
            return tuple(h.get_slice(name).get_shape())

    def read(self, name: str, part: tuple | None = None) -> torch.Tensor:
        """A weight (or its slice `part`, as for get), checked once at load: a float dtype we compute in, every
        value finite."""
        import torch

        t, f = self.get(name, part), self.where[name]
        if t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"{f}: tensor '{name}' has dtype float8_e4m3fn, but config.json does not make "
                                  "this module FP8 (no quantization_config, its skip list names the module, or "
                                  "transformers never converts it)")
        if str(t.dtype) not in _FLOAT_DTYPES:
            raise CheckpointError(f"{f}: tensor '{name}' has dtype {str(t.dtype).removeprefix('torch.')}; only "
                                  "float32/float16/bfloat16 weights and FP8 block-wise checkpoints are loaded")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{f}: tensor '{name}' holds non-finite values (NaN or Inf)")
        return t

    def _of_dtype(self, name: str, dtype, why: str, part: tuple | None = None):
        """(tensor, its file), the tensor (or its slice `part`) of `dtype` or refused naming it, its dtype and `why`."""
        t, f = self.get(name, part), self.where[name]
        if t.dtype != dtype:
            raise CheckpointError(f"{f}: tensor '{name}' has dtype {str(t.dtype).removeprefix('torch.')}{why}")
        return t, f

    def read_fp8(self, name: str, part: tuple | None = None) -> torch.Tensor:
        """An FP8 weight of a module quantization_config converts: float8_e4m3fn bytes as stored, no NaN code."""
        import torch

        t, f = self._of_dtype(name, torch.float8_e4m3fn, ", but config.json's quantization_config makes this "
                              "module FP8 (float8_e4m3fn weight + weight_scale_inv expected)", part)
        if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):  # e4m3fn's only non-finite codes: NaN
            raise CheckpointError(f"{f}: tensor '{name}' holds non-finite values (float8_e4m3fn NaN)")
        return t

    def read_scale(self, name: str, part: tuple | None = None) -> torch.Tensor:
        """An FP8 weight's block scales: float32, every one finite and > 0."""
        import torch

        t, f = self._of_dtype(name, torch.float32, "; FP8 block scales are float32", part)
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise CheckpointError(f"{f}: tensor '{name}' holds non-finite or non-positive scales")
        return t

    def read_as(self, name: str, like: torch.Tensor, part: tuple | None = None) -> torch.Tensor:
        """read, read_fp8 or read_scale (of the slice `part`, as for get), by what the model's tensor `like`
        (named `name` there) is."""
        import torch

        if like.dtype == torch.float8_e4m3fn:
            return self.read_fp8(name, part)
        return self.read_scale(name, part) if name.endswith("_scale_inv") else self.read(name, part)

    def read_split(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """read_as, of only the slices like.cut names where the model's parameter was cut from the whole
        tensor (a rank's shard: runtime/parallel/shard.py), else of the whole tensor."""
        split = getattr(like, "cut", None)
        if split is None:
            return self.read_as(name, like)
        return split.take(lambda dim, a, b: self.read_as(name, like, (dim, a, b)))


def named_in(src: WeightSource) -> str:
    """The checkpoint named in a missing-tensor message: its one weight file, else its directory."""
    return src.files[0] if len(src.files) == 1 else os.path.dirname(src.files[0])


def _bind(module: torch.nn.Module, src: WeightSource, name_of, dtype, what: str, built=None,
          unused=lambda: None) -> None:
    """Copy every parameter of `module` from the checkpoint, checking presence and shape first.
    built: checkpoint key -> (read(param) -> tensor, file) for tensors assembled from others (stacked experts).
    unused: refuses left-over tensors; called once nothing is missing (a missing tensor is the better message).
    A parameter cut from its whole tensor on the meta device (it carries .cut: a rank's shard) reads only its
    slices, the whole tensor's shape checked from the file's header."""
    import torch

    built = built or {}
    params = dict(module.named_parameters(remove_duplicate=True))
    missing = [name_of(p) for p in params if name_of(p) not in src.where and name_of(p) not in built]
    if missing:
        raise CheckpointError(
            f"{what} checkpoint {named_in(src)}: "
            f"missing tensor '{missing[0]}'" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unused()
    owners = _owners(module)
    for p_name, p in params.items():
        key = name_of(p_name)
        if key in built:
            read, f = built[key]
        else:
            f, read = src.where[key], lambda like, key=key: src.read_split(key, like)
            full = tuple(p.cut.full) if hasattr(p, "cut") else tuple(p.shape)
            if src.shape(key) != full:
                raise CheckpointError(f"{f}: tensor '{key}' has shape {src.shape(key)}, expected {full}")
        t = read(p)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{f}: tensor '{key}' has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        exact = p.dtype == torch.float8_e4m3fn or key.endswith("_scale_inv")  # FP8 bytes and scales as stored
        cast = t.contiguous() if exact else t.to(dtype).contiguous()
        if cast.dtype == torch.float16 and t.dtype != torch.float16 and not bool(torch.isfinite(cast).all()):
            raise CheckpointError(f"{f}: tensor '{key}' has values beyond the float16 range")
        if p.is_meta:  # built without memory: the loaded tensor becomes the parameter of every module sharing it
            new = torch.nn.Parameter(cast, requires_grad=p.requires_grad)
            for owner, attr in owners[id(p)]:
                owner._parameters[attr] = new
        else:
            with torch.no_grad():
                p.data = cast


def _owners(module) -> dict:
    """id(parameter) -> every (module, attribute) holding it (a tied embedding is held twice)."""
    out = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, attr))
    return out


def _target_prefix(src: WeightSource) -> str:
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in src.where:
            return prefix
    raise CheckpointError(f"{src.files[0]}: missing tensor 'model.embed_tokens.weight' (not a Qwen3-Next/3.5 decoder?)")


def _refuse_unused(src: WeightSource, used: set, what: str, layers: str, n_layers: int, ignored=()) -> None:
    """Every tensor of the checkpoint is bound to the model or refused here by name: one left over (a bias, a
    scale, an extra layer, a typo) would change the math the checkpoint's author meant without a word."""
    extra = sorted(k for k in src.where if k not in used and not k.startswith(tuple(ignored)))
    if extra:
        k = extra[0]
        more = f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{src.where[k]}: {what} tensor '{k}' is not used by the model "
                              f"({why_unused(k, layers, n_layers, used)}){more}")


def _built(d: str, cfg: TargetConfig, prefix: str, device: str) -> TargetModel:
    """The target's modules (FP8 projections where quantization_config converts them), weights not yet bound."""
    import torch

    from dflash_trt.modeling.target import TargetModel

    with torch.device(device):
        model = TargetModel(cfg, empty=True)
        if cfg.quant is not None:
            from dflash_trt.modeling.fp8 import quantize_modules

            quantize_modules(model, cfg.quant, prefix, os.path.join(d, "config.json"))
    return model


def target_skeleton(d: str) -> TargetModel:
    """The target of checkpoint d as load_target builds it, on the meta device: no memory, no weight read."""
    cfg = TargetConfig.from_dict(read_json(os.path.join(d, "config.json")), os.path.join(d, "config.json"))
    return _built(d, cfg, _target_prefix(WeightSource(d)), "meta")


def load_target(d: str, dtype=None, split=None) -> TargetModel:
    """dtype: a torch dtype (default float32). split: a function the model goes through before its weights bind,
    built on the meta device (no memory): every parameter it cuts (runtime/parallel/shard.py's shard_target, a
    rank's shard) is then read from only its slices of the checkpoint, so a rank never holds the whole model."""
    import torch

    from dflash_trt.export.experts import expert_keys, stack_experts

    dtype = dtype or torch.float32
    cfg = TargetConfig.from_dict(read_json(os.path.join(d, "config.json")), os.path.join(d, "config.json"))
    src = WeightSource(d)
    prefix = _target_prefix(src)
    model = _built(d, cfg, prefix, "meta" if split else "cpu")
    if split:
        split(model)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in src.where
    if tied and not cfg.tie_word_embeddings:
        raise CheckpointError(f"{src.files[0]}: missing tensor 'lm_head.weight' and tie_word_embeddings is false")
    name_of = lambda n: "lm_head.weight" if n == "lm_head.weight" else prefix + n  # noqa: E731
    used = {name_of(n) for n, _ in model.named_parameters()} | expert_keys(model, src, prefix)
    if tied and "lm_head.weight" in src.where:  # a tied checkpoint may still store the copy: it must be one
        embed = model.embed_tokens.weight  # (this rank's rows of) both
        if not torch.equal(src.read_split("lm_head.weight", embed), src.read_split(prefix + "embed_tokens.weight",
                                                                                   embed)):
            raise CheckpointError(f"{src.where['lm_head.weight']}: tensor 'lm_head.weight' differs from "
                                  f"'{prefix}embed_tokens.weight' but tie_word_embeddings is true")
        used.add("lm_head.weight")
    # text decoder only: a multimodal checkpoint's vision tower (model.visual.*) and the multi-token-prediction
    # head Qwen releases ship (mtp.*; DFlash drafts instead) are not used, by name, never loaded
    ignored = ["mtp."] + (["model.visual."] if prefix == "model.language_model." else [])
    _bind(model, src, name_of, dtype, "target", built=stack_experts(model, src, prefix),
          unused=lambda: _refuse_unused(src, used, "target", prefix, cfg.num_layers, ignored))
    return model.eval()


def _drafter_key(src: WeightSource):
    """Parameter name -> checkpoint key: DFlash2 releases store the selector's codebooks without '.weight'; either
    spelling is read as stored (both present: the other is left over and refused)."""
    def name_of(n: str) -> str:
        bare = n[: -len(".weight")]
        if n.endswith("_codebook.weight") and n not in src.where and bare in src.where:
            return bare
        return n
    return name_of


def load_drafter(d: str, target: TargetModel, dtype=None) -> Drafter:
    """dtype: a torch dtype (default float32)."""
    import torch

    from dflash_trt.modeling.drafter import Drafter

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
    drafter = Drafter(cfg, target.cfg.hidden_size, target.cfg.vocab_size)
    name_of = _drafter_key(src)
    used = {name_of(n) for n, _ in drafter.named_parameters()}
    _bind(drafter, src, name_of, dtype, "drafter",
          unused=lambda: _refuse_unused(src, used, "drafter", "", cfg.num_layers))
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
    """Write config.json + model.safetensors, each atomically (the embedded demo models, tests)."""
    from safetensors.torch import save

    tensors = {(n if n == "lm_head.weight" else prefix + n): (p.detach().to(dtype) if dtype else p.detach()).clone()
               for n, p in module.named_parameters(remove_duplicate=True)}
    write_bytes(os.path.join(d, "model.safetensors"), save(tensors, metadata={"format": "pt"}))
    write_json(os.path.join(d, "config.json"), config, indent=2)
