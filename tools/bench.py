"""`dflash-trt bench {kernels,generate,e2e,host,serve,startup}`: benchmarks print absolute numbers with the
hardware named and a ratio against a baseline measured in the same run; each can write JSON."""
from __future__ import annotations

import os
import platform
import statistics
import sys

from dflash_trt.args import GAMMA_HELP, ArgumentParser, gamma_arg
from dflash_trt.files import write_json


def hardware(device: str = "cpu") -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name} ({os.cpu_count()} cores)"


def graph_replay_ms(calls, replays: int, warm: int = 2):
    """(outputs of `calls`, ms per replay) for a list of thunks captured in ONE torch CUDA graph: the first `warm`
    run eagerly on a side stream (module loads, allocator), then the graph is replayed `warm` times before
    `replays` timed replays between CUDA events. The kernel and e2e benches time every graph through this."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls[:warm]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [f() for f in calls]
    for _ in range(warm):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return outs, a.elapsed_time(b) / replays


def bench_generate(argv) -> int:
    """Plain greedy vs DFlash on a prompt file: tokens/s, target launches, τ, speedup; checks identity."""
    from dflash_trt import load_runtime
    from dflash_trt.runtime.load import UsageError
    from dflash_trt.runtime.runtime import check_gamma
    from dflash_trt.tools.demo import default_pair

    p = ArgumentParser(prog="dflash-trt bench generate")
    p.add_argument("--model"), p.add_argument("--drafter")
    p.add_argument("--prompts", help="file: prompts separated by lines with only '---' (default: the demo prompt)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=gamma_arg, default="auto", help=GAMMA_HELP)
    p.add_argument("--backend", default="torch", choices=["torch", "ort"])
    p.add_argument("--json", help="write results here")
    a = p.parse_args(argv)
    # bad values fail in one line (the CLI maps UsageError / GammaError / OSError) before any model loads
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.drafter and not a.model:
        raise UsageError("--drafter needs --model (without both, the demo pair runs)")
    prompts = ["def fibonacci(n):\n    "]
    if a.prompts:
        with open(a.prompts) as f:
            prompts = [s.strip("\n") for s in f.read().split("\n---\n") if s.strip()]
        if not prompts:
            raise UsageError(f"--prompts {a.prompts}: no prompts in the file")
    tdir, ddir = (a.model, a.drafter) if a.model else default_pair()[:2]
    if a.gamma is not None and ddir:
        from dflash_trt.config import DrafterConfig, read_json

        cfg = os.path.join(ddir, "config.json")
        check_gamma(a.gamma, DrafterConfig.from_dict(read_json(cfg), cfg).block_size)
    rt, codec = load_runtime(tdir, ddir, a.backend)
    rt.generate(codec.encode(prompts[0]), 8)  # warm-up
    rows = []
    for i, text in enumerate(prompts):
        ids = codec.encode(text)
        plain, sp = rt.generate(ids, a.max_new_tokens, spec=False)
        spec, ss = rt.generate(ids, a.max_new_tokens, gamma=a.gamma)
        rows.append(dict(prompt=i, tokens=ss.new_tokens, identical=plain == spec, tau=ss.tau,
                         plain_tok_s=sp.tokens_per_s, dflash_tok_s=ss.tokens_per_s,
                         plain_launches=sp.target_steps + 1, dflash_launches=ss.target_steps + 1))
    hw = hardware("cpu")
    print(f"bench generate: backend={a.backend} on {hw}; {len(prompts)} prompts x {a.max_new_tokens} new tokens")
    print(f"{'#':>3} {'tau':>6} {'plain tok/s':>12} {'dflash tok/s':>13} {'speedup':>8} {'launches':>10} identical")
    for r in rows:
        print(f"{r['prompt']:>3} {r['tau']:>6.2f} {r['plain_tok_s']:>12.1f} {r['dflash_tok_s']:>13.1f} "
              f"{r['dflash_tok_s'] / r['plain_tok_s']:>7.2f}x {r['plain_launches']:>4}->{r['dflash_launches']:<4} "
              f"{r['identical']}")
    med = lambda k: statistics.median(r[k] for r in rows)
    summary = dict(hardware=hw, backend=a.backend, median_tau=med("tau"), mean_tau=statistics.mean(r["tau"] for r in rows),
                   median_plain_tok_s=med("plain_tok_s"), median_dflash_tok_s=med("dflash_tok_s"),
                   speedup=med("dflash_tok_s") / med("plain_tok_s"), all_identical=all(r["identical"] for r in rows))
    print(f"median: tau={summary['median_tau']:.2f} (mean {summary['mean_tau']:.2f}), plain "
          f"{summary['median_plain_tok_s']:.1f} tok/s, dflash {summary['median_dflash_tok_s']:.1f} tok/s, "
          f"speedup {summary['speedup']:.2f}x, identical={summary['all_identical']}")
    if a.json:
        write_json(a.json, dict(summary=summary, rows=rows))
    return 0 if summary["all_identical"] else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("kernels", "generate", "e2e", "host", "serve", "startup"):
        print("usage: dflash-trt bench {kernels,generate,e2e,host,serve,startup} [options]  (see --help of each)",
              file=sys.stderr)
        return 2
    if argv[0] == "startup":
        from dflash_trt.tools import bench_startup

        return int(bench_startup.main(argv[1:]) or 0)
    if argv[0] == "serve":
        from dflash_trt.tools import bench_serve

        return int(bench_serve.main(argv[1:]) or 0)
    if argv[0] == "host":
        from dflash_trt.tools import bench_host

        return int(bench_host.main(argv[1:]) or 0)
    if argv[0] == "kernels":
        from dflash_trt.tools import bench_kernels

        return int(bench_kernels.main(argv[1:]) or 0)
    if argv[0] == "e2e":
        from dflash_trt.tools import bench_e2e

        return int(bench_e2e.main(argv[1:]) or 0)
    return bench_generate(argv[1:])
