"""NVRTC build of the ops' CUDA sources through cuda-python, with an on-disk cache.

compile_source(name, arch) -> bytes: cubin for ``sm_XY``, PTX for ``compute_XY`` of
``plugins/<name>/kernel.cu``, compiled with the ``-D`` macros of that op's spec (``cuda_defines``: the
limits the host also reads are stated once, in spec.py). The cache key is the sha256 of the source +
headers + arch + options + NVRTC version; the cache directory is ``$DFLASH_TRT_CACHE`` or
``~/.cache/dflash_trt`` (sub-folder ``nvrtc``). No GPU is needed. The sources are self-contained (no
toolkit headers); include dirs are still passed when found. Local includes resolve in the kernel's
folder, then in plugins/ (common.cuh).
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import tempfile

from dflash_trt.config import cache_root
from dflash_trt.plugins.registry import bundles

HERE = os.path.dirname(os.path.abspath(__file__))
# kernel source folder -> the OpSpec whose cuda_defines it is compiled with
SPECS = {b.folder: b.spec for b in bundles()}
SOURCES = tuple(SPECS)
DEFAULT_OPTIONS = ("-std=c++17", "-default-device", "-lineinfo")


class NvrtcError(RuntimeError):
    """An NVRTC compile failed; ``.log`` holds the compiler log."""

    def __init__(self, name: str, arch: str, log: str):
        self.log = log
        super().__init__(f"NVRTC failed to compile {name} for {arch}:\n{log}")


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:  # cuda-python < 12.6 layout
        from cuda import nvrtc  # type: ignore
    return nvrtc


def _check(res, what):
    nvrtc = _nvrtc()
    err = res[0] if isinstance(res, tuple) else res
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what}: {err}")
    return res[1:] if isinstance(res, tuple) and len(res) > 1 else None


def nvrtc_version() -> tuple:
    out = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return tuple(out)


def include_dirs() -> list:
    dirs = []
    try:
        import nvidia  # namespace package of the pip CUDA wheels
        for root in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(root, "cu*", "include")))
            dirs += sorted(glob.glob(os.path.join(root, "cuda_runtime", "include")))
    except ImportError:
        pass
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs.append(os.path.join(home, "include"))
    return [d for d in dirs if os.path.isdir(d)]


def cache_dir() -> str:
    return os.path.join(cache_root(), "nvrtc")


def source_path(name: str) -> str:
    return os.path.join(HERE, name, "kernel.cu")


def read_source(name: str) -> str:
    with open(source_path(name)) as f:
        return f.read()


def _headers(src: str, dirs=(HERE,), out=None) -> dict:
    """Local ``#include "x.cuh"`` files (first found in `dirs`) and theirs in turn, handed to NVRTC in memory."""
    out = {} if out is None else out
    for inc in re.findall(r'#include\s+"([^"]+)"', src):
        if inc in out:
            continue
        for d in dirs:
            path = os.path.join(d, inc)
            if os.path.exists(path):
                with open(path) as f:
                    out[inc] = f.read()
                _headers(out[inc], dirs, out)
                break
    return out


def define_options(name: str) -> list:
    """``-DNAME=value`` for the spec's cuda_defines of kernel source `name`."""
    return [f"-D{k}={v}" for k, v in sorted(SPECS[name].cuda_defines.items())]


def normalize_arch(arch) -> str:
    """Accept 90, '90', 'sm_90', 'compute_90', (9, 0); return 'sm_90' / 'compute_90'."""
    if isinstance(arch, tuple):
        return f"sm_{arch[0]}{arch[1]}"
    a = str(arch)
    if a.isdigit():
        return "sm_" + a
    if not re.fullmatch(r"(sm|compute)_\d+[af]?", a):
        raise ValueError(f"bad CUDA arch {arch!r}: use e.g. 'sm_90' (cubin) or 'compute_90' (PTX)")
    return a


def compile_text(src: str, name: str, arch, options=(), headers=None, use_cache=True) -> bytes:
    """Compile CUDA C++ text; return cubin (sm_XY) or PTX (compute_XY) bytes."""
    arch = normalize_arch(arch)
    headers = _headers(src) if headers is None else headers
    opts = [f"--gpu-architecture={arch}", *DEFAULT_OPTIONS, *options]
    opts += [f"-I{d}" for d in include_dirs()]
    ptx = arch.startswith("compute_")
    key_src = "\0".join([src, *(f"{k}\0{v}" for k, v in sorted(headers.items())), arch, *opts[1:],
                         repr(nvrtc_version())])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), f"{name}-{arch}-{key}.{'ptx' if ptx else 'cubin'}")
    if use_cache and os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    nvrtc = _nvrtc()
    hnames = [k.encode() for k in headers]
    hsrcs = [v.encode() for v in headers.values()]
    (prog,) = _check(nvrtc.nvrtcCreateProgram(src.encode(), f"{name}.cu".encode(), len(hnames), hsrcs, hnames),
                     "nvrtcCreateProgram")
    try:
        bopts = [o.encode() for o in opts]
        res = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log = log.decode(errors="replace").rstrip("\0 \n")
        err = res[0] if isinstance(res, tuple) else res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NvrtcError(name, arch, log or str(err))
        if ptx:
            (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            out = b" " * size
            _check(nvrtc.nvrtcGetPTX(prog, out), "nvrtcGetPTX")
        else:
            (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            out = b" " * size
            _check(nvrtc.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if use_cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(out)
        os.replace(tmp, path)  # atomic: concurrent builders never see a partial file
    return out


def compile_source(name: str, arch, options=(), use_cache=True) -> bytes:
    """Compile ``plugins/<name>/kernel.cu`` (name in SOURCES) with its spec's -D macros."""
    if name not in SOURCES:
        raise ValueError(f"unknown kernel source {name!r}; have {SOURCES}")
    src = read_source(name)
    headers = _headers(src, (os.path.dirname(source_path(name)), HERE))
    return compile_text(src, name, arch, [*define_options(name), *options], headers=headers, use_cache=use_cache)
