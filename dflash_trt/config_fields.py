"""Typed reads of config.json fields. Every value the model math takes is checked for type and range where it is
read, so a bad value is one line naming the file and the field, never a traceback or a silent cast
(a string eos_token_id iterated as characters, a float vocab_size, a bool taken as a count)."""
from __future__ import annotations

import json
import math
import os


class ConfigError(ValueError):
    """A checkpoint's config.json is missing, unreadable or inconsistent."""


# no released checkpoint has a size, count or token id this large; a larger one is a typo that would otherwise
# surface as an allocation failure far from the field that caused it
MAX_INT = 1 << 24


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: file not found")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    return data


def get(cfg: dict, key: str, path: str, default=...):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise ConfigError(f"{path}: missing required field '{key}'")
    return default


def integer(cfg: dict, key: str, path: str, default=..., minimum: int = 1, maximum: int = MAX_INT,
            name: str | None = None) -> int:
    """An integer field (a JSON int, not a bool or float) in minimum..maximum; sizes and counts: >= 1."""
    v = get(cfg, key, path, default)
    if v is None:  # absent, and the caller's default is None
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{path}: field '{name or key}' must be an integer >= {minimum}, got {v!r}")
    if v > maximum:
        raise ConfigError(f"{path}: field '{name or key}' must be an integer <= {maximum}, got {v!r}")
    return v


def number(cfg: dict, key: str, path: str, default=..., *, positive: bool = False, minimum: float | None = None,
           maximum: float | None = None, name: str | None = None) -> float:
    """A finite real field (a JSON int or float, not a bool or string), optionally > 0 or within bounds."""
    v = get(cfg, key, path, default)
    if v is None:
        return None
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    ok = ok and not (positive and v <= 0) and not (minimum is not None and v < minimum)
    ok = ok and not (maximum is not None and v > maximum)
    if not ok:
        rng = [s for s, on in (("> 0", positive), (f">= {minimum}", minimum is not None),
                               (f"<= {maximum}", maximum is not None)) if on]
        raise ConfigError(f"{path}: field '{name or key}' must be a finite number{' ' if rng else ''}"
                          f"{' and '.join(rng)}, got {v!r}")
    return float(v)


def boolean(cfg: dict, key: str, path: str, default=..., name: str | None = None) -> bool:
    v = get(cfg, key, path, default)
    if v is not None and not isinstance(v, bool):
        raise ConfigError(f"{path}: field '{name or key}' must be true or false, got {v!r}")
    return v


def obj(cfg: dict, key: str, path: str) -> dict:
    """A nested object field; absent or null reads as {}."""
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{path}: field '{key}' must be an object, got {v!r}")
    return v


def str_list(cfg: dict, key: str, path: str, choices: tuple[str, ...], length: int) -> list[str] | None:
    """A list of `length` strings from `choices` (None when absent): a bare string is not a list of characters."""
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != length:
        raise ConfigError(f"{path}: field '{key}' must list {length} layer types, got {v!r}")
    bad = [t for t in v if t not in choices]
    if bad:
        raise ConfigError(f"{path}: field '{key}' has unknown type {bad[0]!r} (expected {' or '.join(choices)})")
    return list(v)


def int_list(cfg: dict, key: str, path: str, minimum: int = 0, single_ok: bool = False) -> list[int] | None:
    """A list of integers >= minimum (None when absent); single_ok also takes one bare integer."""
    v = cfg.get(key)
    if v is None:
        return None
    items = [v] if single_ok and not isinstance(v, list) else v
    if not isinstance(items, list):
        raise ConfigError(f"{path}: field '{key}' must be a list of integers, got {v!r}")
    return [integer({key: t}, key, path, minimum=minimum) for t in items]


def refuse_unsupported(cfg: dict, path: str, prefix: str = "", quant_ok: bool = False) -> None:
    """Fields that change the math and that no model here implements: refused by name, never ignored.
    quant_ok: the caller parses quantization_config itself (targets: dflash_trt.quant)."""
    q = cfg.get("quantization_config")
    if q is not None and not quant_ok:
        method = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise ConfigError(f"{path}: field '{prefix}quantization_config' (quant_method {method!r}) is not supported: "
                          "quantized checkpoints are not loaded (use the bf16/fp16/fp32 release)")
    for key, what in (("attention_bias", "q/k/v/o projection biases"), ("mlp_bias", "MLP projection biases")):
        if get(cfg, key, path, False) is not False:
            raise ConfigError(f"{path}: field '{prefix}{key}' {cfg[key]!r} is not supported ({what})")
    act = get(cfg, "hidden_act", path, "silu")
    if act != "silu":
        raise ConfigError(f"{path}: field '{prefix}hidden_act' {act!r} is not supported (only 'silu')")
