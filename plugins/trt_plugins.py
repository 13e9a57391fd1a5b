"""The dflash TensorRT plugins of every op (plugins/<op>/trt_plugin.py, as the registry's bundles name them) and
their registration with TensorRT.

``register()`` puts one IPluginCreatorV3One per op into TensorRT's plugin registry (before parsing an ONNX
graph, and before deserializing an engine); ``unregister()`` removes them (graphs then parse with their ONNX
function bodies inlined). engines/ reads KERNEL_WARNINGS / SHAPE_ERRORS (trt_base) around a build.
"""
from __future__ import annotations

from dflash_trt.plugins import trt_compat as C
from dflash_trt.plugins.registry import trt_bundles
from dflash_trt.plugins.trt_base import KERNEL_WARNINGS, NAMESPACE, SHAPE_ERRORS, VERSION, DflashPluginCreator

__all__ = ["PLUGINS", "PLUGIN_VERSIONS", "NAMESPACE", "KERNEL_WARNINGS", "SHAPE_ERRORS", "creators", "register",
           "unregister", "registered_names"]

PLUGINS = {cls.SPEC.name: cls for cls in (b.trt_plugin_class() for b in trt_bundles())}
PLUGIN_VERSIONS = {name: VERSION for name in PLUGINS}

_registered: dict = {}  # name -> creator; kept alive here (TensorRT holds only a pointer)


def creators() -> dict:
    return {name: DflashPluginCreator(cls) for name, cls in PLUGINS.items()}


def _find(reg) -> dict:
    """name -> creator of the dflash creators in TensorRT's registry (no error log for absent ones)."""
    out = {}
    for cr in reg.all_creators:
        if getattr(cr, "plugin_namespace", None) == NAMESPACE and getattr(cr, "plugin_version", None) == VERSION:
            out[cr.name] = cr
    return out


def register() -> dict:
    """Register the dflash creators with TensorRT's plugin registry (idempotent); returns name -> creator."""
    trt = C.require()
    reg = trt.get_plugin_registry()
    present = _find(reg)
    for name, cr in creators().items():
        if name in present:  # by us earlier, or by someone else in this process
            _registered.setdefault(name, present[name])
            continue
        if not reg.register_creator(cr, NAMESPACE):
            raise RuntimeError(f"TensorRT refused to register plugin creator {NAMESPACE}::{name} v{VERSION}")
        _registered[name] = cr
    return dict(_registered)


def unregister() -> None:
    """Remove the dflash creators (graphs then parse with their ONNX function bodies inlined)."""
    trt = C.require()
    reg = trt.get_plugin_registry()
    for name, cr in _find(reg).items():
        if name in PLUGINS:
            reg.deregister_creator(cr)
    _registered.clear()


def registered_names() -> set:
    """Names of dflash plugins TensorRT can find now."""
    return set(_find(C.require().get_plugin_registry())) & set(PLUGINS)
