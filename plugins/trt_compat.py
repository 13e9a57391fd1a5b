"""The one module that knows which TensorRT flavour is imported (DESIGN §6).

``trt`` is full TensorRT (``import tensorrt``, >= 10) when present, else TensorRT-RTX
(``import tensorrt_rtx``), else None. ``DFLASH_TRT_FLAVOUR=tensorrt|tensorrt_rtx`` forces one.
Everything else imports TensorRT through here. Without any flavour this module still imports: the
plugin classes then derive from ``object`` and use the stand-in enums below, so a GPU machine with no
TensorRT can drive each plugin's ``enqueue`` exactly as TensorRT would.

TensorRT-RTX's ONNX parser dlopens the unversioned ``libtensorrt_rtx.so`` when it meets a plugin
node and aborts the process if that fails; ``ensure_parser_lib()`` puts the symlink beside the
library (found there through the parser's ``$ORIGIN`` rpath) or explains what to do.
"""
from __future__ import annotations

import enum
import importlib
import importlib.util
import os
from types import SimpleNamespace

from dflash_trt.config import cache_root
from dflash_trt.plugins import opspec
from dflash_trt.plugins.opspec import MIN_ARCH

# TensorRT-RTX runs on these compute capabilities (not on 9.0 Hopper: full TensorRT is needed there).
RTX_CCS = ((7, 5), (8, 0), (8, 6), (8, 9), (12, 0), (12, 1))
MIN_KERNEL_CC = MIN_ARCH  # what our CUDA kernels need (stated in opspec)
INSTALL_HINT = ("install TensorRT: `pip install tensorrt-rtx` (GPUs of compute capability 8.0/8.6/8.9/12.x, incl. "
                "GB10; builds engines without a GPU) or full TensorRT >= 10 (`pip install tensorrt`; data-center "
                "GPUs incl. Hopper H100/H200, which TensorRT-RTX does not run on)")


class TensorRTMissing(ImportError):
    """No usable TensorRT flavour is installed."""


class ParserLibError(RuntimeError):
    """TensorRT-RTX's parser cannot find the unversioned libtensorrt_rtx.so (it would abort the process)."""


def _import():
    forced = os.environ.get("DFLASH_TRT_FLAVOUR", "").strip()
    names = [forced] if forced else ["tensorrt", "tensorrt_rtx"]
    errors = []
    for name in names:
        if name not in ("tensorrt", "tensorrt_rtx"):
            return None, None, f"DFLASH_TRT_FLAVOUR={forced!r}: use 'tensorrt' or 'tensorrt_rtx'"
        try:
            mod = importlib.import_module(name)
            mod.Builder  # a namespace stub without bindings does not count
            return mod, name, None
        except (ImportError, AttributeError, OSError) as e:
            errors.append(f"{name}: {e}")
    return None, None, "; ".join(errors)


trt, FLAVOUR, IMPORT_ERROR = _import()
HAVE_TRT = trt is not None
IS_RTX = FLAVOUR == "tensorrt_rtx"
VERSION = getattr(trt, "__version__", None)


def require():
    """The imported TensorRT module, or TensorRTMissing naming what to install."""
    if trt is None:
        raise TensorRTMissing(f"TensorRT is not importable ({IMPORT_ERROR}); {INSTALL_HINT}")
    return trt


def describe() -> dict:
    return {"flavour": FLAVOUR, "version": VERSION}


# ------------------------------------------------------------------ enums (real or stand-ins)
if trt is not None:
    DataType, TensorFormat, TensorRTPhase = trt.DataType, trt.TensorFormat, trt.TensorRTPhase
    PLUGIN_BASES = (trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime)
    CREATOR_BASES = (trt.IPluginCreatorV3One,)
else:
    class DataType(enum.IntEnum):  # same values as TensorRT's
        FLOAT = 0
        HALF = 1
        INT8 = 2
        INT32 = 3
        BOOL = 4
        UINT8 = 5
        FP8 = 6
        BF16 = 7
        INT64 = 8

    class TensorFormat(enum.IntEnum):
        LINEAR = 0

    class TensorRTPhase(enum.IntEnum):
        BUILD = 0
        RUNTIME = 1

    PLUGIN_BASES = (object,)
    CREATOR_BASES = (object,)

_DT_NAMES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64",
             "INT8": "int8", "BOOL": "bool", "UINT8": "uint8"}
