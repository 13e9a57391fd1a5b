"""The op folders, listed once. A new op is its folder (plugins/<op>/, whose __init__.py exports BUNDLE, an
opspec.OpBundle) plus its line in OP_FOLDERS; ops, torch_ops, trt_plugins, onnx_functions, nvrtc and the host
device read the bundles from here. Importing this module loads only the specs (pure python)."""
from __future__ import annotations

import importlib

from dflash_trt.plugins.opspec import OpBundle

# The order is that of the TensorRT plugin registration and of every by-name table built from it.
OP_FOLDERS = (
    "gdn",
    "conv",
    "paged_attention",
    "moe",
    "gemv",
    "gemv_fp8",
)


def bundles() -> tuple[OpBundle, ...]:
    """Every op folder's bundle, in OP_FOLDERS order."""
    return tuple(importlib.import_module(f"dflash_trt.plugins.{f}").BUNDLE for f in OP_FOLDERS)


def onnx_bundles() -> tuple[OpBundle, ...]:
    """The ops exported as `dflash::<Op>` nodes (those with an ONNX function body)."""
    return tuple(b for b in bundles() if b.onnx_body is not None)


def trt_bundles() -> tuple[OpBundle, ...]:
    """The ops with a TensorRT plugin."""
    return tuple(b for b in bundles() if b.trt_plugin is not None)


def install_methods(cls, part: str, static: bool = False):
    """Every bundle's `part` functions (host_twins, device_ops) as methods of `cls`, named as the functions; a name
    `cls` already has is an error (two folders, or a folder and the class, would define one method)."""
    for b in bundles():
        for name, fn in b.functions(part).items():
            if hasattr(cls, name):
                raise RuntimeError(f"{b.package} names {part} '{name}', which {cls.__name__} already has")
            setattr(cls, name, staticmethod(fn) if static else fn)
    return cls
