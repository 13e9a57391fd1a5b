"""`dflash-trt build --backend torch`: the compiled steps of the torch backend on a GPU built offline, as `build`
builds TensorRT engines: every step a run of these checkpoints with these pool sizes launches is compiled into the
cache's step store (runtime/prebuild.py), so `generate`, `serve` and `LLM` processes with the same options load them
instead of compiling. The pool sizes must be the later runs' (a stored step is keyed by them): the same
--max-seq-len / --max-seqs; pools sized from free memory (--gpu-memory-utilization) match only when the free memory
does."""
from __future__ import annotations

import sys
import time

from dflash_trt.args import GAMMA_HELP, ArgumentParser, gamma_arg
from dflash_trt.log import progress


def main(argv=None) -> int:
    from dflash_trt.config import ConfigError, cache_root
    from dflash_trt.runtime.load import UsageError, check_checkpoint_dir, default_sizes, load_runtime
    from dflash_trt.runtime.prebuild import prebuild
    from dflash_trt.tools.generate import add_ctx_window_arg, add_drafter_fp8_arg, add_memory_arg, run_sizes

    p = ArgumentParser(prog="dflash-trt build --backend torch", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["torch"], required=True)
    p.add_argument("--model", required=True, help="target checkpoint dir (HF format)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir")
    p.add_argument("--device", default="cuda", help="cuda[:N]: the GPU the steps are compiled for")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="as for generate (default: the checkpoint's 16-bit dtype)")
    p.add_argument("--max-seq-len", type=int, default=None, help="as the later runs take it")
    p.add_argument("--max-seqs", type=int, default=None, help="as the later runs take it (serve: its --max-seqs)")
    p.add_argument("--gamma", type=gamma_arg, default="auto", help=GAMMA_HELP)
    add_memory_arg(p)
    add_ctx_window_arg(p)
    add_drafter_fp8_arg(p)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if a.device == "cpu":
            raise UsageError("the torch backend compiles its steps on a GPU: --device cuda[:N]")
        check_checkpoint_dir(a.model, "--model")
        sizes = run_sizes(a.max_seq_len, a.max_seqs, default_sizes(a.model).prefill_chunk, a.ctx_window)
        rt, _ = load_runtime(a.model, a.drafter, "torch", sizes=sizes, device=a.device, dtype=a.dtype,
                             compile_steps=True, gpu_memory_utilization=a.gpu_memory_utilization,
                             drafter_fp8=a.drafter_fp8)
        keys = prebuild(rt, None if a.gamma in (None, "auto") else a.gamma, progress)
    except (UsageError, ConfigError, OSError) as e:
        print(f"dflash-trt build: error: {e}", file=sys.stderr)
        return 2
    progress(f"{len(keys)} steps ready in {time.perf_counter() - t0:.0f} s (stored under {cache_root()})")
    return 0
