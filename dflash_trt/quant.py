"""The one quantized checkpoint format loaded: FP8 block-wise weights (Qwen's FP8 releases, transformers'
FineGrainedFP8Config). config.json's `quantization_config` is parsed here into an Fp8Config; every key is read
or refused by name, any other quant_method (awq, gptq, modelopt, bitsandbytes, ...) is refused in one line.

A converted linear stores `weight` float8_e4m3fn [N,K] and `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)];
the real weight is W[n,k] = weight[n,k] * weight_scale_inv[n // bn, k // bk] (modeling/fp8.py). Pure python: the
ORT path reads configs without torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_trt.config_fields import ConfigError

BLOCK = (128, 128)  # the only block the released checkpoints (and our kernels to come) use
# keys of quantization_config: read (and checked) here; any other key is refused by name
_KEYS = ("quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert",
         "ignored_layers", "dequantize", "scale_fmt", "expert_dtype", "modules_to_convert")


@dataclass(frozen=True)
class Fp8Config:
    """block = (rows, cols) of one scale block; skip = modules_to_not_convert / ignored_layers patterns."""
    block: tuple[int, int] = BLOCK
    skip: tuple[str, ...] = ()

    def converts(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. 'model.layers.0.mlp.gate_proj') is FP8, by transformers'
        rule (quantizers_utils.should_convert_module): a pattern skips a module when it matches from the start up
        to a module boundary (also as a regex), or when the name ends with it."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.skip)


def _refuse(path: str, key: str, value, what: str):
    raise ConfigError(f"{path}: field 'quantization_config.{key}' {value!r} is not supported ({what})")


def _skip_list(q: dict, path: str) -> tuple[str, ...]:
    both = [k for k in ("modules_to_not_convert", "ignored_layers") if q.get(k) is not None]
    if len(both) == 2:
        raise ConfigError(f"{path}: fields 'quantization_config.modules_to_not_convert' and "
                          "'quantization_config.ignored_layers' are both set (one skip list, two spellings)")
    skip = q.get(both[0]) if both else []
    if not isinstance(skip, list) or not all(isinstance(s, str) and s for s in skip):
        raise ConfigError(f"{path}: field 'quantization_config.{both[0]}' must be a list of module names, "
                          f"got {skip!r}")
    for s in skip:
        try:
            re.compile(s)
        except re.error as e:
            raise ConfigError(f"{path}: field 'quantization_config.{both[0]}' entry {s!r} is not a valid "
                              f"pattern ({e})") from None
    return tuple(skip)


def parse_quant(q, path: str, prefix: str = "") -> Fp8Config | None:
    """config.json's quantization_config (None: an unquantized checkpoint) -> Fp8Config; absent keys take
    transformers' defaults (e4m3, [128, 128], dynamic), anything else is one ConfigError naming the key."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{path}: field '{prefix}quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{path}: field '{prefix}quantization_config' (quant_method {method!r}) is not supported: "
                          "only FP8 block-wise checkpoints (quant_method 'fp8') are loaded; use that or the "
                          "bf16 release")
    unknown = sorted(set(q) - set(_KEYS))
    if unknown:
        _refuse(path, unknown[0], q[unknown[0]], "unknown FP8 quantization field")
    if q.get("fmt", "e4m3") != "e4m3":
        _refuse(path, "fmt", q["fmt"], "only e4m3 (float8_e4m3fn) weights")
    block = q.get("weight_block_size", list(BLOCK))
    if not isinstance(block, (list, tuple)) or tuple(block) != BLOCK:
        _refuse(path, "weight_block_size", block, "only [128, 128] blocks")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        _refuse(path, "activation_scheme", q["activation_scheme"], "only 'dynamic': static activation scales "
                "are not loaded")
    for key, ok, what in (("dequantize", False, "false only"), ("scale_fmt", "float", "float32 scales only"),
                          ("expert_dtype", "fp8", "FP8 experts only")):
        if q.get(key, ok) != ok:
            _refuse(path, key, q[key], what)
    if q.get("modules_to_convert"):
        _refuse(path, "modules_to_convert", q["modules_to_convert"], "FP8 embeddings are not loaded")
    return Fp8Config(block=BLOCK, skip=_skip_list(q, path))
