"""`dflash-trt bench startup`: how long a new process takes from its start to its first decoded token, once with
an empty cache and again as a later process that finds what the first one stored (compiled steps, Inductor's code,
NVRTC kernels).

Each start is a child process (`python -m dflash_trt.tools.bench_startup --child ...`) that does what a user's
process does: import, build or load the pair, make the runtime, then decode one request of --prompt-tokens random
token ids for --new-tokens tokens; the first use of each step compiles it or loads it. The child prints the moment
each phase ends; the parent counts from just before it spawned the child, so the interpreter's start and the imports
are in the figures. Phases: imported, runtime (weights + pools + backend), first token (the prefill's), first
decoded token (the first decode or spec step's), all tokens.

The cache: by default a fresh directory this command creates and removes afterwards (the first start is cold);
--cache DIR runs both starts on that cache as found (after `dflash-trt build --backend torch`: the warm start a
server gets) and leaves it in place. A random preset is built in memory: the weights' load time from disk is not in
its figures (a checkpoint directory's is).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from dflash_trt.args import GAMMA_HELP, ArgumentParser, gamma_arg

TAG = "@startup"  # the child's phase lines on stdout: "@startup <phase> <unix time>"
PHASES = ("imported", "runtime", "first_token", "first_decoded", "done")
PHASE_WORDS = {"imported": "imports", "runtime": "runtime", "first_token": "first token",
               "first_decoded": "first decoded", "done": "all tokens"}
PRESETS = ("random-27b", "random-moe-35b-a3b")
# the start-up targets on the 64-layer random-27b shape on a GPU (seconds to the first decoded token)
TARGET_SHAPE = "random-27b with all 64 layers"
TARGETS = {"first_start": 180.0, "later_start": 30.0}


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="dflash-trt bench startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=f"target checkpoint dir, or one of {', '.join(PRESETS)}")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir (a preset builds its own)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: the checkpoint's 16-bit dtype on a GPU (bfloat16 for a preset)")
    p.add_argument("--layers", type=int, default=None, help="a preset: target layers built (default: all)")
    p.add_argument("--fp8", action="store_true", help="a preset: FP8 block-wise projections (and experts)")
    p.add_argument("--compile-regions", action="store_true", help="compile the models' pieces instead of each step")
    p.add_argument("--no-compile", action="store_true", help="eager steps")
    p.add_argument("--gamma", type=gamma_arg, default="auto", help=GAMMA_HELP)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--starts", type=int, default=2, help="processes started one after another on the same cache")
    p.add_argument("--cache", help="run on this dflash-trt cache as found (default: a fresh one, removed after)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def check_args(a) -> None:
    """Bad values refused in one line (UsageError) before any process starts."""
    from dflash_trt.runtime.load import UsageError, check_checkpoint_dir

    for flag, v, lo in (("--prompt-tokens", a.prompt_tokens, 1), ("--new-tokens", a.new_tokens, 2),
                        ("--starts", a.starts, 1), ("--layers", a.layers, 1)):
        if v is not None and v < lo:
            raise UsageError(f"{flag} must be >= {lo}, got {v}")
    if a.compile_regions and a.no_compile:
        raise UsageError("--compile-regions and --no-compile exclude each other")
    if a.model in PRESETS:
        if a.device == "cpu":
            raise UsageError(f"--model {a.model} is built on a GPU: --device cuda[:N]")
        if a.drafter:
            raise UsageError(f"--model {a.model} builds its own drafter: no --drafter")
    else:
        check_checkpoint_dir(a.model, "--model")
        if a.drafter:
            check_checkpoint_dir(a.drafter, "--drafter")
        if a.layers is not None:
            raise UsageError(f"--layers builds a preset ({', '.join(PRESETS)}) only, not --model {a.model!r}")
    if a.fp8 and a.model not in PRESETS:
        raise UsageError(f"--fp8 builds a preset ({', '.join(PRESETS)}) only, not --model {a.model!r}")
    if a.cache and not os.path.isdir(a.cache):
        raise UsageError(f"--cache {a.cache}: not a directory")


def compile_mode(a):
    from dflash_trt.tools.bench_moe import compile_choice

    return compile_choice(a)


def compile_words(a) -> str:
    if a.device == "cpu":
        return "eager steps (the CPU path)"
    return {False: "eager steps (--no-compile)", "regions": "compiled by regions (--compile-regions, not the default)",
            True: "compiled steps (the default)"}[compile_mode(a)]


# ---- the child: one process start ------------------------------------------------------------------------------
def mark(phase: str) -> None:
    print(f"{TAG} {phase} {time.time():.6f}", flush=True)


def build_runtime(a):
    """The runtime a user's process would make: load_runtime for a checkpoint directory, the preset built in memory
    on the GPU over pools for this one request otherwise."""
    if a.model not in PRESETS:
        from dflash_trt.runtime.load import load_runtime

        return load_runtime(a.model, a.drafter, "torch", device=a.device, dtype=a.dtype,
                            compile_steps=compile_mode(a))[0]
    import torch

    from dflash_trt.abi import default_prefill_chunk
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.devices.cuda import CudaDevice
    from dflash_trt.runtime.runtime import Runtime
    from dflash_trt.tools.bench_dense import bench_sizes, build_random_dense
    from dflash_trt.tools.bench_moe import build_random_moe

    dev = CudaDevice(torch.device(a.device).index or 0)
    dtype = getattr(torch, a.dtype or "bfloat16")
    if a.model == "random-27b":
        target, drafter = build_random_dense(dtype, dev.device, a.layers or 64, a.fp8)
    else:
        target, drafter = build_random_moe(dtype, dev.device, a.layers or 40, a.fp8)
    sizes = bench_sizes(1, a.prompt_tokens, a.new_tokens, default_prefill_chunk(target.cfg))
    return Runtime(TorchBackend(target, drafter, compile_steps=compile_mode(a)), target.cfg, drafter.cfg, sizes,
                   device=dev)


def child(a) -> int:
    import numpy as np
    import torch  # noqa: F401  (the imports every user's process pays: torch and the runtime)

    import dflash_trt.runtime.runtime  # noqa: F401

    mark("imported")
    rt = build_runtime(a)
    mark("runtime")
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, rt.tcfg.vocab_size - 1, a.prompt_tokens)]
    req = rt.add_request(prompt, a.new_tokens, gamma=a.gamma, ignore_eos=True)
    seen = set()
    while rt.has_work:
        rt.step()
        reached = {"first_token": len(req.tokens) >= 1, "first_decoded": req.steps >= 1 and len(req.tokens) >= 2}
        for phase in [p for p, now in reached.items() if now and p not in seen]:
            seen.add(phase)
            mark(phase)
    if req.error is not None:
        raise req.error
    mark("done")
    return 0


# ---- the parent -------------------------------------------------------------------------------------------------
def one_start(argv: list[str], env: dict) -> dict:
    """Run one child; {phase: seconds since its spawn}. Its other output passes through to stderr."""
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt.tools.bench_startup", *argv, "--child"], env=env,
                            stdout=subprocess.PIPE, text=True)
    times = {}
    for line in proc.stdout:
        parts = line.split()
        if len(parts) == 3 and parts[0] == TAG and parts[1] in PHASES:
            times[parts[1]] = float(parts[2]) - t0
        else:
            print(line, end="", file=sys.stderr)
    rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"the started process exited with {rc} after {time.time() - t0:.1f} s")
    return times


def child_env(cache: str) -> dict:
    """The children's environment: the dflash-trt cache at `cache`, and Inductor's and Triton's caches under it
    (a TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR of the caller would make the first start warm)."""
    env = dict(os.environ, DFLASH_TRT_CACHE=cache)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    return env


def print_report(res: dict) -> None:
    print(f"dflash-trt bench startup: {res['model']} ({res['what']}) on {res['hardware']}; {res['cache_words']}")
    print(f"  {res['prompt_tokens']}-token prompt, {res['new_tokens']} new tokens; seconds from the process's spawn")
    print("  start  " + "  ".join(f"{PHASE_WORDS[p]:>13}" for p in PHASES))
    for i, t in enumerate(res["starts"]):
        print(f"  {i + 1:>5}  " + "  ".join(f"{t[p]:>11.1f} s" if p in t else f"{'-':>13}" for p in PHASES))
    if not res["targets"]:
        print(f"  targets: set for {TARGET_SHAPE} on a GPU with compiled steps; not judged on this run")
    for name, ok, line in res["targets"]:
        print(f"  target {name}: {line}: {'HIT' if ok else 'MISS'}")


def targets(res: dict) -> list:
    """(name, hit, line) of the start-up targets, against the first decoded token of the first and a later start;
    none where the run is not the targets' configuration (TARGET_SHAPE on a GPU, steps compiled)."""
    if (res["model"], res["layers"] or 64) != ("random-27b", 64) or res["device"] == "cpu" or not res["compiled"]:
        return []
    firsts = [t["first_decoded"] for t in res["starts"]]
    out = [("first start", firsts[0] <= TARGETS["first_start"],
            f"{firsts[0]:.1f} s to the first decoded token (<= {TARGETS['first_start']:.0f} s)")]
    if len(firsts) > 1:
        later = max(firsts[1:])
        out.append(("later start", later <= TARGETS["later_start"],
                    f"{later:.1f} s to the first decoded token (<= {TARGETS['later_start']:.0f} s)"))
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    if a.child:
        return child(a)
    from dflash_trt.files import write_json
    from dflash_trt.runtime.load import UsageError
    from dflash_trt.tools.bench import hardware

    try:
        check_args(a)
    except UsageError as e:
        print(f"dflash-trt bench startup: error: {e}", file=sys.stderr)
        return 2
    cache = a.cache or tempfile.mkdtemp(prefix="dflash-trt-startup-")
    words = f"cache {cache} as found" if a.cache else "a fresh cache (created by this run, removed after)"
    res = {"model": a.model, "layers": a.layers, "device": a.device, "compiled": compile_mode(a),
           "what": (f"{a.layers or 'all'} layers, " if a.model in PRESETS else "") + compile_words(a),
           "cache": cache, "cache_words": words, "prompt_tokens": a.prompt_tokens,
           "new_tokens": a.new_tokens, "starts": []}
    try:
        for i in range(a.starts):
            print(f"start {i + 1} of {a.starts} ...", file=sys.stderr, flush=True)
            res["starts"].append(one_start(child_argv(argv), child_env(cache)))
    except RuntimeError as e:
        print(f"dflash-trt bench startup: error: {e}", file=sys.stderr)
        return 1
    finally:
        if not a.cache:
            shutil.rmtree(cache, ignore_errors=True)
    res["hardware"] = hardware(a.device)  # after the starts: the parent holds no GPU context while they run
    res["targets"] = targets(res)
    print_report(res)
    if a.json:
        write_json(a.json, res)
    return 0


def child_argv(argv: list[str]) -> list[str]:
    """The parent's arguments a child needs (all but --json, --starts and --cache)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--json", "--starts", "--cache"):
            skip = True
        elif not x.startswith(("--json=", "--starts=", "--cache=")):
            out.append(x)
    return out


if __name__ == "__main__":
    sys.exit(main())
