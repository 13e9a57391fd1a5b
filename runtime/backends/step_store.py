"""Compiled steps kept on disk whole: torch's AOT precompile (`torch.compile(fn).aot_compile(args)`) captures
Dynamo's trace, its guards and Inductor's code of one step key in an artifact that a later process loads without
tracing the model again. Inductor's own caches (torch_compile.use_cache_dir) spare a second process the code
generation but not Dynamo's trace of every layer, which is most of a warm start (figures: docs/PERF.md).

One file per (fingerprint, step, step key) under <cache>/steps. The fingerprint is everything the trace specialises
on that a step key does not name: torch, Python and the GPU, this package's source, the backend and its options, the
DFLASH_TRT_* switches, the modules' structure, configs and parameter shapes and dtypes, the pool sizes and the
step's own settings. Parameter VALUES are not in it: the artifact reads the weights and pools from the live step
object at each call (it is called with that object), so the same file serves any checkpoint of the same shapes.
A file that does not load, or whose guards refuse the call, is compiled again and replaced; a stale one is never
loaded because its name differs. Files are written under a temporary name and renamed, so readers see whole files.
On by default from MIN_TORCH (default_on; DFLASH_TRT_STEP_STORE=1 / 0 forces it).
"""
from __future__ import annotations

import hashlib
import os
import sys

import torch

from dflash_trt.hashing import source_hash
from dflash_trt.owned import read_marker, write_marker

SUBDIR = "steps"
KIND = "compiled-steps"  # the directory's ownership marker (dflash_trt.owned): `cache clear` frees it
SOURCE = ("dflash_trt.modeling", "dflash_trt.plugins", "dflash_trt.runtime")
MODULES = ("dflash_trt.abi", "dflash_trt.config")


def supported() -> bool:
    """Whether this torch saves and loads AOT-compiled functions (torch >= 2.10; experimental there)."""
    try:
        import torch._dynamo.aot_compile  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(torch.compile(len), "aot_compile")


MIN_TORCH = (2, 13)  # the oldest torch the store was checked on (save, load in a new process, equal tokens)


def default_on() -> bool:
    """Whether compiled steps are stored by default: DFLASH_TRT_STEP_STORE=1 / 0 decides, else this torch supports
    the API and is at least MIN_TORCH (the API is experimental; older releases keep Dynamo's in-process cache)."""
    env = os.environ.get("DFLASH_TRT_STEP_STORE")
    if env in ("0", "1"):
        return env == "1" and supported()
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return version >= MIN_TORCH and supported()


def enable() -> None:
    """Torch releases that gate the API behind a Dynamo config flag get it set (later ones default it on)."""
    if getattr(torch._dynamo.config, "enable_aot_compile", True) is False:
        torch._dynamo.config.enable_aot_compile = True


def _switches() -> list:
    skip = ("DFLASH_TRT_CACHE", "DFLASH_TRT_STEP_STORE")  # where and whether steps are stored: not what they compute
    return sorted((k, v) for k, v in os.environ.items() if k.startswith("DFLASH_TRT_") and k not in skip)


def _module_shape(m) -> list:
    if m is None:
        return [None]
    return [repr(m), repr(getattr(m, "cfg", None)), repr(getattr(m, "tap_ids", None)),
            [(n, tuple(p.shape), str(p.dtype), p.device.type) for n, p in m.named_parameters()],
            [(n, tuple(b.shape), str(b.dtype), b.device.type) for n, b in m.named_buffers()]]


def fingerprint(steps, backend: str, options: dict | None) -> str:
    """sha256 of what a compiled step of `steps` (a FusedSteps over ModuleGraphs) depends on besides its key."""
    g = steps.graphs
    dev = steps.rt.device.device
    gpu = [torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev)] if dev.type == "cuda" else []
    parts = [torch.__version__, sys.version, gpu, backend, sorted((options or {}).items()), _switches(),
             source_hash(SOURCE, MODULES), _module_shape(g.target), _module_shape(g.drafter), repr(steps.rt.sizes),
             repr(steps.dcfg), steps.window, steps.graph_int32,
             sorted((k, tuple(v.shape), str(v.dtype)) for k, v in steps.pools.items() if hasattr(v, "shape"))]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class StepStore:
    """The compiled-step files of one fingerprint under root."""

    def __init__(self, root: str, fingerprint: str):
        self.dir, self.fingerprint = os.path.join(root, SUBDIR), fingerprint

    def path(self, name: str, key) -> str:
        digest = hashlib.sha256(repr((self.fingerprint, name, key)).encode()).hexdigest()[:32]
        return os.path.join(self.dir, f"{name}-{digest}.aot")

    def load(self, name: str, key):
        """The stored compiled function of (name, key), or None when there is none or it does not load (its
        reason returned beside it: (fn, None) / (None, reason or None))."""
        p = self.path(name, key)
        if not os.path.isfile(p):
            return None, None
        try:
            with open(p, "rb") as f:
                return torch.compiler.load_compiled_function(f), None
        except Exception as e:  # another torch/GPU wrote it, or a torn file: compile again, the save replaces it
            return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

    def save(self, name: str, key, fn) -> str | None:
        """Write fn (an AOT-compiled function) as (name, key)'s file; the reason it could not, or None."""
        if read_marker(self.dir) is None:
            if os.path.isdir(self.dir) and os.listdir(self.dir):
                return f"{self.dir} holds files dflash-trt did not write"
            os.makedirs(self.dir, exist_ok=True)
            write_marker(self.dir, KIND, [])
        p = self.path(name, key)
        tmp = f"{p}.tmp{os.getpid()}.{os.urandom(4).hex()}"
        try:
            fn.save_compiled_function(tmp)
            os.replace(tmp, p)
        except Exception as e:  # an object the artifact cannot serialise: the step still runs, compiled
            if os.path.exists(tmp):
                os.remove(tmp)
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return None
