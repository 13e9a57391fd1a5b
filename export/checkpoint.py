"""Load (and save) Hugging Face checkpoint directories: config.json + safetensors, never pickles.

Weights: a single model.safetensors or shards listed in model.safetensors.index.json; bf16/fp16/fp32
on disk, cast to the requested dtype. Every error names the file and, where it applies, the tensor.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig, cache_root, read_json
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


def _bind(module: torch.nn.Module, src: WeightSource, name_of, dtype, what: str) -> None:
    """Copy every parameter of `module` from the checkpoint, checking presence and shape first."""
    params = dict(module.named_parameters(remove_duplicate=True))
    missing = [name_of(p) for p in params if name_of(p) not in src.where]
    if missing:
        raise CheckpointError(
            f"{what} checkpoint {src.files[0] if len(src.files) == 1 else os.path.dirname(src.files[0])}: "
            f"missing tensor '{missing[0]}'" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    for p_name, p in params.items():
        key = name_of(p_name)
        t = src.get(key)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(
                f"{src.where[key]}: tensor '{key}' has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.data = t.to(dtype).contiguous()


def _target_prefix(src: WeightSource) -> str:
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in src.where:
            return prefix
    raise CheckpointError(f"{src.files[0]}: missing tensor 'model.embed_tokens.weight' (not a Qwen3-Next/3.5 decoder?)")


def load_target(d: str, dtype=torch.float32) -> TargetModel:
    cfg = TargetConfig.from_dict(read_json(os.path.join(d, "config.json")), os.path.join(d, "config.json"))
    src = WeightSource(d)
    prefix = _target_prefix(src)
    model = TargetModel(cfg)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in src.where
    if tied and not cfg.tie_word_embeddings:
        raise CheckpointError(f"{src.files[0]}: missing tensor 'lm_head.weight' and tie_word_embeddings is false")
    _bind(model, src, lambda n: "lm_head.weight" if n == "lm_head.weight" else prefix + n, dtype, "target")
    return model.eval()


def load_drafter(d: str, target: TargetModel, dtype=torch.float32) -> Drafter:
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


_HASHES: dict = {}  # in-process memo: (path, size, mtime_ns) of every file -> hash


def checkpoint_hash(d: str) -> str:
    """sha256 over config.json and the weight files' bytes (identifies the source of built artifacts).

    Hashing a large checkpoint takes seconds to minutes, so the result is remembered per file list, sizes and
    mtimes: in this process, and across processes in <cache>/checkpoint_hashes.json. Any rewrite of a file
    changes its mtime (or size) and so the key."""
    files = [os.path.join(d, "config.json")] + _weight_files(d)
    stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    if key in _HASHES:
        return _HASHES[key]
    disk_path = os.path.join(cache_root(), "checkpoint_hashes.json")
    try:
        with open(disk_path) as f:
            disk = json.load(f)
    except (OSError, ValueError):
        disk = {}
    if not isinstance(disk, dict) or not isinstance(disk.get(key), str):
        h = hashlib.sha256()
        for f in files:
            h.update(os.path.basename(f).encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        disk = disk if isinstance(disk, dict) else {}
        disk[key] = h.hexdigest()[:16]
        _write_json_atomic(disk_path, disk)
    _HASHES[key] = disk[key]
    return disk[key]


def _write_json_atomic(path: str, data) -> None:
    """Best effort (a cache): a read-only cache dir only costs a re-hash next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def save_checkpoint(module: torch.nn.Module, config: dict, d: str, prefix: str = "", dtype=None) -> None:
    """Write config.json + model.safetensors (used for the embedded demo models and by tests)."""
    os.makedirs(d, exist_ok=True)
    tensors = {}
    for n, p in module.named_parameters(remove_duplicate=True):
        key = n if n == "lm_head.weight" else prefix + n
        tensors[key] = (p.detach().to(dtype) if dtype else p.detach()).contiguous().clone()
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
