"""The one choice of step executor for a Runtime (runtime/interfaces.Executor is the contract).

  HostStepExecutor  (runtime/host_step.py) graphs through backend.run, accept on the host: every backend, any
                    device without step graphs (the CPU path)
  GraphStepExecutor (runtime/backends/graph_executor.py) the backend's fused device steps, one CUDA graph per step
                    key, one step kept in flight: a device that captures graphs and a backend with fused steps

Runtime(executor=None) and load_runtime take `choose_executor`; tests and tools pass a factory of their own
(rt -> executor) to force one. numpy-free; the graph executor (torch) is imported only when chosen.
"""
from __future__ import annotations


def choose_executor(rt):
    """The executor for rt's backend on rt's device: the graph executor where the device captures step graphs and
    the backend has fused steps (at most one step in flight: the exported ctx table width has room for one), else
    the host executor."""
    if rt.device.graph_steps and rt.backend.fused_steps is not None:
        from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor

        return GraphStepExecutor(rt, inflight=1)
    from dflash_trt.runtime.host_step import HostStepExecutor

    return HostStepExecutor(rt)
