"""Inductor for the GPU step: the prefill/decode/spec steps of torch_fused_step compiled with
`torch.compile(fullgraph=True, dynamic=False)`, our kernels (dflash:: custom ops with fake impls) opaque inside.

Why Inductor here rather than hand-fused NVRTC kernels: the step is ~70 small kernels per layer (casts, RMSNorms,
RoPE, gates, SwiGLU, pool-slot gathers); Inductor fuses those elementwise/reduction chains into Triton kernels
without a second copy of the model math, and the compiled code is then captured in the step's own CUDA graph
(graph_executor). GEMMs stay cuBLAS.

Cost: one compile per step key (kind, K, batch bucket) on first use, done during the warm-up before the capture,
each one announced on stderr with its time. The prefill chunk is compiled too: a request joining a running batch
puts its prefill between the others' steps. Inductor's on-disk caches (FX graphs, AOTAutograd, Triton kernels) live
under the dflash-trt cache (use_cache_dir), so a later process loads the compiled code; what every process still
pays is Dynamo's trace of the step (figures: docs/PERF.md).

Regional compile (opt-in, compile_steps(regions=True)): the models' pieces (modeling/regions.py) compile instead of
each step whole, one graph per kind of layer reused by every layer of that kind, so the compile no longer grows with
the layer count; the step's glue compiles as the graphs between its calls into the models (figures: docs/PERF.md).

fp32 targets: cuBLAS's heuristics pick slow kernels for the small fp32 GEMMs of a verify step, cuBLASLt fast ones.
torch's BLAS preference is process-wide: `prefer_cublaslt` sets it when the GPU runtime computes in fp32.
Figures for each choice here: docs/PERF.md (runtime step).
"""
from __future__ import annotations

import functools
import os
import time
import warnings

import torch

from dflash_trt.abi import MAX_K
from dflash_trt.config import cache_root
from dflash_trt.log import progress
from dflash_trt.modeling.regions import Eager
from dflash_trt.owned import write_marker
from dflash_trt.plugins.cuda_launch import pdl_switch
from dflash_trt.runtime.batching import BUCKETS

COMPILED = ("prefill", "decode", "spec")  # every step the executor captures
RECOMPILE_LIMIT = len(BUCKETS) * MAX_K * 2  # keys per step function: batch buckets x K x greedy/sampled
# Inductor options for the step (figures: docs/PERF.md). max_pointwise_cat_inputs: a torch.stack / cat of more
# inputs than this (default 8) becomes one copy kernel per input, and the step stacks one tensor per GDN layer.
# combo_kernels: data-independent kernels share one launch (the commit data's stack kernels).
# triton.enable_pdl: programmatic dependent launch between the step's kernels on sm_90+ (Inductor checks the GPU):
# each Triton kernel lets the next one start once its loads are done, and our kernels, launched the same way, start
# their work that needs no input under the previous kernel's tail (common.cuh has the rule). Off with
# DFLASH_TRT_PDL=0 (cuda_launch.pdl_switch).
# test_configs.force_filter_reduction_configs: each reduction kernel takes the config Inductor's deterministic mode
# picks by rule, not the one that benchmarked fastest in a (busy) warm-up, so timings do not drift between compiles.
# Set only where this torch has the key (torch.compile refuses unknown options).
INDUCTOR_OPTIONS = {"max_pointwise_cat_inputs": 128, "combo_kernels": True}
if "test_configs.force_filter_reduction_configs" in torch._inductor.config._config:
    INDUCTOR_OPTIONS["test_configs.force_filter_reduction_configs"] = True


