"""The CUDA driver side shared by every op's launcher: context, NVRTC module cache, kernel launch.

Launchers (plugins/<op>/launch.py) take raw device pointers (ints) and a CUstream handle (int); they
validate shapes / dtypes against their op's spec before calling ``launch``. Modules are NVRTC-compiled
for the current device's exact arch (cubin) and cached per context; cuda-python is imported only when a
kernel is actually loaded, so the checks run (and are tested) without a GPU.
"""
from __future__ import annotations

import ctypes
import threading

from dflash_trt.plugins import nvrtc
from dflash_trt.plugins.opspec import check_arch

# argument kinds of `launch`: pointer, int, float
P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def driver():
    from cuda.bindings import driver
    return driver


def check(res, what):
    """Unwrap a cuda-python driver result; RuntimeError naming `what` on failure."""
    cu = driver()
    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


_lock = threading.Lock()
_modules: dict = {}


def _context():
    """The current CUDA context; retains + sets device 0's primary context if none is current."""
    cu = driver()
    check(cu.cuInit(0), "cuInit")
    ctx = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        dev = check(cu.cuDeviceGet(0), "cuDeviceGet")
        ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def device_arch() -> tuple:
    cu = driver()
    _context()
    dev = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
    A = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attr")
    minor = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attr")
    return int(major), int(minor)


def get_function(source: str, name: str, max_dynamic_smem: int = 0):
    """CUfunction ``name`` of ``plugins/<source>/kernel.cu`` built for the current device. A kernel using
    more than 48 KiB of dynamic shared memory must say so once (max_dynamic_smem) before its first launch."""
    ctx = _context()
    key = (int(ctx), source)
    with _lock:
        entry = _modules.get(key)
        if entry is None:
            arch = device_arch()
            check_arch(arch)
            image = nvrtc.compile_source(source, f"sm_{arch[0]}{arch[1]}")
            mod = check(driver().cuModuleLoadData(image), f"cuModuleLoadData({source})")
            entry = _modules[key] = (mod, {})
        mod, funcs = entry
        fn = funcs.get(name)
        if fn is None:
            fn = check(driver().cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
            if max_dynamic_smem:
                A = driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check(driver().cuFuncSetAttribute(fn, A, max_dynamic_smem), "cuFuncSetAttribute")
            funcs[name] = fn
        return fn


_resident: dict = {}


def resident_ctas(fn, threads: int, smem: int = 0) -> int:
    """How many CTAs of `fn` (threads each, smem dynamic bytes) the whole device holds at once: the grid of a
    persistent kernel (cached per function)."""
    key = (int(fn), threads, smem)
    n = _resident.get(key)
    if n is None:
        cu = driver()
        dev = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
        sms = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                    "cuDeviceGetAttribute")
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem),
                       "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        n = _resident[key] = max(1, int(sms) * int(per_sm))
    return n


def launch(fn, grid, block, smem, stream, args) -> None:
    """cuLaunchKernel with `args` as (value, P | I | F) pairs, asynchronously on `stream`."""
    cu = driver()
    vals = tuple(int(a) if t in (P, I) else float(a) for a, t in args)
    types = tuple(t for _, t in args)
    check(cu.cuLaunchKernel(fn, *grid, *block, smem, cu.CUstream(int(stream)), (vals, types), 0), "cuLaunchKernel")
