"""Torch backend: runs the reference modules (modeling/target.py, modeling/drafter.py) for each graph.

On CPU, inputs/outputs are numpy (pairs with runtime.devices.host.HostDevice; pools are viewed with
torch.from_numpy, never copied or written). On CUDA, pools are torch tensors owned by
TorchDevice, graph outputs stay on the GPU, and only the token outputs the scheduler reads on the
host (argmax, drafts) come back as numpy. The custom ops inside the models run our CUDA kernels there.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from dflash_trt.abi import DRAFTER_BLOCK, DRAFTER_CTX
from dflash_trt.export.graphs import run_graph
from dflash_trt.modeling.regions import EAGER
from dflash_trt.plugins.opspec import dtype_name

HOST_OUTPUTS = ("argmax", "drafts")


class ModuleGraphs:
    """The StepGraphs of the fused step over the reference modules: run_graph, the module calls the exporter
    traces (device tensors in and out)."""
    commits_decode_gdn = True  # target_k1 with gdn_commit: GatedDeltaNet commits its row (ops.gdn_decode_commit)

    def __init__(self, target, drafter=None):
        self.target, self.drafter = target, drafter
        self.regions = EAGER  # how these graphs run the models' pieces (modeling/regions.py): this object's own

    def run(self, graph: str, inputs: dict, want_logits: bool) -> dict:
        """Graph `graph` on device tensors `inputs` (ABI names); its outputs as device tensors. The target's step runs
        its pieces through self.regions; a drafter graph is one piece."""
        return self.regions.model_call(self._run, graph, inputs, want_logits)

    def _run(self, graph: str, inputs: dict, want_logits: bool) -> dict:
        if graph == DRAFTER_CTX or graph.startswith(DRAFTER_BLOCK):
            return self.regions(run_graph, graph, None, self.drafter, inputs, want_logits)
        return run_graph(graph, self.target, self.drafter, inputs, want_logits=want_logits, regions=self.regions)


class TorchBackend:
    name = "torch"
    kv_dtype: str  # the target's parameter dtype
    want_logits = False  # run() adds the graphs' logits (the host executor sets it while a step samples)
    concurrent_prefill = True  # every kernel goes to torch's current stream: prefills may run on a second one
    any_prefill_width = True  # its prefill step takes ids of any width (engines are built for one: the chunk's)

    def __init__(self, target, drafter=None, want_logits: bool = False, device: str | None = None,
                 compile_steps: bool = False, checkpoint_hashes: dict | None = None):
        """compile_steps: on CUDA, the prefill/decode/spec steps through Inductor (runtime/backends/torch_compile.py):
        faster steps for a compile per step key on first use (figures: docs/PERF.md); "regions": the models' pieces
        compiled instead of each step whole (torch_compile.CompiledRegions). Ignored on CPU.
        checkpoint_hashes: 'target' / 'drafter' -> the hash of the checkpoint each module was loaded from."""
        self.target, self.drafter, self.want_logits = target, drafter, want_logits
        self.checkpoint_hashes = dict(checkpoint_hashes or {})
        p = next(target.parameters())
        self.device = torch.device(device) if device else p.device
        self.kv_dtype = dtype_name(p.dtype)
        if self.device.type == "cpu" and self.kv_dtype not in ("float32", "float64"):
            raise ValueError(f"on CPU the runtime keeps pools in numpy; target dtype {self.kv_dtype} is not "
                             "supported there (load the target in float32)")
        if isinstance(compile_steps, str) and compile_steps != "regions":
            raise ValueError(f"compile_steps: True, False or 'regions', got {compile_steps!r}")
        self.compile_steps = bool(compile_steps) and self.device.type == "cuda"
        self.compile_regions = compile_steps == "regions"
        if self.device.type == "cuda":  # the GPU step: fewer, better-chosen GEMMs (same math)
            from dflash_trt.runtime.backends.torch_compile import prefer_cublaslt

            prefer_cublaslt(p.dtype)
            target.fuse_projections()
            if drafter is not None:
                drafter.fuse_projections()

    def step_widths(self) -> None:
        """Any width: the modules take any number of rows (Backend.step_widths)."""
        return None

    def weights_id(self, which: str) -> str | None:
        """The checkpoint's hash where the module was loaded from one (what an export of it records), else a hash of
        its parameters, which no export can match."""
        if which in self.checkpoint_hashes:
            return f"checkpoint:{self.checkpoint_hashes[which]}"
        mod = {"target": self.target, "drafter": self.drafter}[which]
        return None if mod is None else "params:" + params_hash(mod)

    def _in(self, v):
        if isinstance(v, torch.Tensor):
            return v.to(self.device)
        return torch.from_numpy(np.ascontiguousarray(v)).to(self.device)

    def _out(self, k, v):
        if self.device.type == "cpu" or k in HOST_OUTPUTS:
            return v.detach().cpu().numpy()
        return v

    def fused_steps(self, rt):
        """The device-side steps over this backend's modules (runtime/backends/graph_executor.py runs them)."""
        from dflash_trt.runtime.backends.torch_fused_step import FusedSteps

        steps = FusedSteps(ModuleGraphs(self.target, self.drafter), rt)
        if self.compile_steps:
            from dflash_trt.runtime.backends.torch_compile import compile_steps

            compile_steps(steps, regions=self.compile_regions)
        return steps

    @torch.no_grad()
    def run(self, graph: str, inputs: dict) -> dict:
        out = run_graph(graph, self.target, self.drafter, {k: self._in(v) for k, v in inputs.items()},
                        self.want_logits)
        return {k: self._out(k, v) for k, v in out.items() if v is not None}


def params_hash(mod) -> str:
    """sha256 over every parameter's name, shape, dtype and bytes (any device)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in mod.named_parameters():
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
