"""The CUDA driver side shared by every op's launcher: context, NVRTC module cache, kernel launch.

Launchers (plugins/<op>/launch.py) take raw device pointers (ints) and a CUstream handle (int); they
validate shapes / dtypes against their op's spec before calling ``launch``. Modules are NVRTC-compiled
for the current device's exact arch (cubin) and cached per context; cuda-python is imported only when a
kernel is actually loaded, so the checks run (and are tested) without a GPU.
"""
from __future__ import annotations

import ctypes
import os
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


_arch: dict = {}


def device_arch() -> tuple:
    """(major, minor) compute capability of the current context's device (cached per context)."""
    key = int(_context())
    arch = _arch.get(key)
    if arch is None:
        arch = _arch[key] = _query_arch()
    return arch


def _query_arch() -> tuple:
    cu = driver()
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


_pdl: dict = {}


def pdl_switch() -> bool:
    """DFLASH_TRT_PDL is not "0": programmatic dependent launch for our kernels (pdl_enabled) and the compiled
    steps' Triton kernels (torch_compile.INDUCTOR_OPTIONS). "0" turns both off (a same-run A/B)."""
    return os.environ.get("DFLASH_TRT_PDL", "1") != "0"


def pdl_enabled() -> bool:
    """Whether `launch(..., pdl=True)` uses programmatic dependent launch: compute capability 9.0 or newer (the
    griddepcontrol instructions) and pdl_switch(). Per context."""
    key = int(_context())
    on = _pdl.get(key)
    if on is None:
        on = _pdl[key] = device_arch() >= (9, 0) and pdl_switch()
    return on


def launch(fn, grid, block, smem, stream, args, pdl: bool = False) -> None:
    """cuLaunchKernel with `args` as (value, P | I | F) pairs, asynchronously on `stream`.
    pdl: the kernel may start while the previous kernel on the stream finishes (programmatic stream
    serialization, CUDA graphs keep it as a programmatic edge). Only for kernels that run common.cuh's pdl_wait()
    before they read anything an earlier kernel writes, and before they write anything: what runs before the wait
    overlaps the previous kernel's tail (gemv: its first weight loads)."""
    cu = driver()
    vals = tuple(int(a) if t in (P, I) else float(a) for a, t in args)
    types = tuple(t for _, t in args)
    if not (pdl and pdl_enabled()):
        check(cu.cuLaunchKernel(fn, *grid, *block, smem, cu.CUstream(int(stream)), (vals, types), 0), "cuLaunchKernel")
        return
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes, cfg.hStream = smem, cu.CUstream(int(stream))
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs, cfg.numAttrs = [attr], 1
    check(cu.cuLaunchKernelEx(cfg, fn, (vals, types), 0), "cuLaunchKernelEx")
