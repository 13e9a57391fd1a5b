"""The bench tests' tiny runtime behind the fused step executor, and a CPU device whose timing events read the host
clock (decode_run's traces need timed events; the GPU's are CUDA events)."""
import time

from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice


class ClockedCpu(TorchCpuDevice):
    def new_event(self, timing=False):
        return [None]

    def record(self, event):
        if event is not None:
            event[0] = time.perf_counter()

    @staticmethod
    def elapsed_ms(a, b):
        return (b[0] - a[0]) * 1e3


def tiny_bench_runtime(tmp_path, device, max_seqs: int = 2):
    """A tiny random pair on `device` (a CPU device: steps run eagerly) behind the fused step executor."""
    from dflash_trt.abi import PoolSizes
    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.runtime import Runtime
    from dflash_trt.tools.tiny import make_tiny_pair

    tdir, ddir = make_tiny_pair(str(tmp_path), seed=5)
    t = load_target(tdir)
    d = load_drafter(ddir, t)
    sizes = PoolSizes(kv_blocks=48 * max_seqs, page_size=4, max_seq_len=96, max_seqs=max_seqs,
                      dkv_blocks=48 * max_seqs, prefill_chunk=16)
    return Runtime(TorchBackend(t, d), t.cfg, d.cfg, sizes, device=device,
                   executor=lambda rt: GraphStepExecutor(rt, inflight=1))