_NAME_DT = {v: getattr(DataType, k) for k, v in _DT_NAMES.items() if hasattr(DataType, k)}
DTYPE_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "int8": 1, "bool": 1, "uint8": 1}


def dtype_name(t) -> str:
    """DataType (real or stand-in) or a name like 'torch.bfloat16' -> 'bfloat16'."""
    if isinstance(t, str):
        return opspec.dtype_name(t)
    return _DT_NAMES.get(getattr(t, "name", str(t)).split(".")[-1], str(t))


def data_type(name: str):
    return _NAME_DT[dtype_name(name)]


def init_bases(obj, bases) -> None:
    """Call each TensorRT base-class __init__ (pybind trampolines need it); no-op for stand-ins."""
    for base in bases:
        if base is not object:
            base.__init__(obj)


def tensor_desc(shape, dtype, fmt=None):
    """A PluginTensorDesc (TensorRT's when available) — what enqueue receives."""
    if trt is not None:
        d = trt.PluginTensorDesc()
        d.dims, d.type, d.format = trt.Dims(list(shape)), data_type(dtype), fmt or TensorFormat.LINEAR
        return d
    return SimpleNamespace(dims=tuple(shape), type=data_type(dtype), format=fmt or TensorFormat.LINEAR, scale=-1.0)


def dynamic_desc(shape, dtype):
    """A DynamicPluginTensorDesc (static shape: min = opt = max = shape)."""
    if trt is not None:
        d = trt.DynamicPluginTensorDesc()
        d.desc = tensor_desc(shape, dtype)
        d.min = d.opt = d.max = trt.Dims(list(shape))
        return d
    return SimpleNamespace(desc=tensor_desc(shape, dtype), min=tuple(shape), opt=tuple(shape), max=tuple(shape))


def plugin_fields(values: dict, types: dict, keep: list):
    """{name: python value} -> PluginFieldCollection (a list of stand-ins without TensorRT). A PluginField
    only points at its numpy buffer: the arrays are appended to `keep`, which the caller must keep alive."""
    import numpy as np

    out = []
    for name, v in values.items():
        kind = types[name]
        arr = np.array([v], dtype=np.float32 if kind == "float" else np.int32)
        keep.append(arr)
        if trt is not None:
            ft = trt.PluginFieldType.FLOAT32 if kind == "float" else trt.PluginFieldType.INT32
            out.append(trt.PluginField(name, arr, ft))
        else:
            out.append(SimpleNamespace(name=name, data=arr, type=kind))
    return trt.PluginFieldCollection(out) if trt is not None else out


def dims_exprs(exprs):
    return trt.DimsExprs(list(exprs)) if trt is not None else list(exprs)


# --------------------------------------------------------------- TensorRT-RTX parser library
def _rtx_lib_dir():
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def ensure_parser_lib() -> str | None:
    """Make `libtensorrt_rtx.so` findable by the TensorRT-RTX ONNX parser; returns its path (None for
    full TensorRT, which needs nothing). Raises ParserLibError with the fix when it cannot."""
    if not IS_RTX:
        return None
    name = "libtensorrt_rtx.so"
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    libdir = _rtx_lib_dir()
    if libdir is None or not os.path.exists(os.path.join(libdir, name + ".1")):
        raise ParserLibError(f"cannot find {name}.1 of the tensorrt-rtx wheel (package tensorrt_rtx_libs); "
                             "reinstall with `pip install --force-reinstall tensorrt-rtx`")
    link = os.path.join(libdir, name)
    if os.path.exists(link):
        return link
    try:
        os.symlink(name + ".1", link)  # the parser's rpath is $ORIGIN: found here, no LD_LIBRARY_PATH needed
        return link
    except FileExistsError:
        return link
    except OSError as e:
        alt = os.path.join(cache_root(), "lib")
        try:
            os.makedirs(alt, exist_ok=True)
            if not os.path.lexists(os.path.join(alt, name)):
                os.symlink(os.path.join(libdir, name + ".1"), os.path.join(alt, name))
        except OSError:
            pass
        raise ParserLibError(
            f"TensorRT-RTX's ONNX parser loads the unversioned {name} when it parses a plugin node and aborts the "
            f"process if it is missing; {libdir} is not writable ({e}). Start the process with "
            f"`export LD_LIBRARY_PATH={alt}:$LD_LIBRARY_PATH` (a symlink {alt}/{name} -> {libdir}/{name}.1 was "
            f"made for you), or run `ln -s {name}.1 {link}` as a user who can write there.") from None
