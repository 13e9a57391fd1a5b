"""TensorRT backend: the manifest's engines (TensorRT or TensorRT-RTX + our plugins) on the runtime's pools.

Only what a TensorRT-capable GPU executes lives here — contexts, set_input_shape / set_tensor_address from
the binding plan (runtime/backends/trt_plan.py, computed and tested on CPU), execute_async_v3 on the runtime's
stream. Engines load through engines/load.py (all its refusals), and the whole plan is checked against the
engines and the runtime's pools before anything launches.

The step itself is the torch backend's FusedSteps, unchanged: it runs the graphs through a StepGraphs
(runtime/interfaces.py), which `EngineGraphs` below implements with one enqueue per graph. So the graph executor
captures drafter_block -> target verify -> accept -> commit kernels -> drafter ctx rows in the same per-step CUDA
graph, and the runtime loop and commit path are the ones every backend uses. `run(graph, numpy inputs)` is the
same interface for the host executor and `dflash-trt compare`.

The drafter block table of the engines is the ABI's static width (abi.PoolSizes.max_ctx_blocks), which keeps
room for the look-ahead rows of one step left in flight: runtime/executors.choose_executor gives a Runtime over
this backend the graph executor with one step in flight (the host plans step t+1 while the engines run step t).
"""
from __future__ import annotations

import numpy as np
import torch

from dflash_trt.engines.load import EngineError, load_engine
from dflash_trt.manifest import Manifest, ManifestBacked
from dflash_trt.plugins.opspec import dtype_name
from dflash_trt.runtime.backends.trt_plan import PlanError, check_bound, runtime_plan


class _Context:
    """One execution context of one engine at one batch bucket; its outputs (and padded inputs) preallocated
    and bound once."""

    def __init__(self, engine, plan, dev):
        self.plan, self.ctx = plan, engine.create_context()
        for name, shape in plan.input_shapes.items():
            if not self.ctx.set_input_shape(name, shape):
                raise PlanError(f"engine {plan.graph}: TensorRT refused input {name} shape {list(shape)}")
        zeros = lambda b: torch.zeros(b.shape, dtype=getattr(torch, b.dtype), device=dev.device)
        self.outputs = {b.name: zeros(b) for b in plan.outputs}
        self.padded = {b.name: zeros(b) for b in plan.inputs if b.pad_rows}
        dev.sync_all()  # the zeros landed before the runtime stream uses them
        for name, t in self.outputs.items():
            self.bind(name, t)

    def bind(self, name, t) -> None:
        if not self.ctx.set_tensor_address(name, int(t.data_ptr())):
            raise PlanError(f"engine {self.plan.graph}: TensorRT refused the address of {name}")


class TrtBackend(ManifestBacked):
    name = "trt"
    kv_dtype: str  # the manifest's
    want_logits = False  # the manifest's: whether the engines emit logits
    concurrent_prefill = False  # enqueue is bound to the runtime's stream: prefills run on it
    any_prefill_width = False  # the prefill engine is built for the chunk's width

    def __init__(self, manifest, device=None, engines: dict | None = None):
        """manifest: Manifest or its directory; device: the CudaDevice whose stream runs the engines (the
        runtime's, set by fused_steps; one is made for `run` otherwise); engines: graph -> loaded engine
        (default engines/load.load_engine for every graph; tests pass stand-ins)."""
        self.manifest = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest)
        self.kv_dtype, self.want_logits = self.manifest.kv_dtype, self.manifest.want_logits
        self.engines = engines if engines is not None else {g: load_engine(self.manifest, g)
                                                             for g in self.manifest.graphs}
        self.plans = runtime_plan(self.manifest, self._ios())  # every mismatch refused before any context
        self.device = device
        self._contexts: dict = {}
        self.launches = None  # a list -> the graph of every enqueue is appended (tests: launch order)

    def _ios(self) -> dict:
        return {g: e.io for g, e in self.engines.items()}

    # ---- the GPU step (graph executor) ----------------------------------------------------------
    def fused_steps(self, rt):
        """The device-side steps over the engines, bound to this runtime's pools and stream."""
        from dflash_trt.runtime.backends.torch_fused_step import FusedSteps

        pools = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in rt.pools.items()}
        self.plans = runtime_plan(self.manifest, self._ios(), pools)  # the runtime's pools, not the manifest's
        self.device = rt.device
        return FusedSteps(EngineGraphs(self), rt, graph_int32=False)  # engines bind the ABI's int64 index inputs

    def _context(self, graph: str, B: int) -> _Context:
        c = self._contexts.get((graph, B))
        if c is None:
            plan = self.plans.get((graph, B))
            if plan is None:
                raise PlanError(f"engine {graph}: no binding plan for batch {B} (planned: "
                                f"{sorted(b for g, b in self.plans if g == graph)})")
            c = self._contexts[(graph, B)] = _Context(self.engines[graph], plan, self.device)
        return c

    def execute(self, graph: str, x: dict) -> dict:
        """Bind the step's tensors `x` (ABI name -> device tensor) and enqueue `graph` on the runtime's stream;
        returns its preallocated outputs (valid once the stream reaches them). Capturable."""
        first = next(iter(self.manifest.io(graph)[0]))["name"]
        c = self._context(graph, int(x[first].shape[0]))
        names = [b.name for b in c.plan.inputs]
        if sorted(x) != sorted(names):
            raise PlanError(f"engine {graph}: the step hands inputs {sorted(x)}, the engine takes {names}")
        for b in c.plan.inputs:
            t = x[b.name]
            check_bound(c.plan, b.name, t.shape, t.dtype)
            if b.pad_rows:
                c.padded[b.name][:, : t.shape[1]].copy_(t)
                t = c.padded[b.name]
            c.bind(b.name, t.contiguous())
        if self.launches is not None:
            self.launches.append(graph)
        if not c.ctx.execute_async_v3(self.device.stream_handle):
            raise EngineError(f"engine {graph}: execute_async_v3 failed (see TensorRT's errors above)")
        return dict(c.outputs)

    # ---- numpy in/out (host executor, compare) -----------------------------------------------------
    def run(self, graph: str, inputs: dict) -> dict:
        if self.device is None:
            from dflash_trt.runtime.devices.cuda import CudaDevice

            self.device = CudaDevice()
        dev = self.device
        with dev.on_stream():
            x = {k: torch.as_tensor(np.ascontiguousarray(v)).to(dev.device) for k, v in inputs.items()}
            out = self.execute(graph, x)
            return {k: v.detach().cpu().numpy().copy() for k, v in out.items()}


class EngineGraphs:
    """The StepGraphs of the fused step over the engines: each graph one enqueue on the runtime's stream, its
    preallocated outputs returned (device tensors in and out, capturable)."""
    commits_decode_gdn = False  # engines read pools only (the graph ABI)

    def __init__(self, be: TrtBackend):
        self.be = be

    def run(self, graph: str, inputs: dict, want_logits: bool) -> dict:
        """Enqueue `graph` on the step's tensors `inputs` (ABI names); its output tensors."""
        if want_logits and not self.be.want_logits:
            raise PlanError(f"engine {graph}: logits requested, but the export has none (export with logits)")
        return self.be.execute(graph, inputs)