def _no_grad(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.no_grad():  # parameters may require grad (training tools); a step never needs autograd
            return fn(*args, **kwargs)

    return run


def step_key(obj):
    """What selects a step's compiled graph besides tensor values: tensor shapes, dtypes and devices, which entries
    a buffer dict has (greedy vs sampled keys), and plain values, through dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype), obj.device.type)
    if isinstance(obj, dict):
        return ("dict",) + tuple((str(k), step_key(v)) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0])))
    if isinstance(obj, (list, tuple)):
        return ("seq",) + tuple(step_key(v) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return type(obj).__name__


def describe_call(name: str, args, kwargs=None) -> str:
    """A step call in a few words for the compile progress lines: the step, its batch rows, K, sampled or not (a
    module's own step called with keywords, as benches time it: its batch and K from input_ids)."""
    b = args[0] if args and isinstance(args[0], dict) else {}
    ids = (kwargs or {}).get("input_ids")
    if isinstance(ids, torch.Tensor):
        return f"batch {ids.shape[0]} K={ids.shape[-1]}"
    words = [name]
    if isinstance(b.get("srow"), torch.Tensor):
        words.append(f"batch {b['srow'].shape[0]}")
    if isinstance(b.get("ids"), torch.Tensor):
        words.append(f"{b['ids'].shape[-1]} rows")
    if len(args) > 1 and isinstance(args[1], int):
        words.append(f"K={args[1] + 1}")
    if "temperature" in b:
        words.append("sampled")
    return " ".join(words)


CACHE_SUBDIR = "inductor"
CACHE_KIND = "inductor-cache"  # its ownership marker's kind (dflash_trt.owned)


def use_cache_dir() -> str:
    """Inductor's caches go under the dflash-trt cache root (CACHE_SUBDIR) unless TORCHINDUCTOR_CACHE_DIR is set:
    the compiled steps then persist beside the exports and NVRTC kernels instead of in a shared /tmp directory a
    reboot clears. Inductor keys every artifact by the traced graph, its config, the torch and Triton versions and
    the GPU, so a stale or foreign one is never loaded. Returns the directory in use."""
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not d:
        d = os.path.join(cache_root(), CACHE_SUBDIR)
        if not os.path.isdir(d):  # ours: `dflash-trt cache clear` frees only a directory carrying our marker
            os.makedirs(d)
            write_marker(d, CACHE_KIND, [])
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    return d


class CompiledStep:
    """A step method through torch.compile: whole graph (a graph break would split the step), static shapes per key.
    With a StepStore (runtime/backends/step_store.py) each key is AOT-compiled once, saved, and loaded by later
    processes without tracing; without one, Dynamo's in-process cache holds the keys.
    A compile that fails (Dynamo cannot trace, the backend fails) is not the request's fault: that key (step_key of
    the call: batch bucket, K, greedy or sampled) runs uncompiled from then on, the reason kept in `failures` and
    warned once; every other key still compiles — the compile-time twin of the capture's brick guard. Errors the
    step itself raises pass through.
    backend: a torch.compile backend ("aot_eager" traces exactly as Inductor does without generating code:
    the CPU test of the tracing)."""

    def __init__(self, owner, name: str, backend: str = "inductor", store=None, regions: bool = False):
        """regions: the model pieces compile on their own (CompiledRegions, set on steps.graphs by compile_steps) and
        the step's glue around them compiles as the graphs between its model calls (each call a graph break)."""
        _raise_recompile_limits()
        self.owner, self.name, self.store = owner, name, store
        self.fn = _no_grad(getattr(owner, name))
        options = step_options(backend)
        self.compiled = torch.compile(self.fn, fullgraph=not regions, dynamic=False, backend=backend, options=options)
        self.unbound = torch.compile(getattr(type(owner), name), fullgraph=True, dynamic=False, backend=backend,
                                     options=options) if store is not None else None
        self.failures: list[str] = []
        self.eager_keys: set = set()  # step_key of the calls whose compile failed
        self.compiled_keys: set = set()  # keys in Dynamo's in-process cache
        self.stored: dict = {}  # key -> its AOT-compiled function (loaded or compiled here), called with owner

    def __reduce__(self):
        # AOT precompile pickles what a traced step's inputs reach (its guards' state), the steps object and through
        # it its compiled steps: those hold compiled code that does not pickle, and no trace reads them
        return (str, (f"compiled step {self.name}",))

    def __call__(self, *args, **kwargs):
        key = step_key((args, kwargs))
        if key in self.stored:
            with torch.no_grad():  # the artifact's guards hold grad mode off
                return self.stored[key](self.owner, *args, **kwargs)
        if key in self.compiled_keys:
            return self.compiled(*args, **kwargs)
        if key in self.eager_keys:
            return self.fn(*args, **kwargs)
        return self._first_call(key, args, kwargs)

    def _first_call(self, key, args, kwargs):
        what, t0 = describe_call(self.name, args, kwargs), time.perf_counter()
        if self.store is not None:
            hit = self._load(key, what, args, kwargs)
            if hit is not None:
                return hit[0]
        progress(f"compiling step {what} ...")
        try:
            if self.store is not None:
                out = self._compile_stored(key, what, args, kwargs)
            else:
                out = self._compile_in_process(key, args, kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # traced before anything ran: safe to rerun
            line = compile_failure(e)
            self.failures.append(line)
            self.eager_keys.add(key)
            warnings.warn(f"compiled step {self.name} fell back to eager for this key (others stay compiled): {line}")
            return self.fn(*args, **kwargs)
        progress(f"compiled step {what} in {time.perf_counter() - t0:.1f} s")
        return out

    def _compile_in_process(self, key, args, kwargs):
        out = self.compiled(*args, **kwargs)
        self.compiled_keys.add(key)
        return out

    def _load(self, key, what: str, args, kwargs):
        """(the step's output,) from the stored artifact of this key, or None (absent, or refused: then compiled)."""
        t0 = time.perf_counter()
        fn, why = self.store.load(self.name, key)
        if fn is not None:
            try:
                with torch.no_grad():
                    out = fn(self.owner, *args, **kwargs)
            except Exception as e:  # its guards refused this call (checked before anything ran)
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            else:
                self.stored[key] = fn
                progress(f"loaded compiled step {what} in {time.perf_counter() - t0:.1f} s")
                return (out,)
        if why:
            progress(f"stored step {what} not usable ({why}): compiling it again")
        return None

    def _compile_stored(self, key, what: str, args, kwargs):
        """AOT-compile this key, run it, save it (a save that fails costs only the later processes' compile). Where
        this torch cannot AOT-compile the step, the store is dropped: Dynamo's in-process cache from then on."""
        try:
            with torch.no_grad():
                fn = self.unbound.aot_compile(((self.owner, *args), kwargs))
        except torch._dynamo.exc.TorchDynamoException:
            raise
        except Exception as e:  # an experimental API of this torch: the step still compiles, in process
            progress(f"step {what} not AOT-compiled ({type(e).__name__}: {str(e)[:160]}): compiling it in process")
            self.store = None
            return self._compile_in_process(key, args, kwargs)
        with torch.no_grad():
            out = fn(self.owner, *args, **kwargs)
        self.stored[key] = fn
        why = self.store.save(self.name, key, fn)
        if why:
            progress(f"compiled step {what} not stored ({why})")
        return out


def compile_failure(e: Exception) -> str:
    """A failed compile in one line: its first two non-empty lines ("backend raised:" + why), or its type."""
    return " ".join([x.strip() for x in str(e).splitlines() if x.strip()][:2]) or type(e).__name__


def _raise_recompile_limits() -> None:
    """Each step key is a recompile of the same code object (a model piece: of each piece)."""
    cfg = torch._dynamo.config
    limits = {"cache_size_limit": RECOMPILE_LIMIT, "recompile_limit": RECOMPILE_LIMIT,
              "accumulated_cache_size_limit": 8 * RECOMPILE_LIMIT, "accumulated_recompile_limit": 8 * RECOMPILE_LIMIT}
    for limit, n in limits.items():
        if hasattr(cfg, limit):
            setattr(cfg, limit, max(getattr(cfg, limit), n))


class CompiledRegions(Eager):
    """The model pieces of modeling/regions.py through torch.compile (fullgraph, static shapes), one compiled function
    per piece: a piece's graph serves every layer it guards alike (same code, same shapes; the weights and the
    layer's pool slices are its inputs), so a step's compile time no longer grows with its layers. A piece whose
    compile fails (traced before anything ran) runs eagerly from then on, its reason warned once."""
    views = True

    def __init__(self, backend: str = "inductor"):
        _raise_recompile_limits()
        self.backend, self.options = backend, step_options(backend)
        self.compiled: dict = {}
        self.failures: dict = {}  # piece -> why it runs eagerly

    def model_call(self, fn, *args):
        """The glue compiles around it (CompiledStep with regions): a graph break, the models' pieces compiled on their
        own inside it."""
        return _model_call(fn, *args)

    def __call__(self, fn, *args):
        if fn in self.failures:
            return fn(*args)
        c = self.compiled.get(fn)
        if c is None:
            c = self.compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.backend,
                                                  options=self.options)
        try:
            return c(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            line = compile_failure(e)
            self.failures[fn] = line
            warnings.warn(f"compiled piece {fn.__name__} fell back to eager: {line}")
            return fn(*args)


@torch._dynamo.disable
def _model_call(fn, *args):
    return fn(*args)


def step_options(backend: str) -> dict | None:
    """Inductor's options for the steps (INDUCTOR_OPTIONS and the PDL switch); None for another backend."""
    return {**INDUCTOR_OPTIONS, "triton.enable_pdl": pdl_switch()} if backend == "inductor" else None


def compile_steps(steps, backend: str = "inductor", store: bool | None = None, regions: bool = False) -> None:
    """Replace steps.prefill / decode / spec by their compiled versions (in place). store: keep each compiled key
    on disk for later processes (step_store.py); None: with Inductor where step_store.default_on() and the steps
    run torch modules. regions: compile the models' pieces (CompiledRegions) and the step's glue between its model
    calls instead of each step whole: compile time independent of the layer count; no step is stored. The
    compiled pieces are these steps' graphs' own (steps.graphs.regions): another runtime over the same modules
    keeps its own."""
    from dflash_trt.runtime.backends import step_store

    if backend == "inductor":
        use_cache_dir()
    if regions:
        steps.graphs.regions = CompiledRegions(backend)
        for name in COMPILED:
            setattr(steps, name, CompiledStep(steps, name, backend, regions=True))
        return
    if store is None:
        store = backend == "inductor" and step_store.default_on()
    st = None
    if store and hasattr(steps.graphs, "target"):
        step_store.enable()
        st = step_store.StepStore(cache_root(), step_store.fingerprint(steps, backend, step_options(backend)))
    for name in COMPILED:
        setattr(steps, name, CompiledStep(steps, name, backend, st))


def prefer_cublaslt(dtype) -> bool:
    """Prefer cuBLASLt for fp32 GEMMs (see the module doc); True when the preference was set."""
    if dtype != torch.float32:
        return False
    torch.backends.cuda.preferred_blas_library("cublaslt")
    return True
