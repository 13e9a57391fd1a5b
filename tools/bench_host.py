"""`dflash-trt bench host`: the runtime's host side alone, on the CPU. One scheduler step in Python (plan, page
reservation, step tables, staging fill, collect, commit bookkeeping, emit) at batches of 1-64, plain and DFlash,
with the device's step replaced by a stand-in that writes plausible results (n = accepted + 1) and does nothing
else. On a GPU this host time overlaps the step in flight; once it exceeds the device's step time it sets the
pace (bench e2e's idle% then rises). The ratio printed is host(batch B) / host(batch 1) of the same run.
Then a serving run at the widest batch: B x 4 requests (prompts of 100-500 tokens, 64-192 new), B at a time, one
joining as another leaves, and the window the device must cover: from a step's collect returning (the device goes on
with the step queued behind it) to the next launch. A window longer than the device's step (bench e2e's step_ms)
idles the device; Scheduler.step launches before admitting, so a joiner's admission is not inside it."""
from __future__ import annotations

import time

import numpy as np

from dflash_trt.args import ArgumentParser
from dflash_trt.files import write_json


class StandInSteps:
    """The fused steps' interface (runtime/backends/torch_fused_step.py) writing results only: tokens 7, n = 1 for
    a plain step and min(accepted + 1, K) for a spec step; prefill's first token 7."""

    def __init__(self, state, accepted: int):
        self.state, self.accepted = state, accepted

    def prefill(self, b) -> None:
        b["result"][:, 0] = 7
        b["result"][:, 1] = b["valid"]

    def _result(self, b, K: int, n_live: int) -> None:
        r = b["result"]
        r[:, :K] = 7
        r[:, K] = b["live"] * n_live
        r[:, K + 1:] = 0

    def decode(self, b) -> None:
        self._result(b, 1, 1)

    def spec(self, b, gamma: int) -> None:
        self._result(b, gamma + 1, min(self.accepted + 1, gamma + 1))


def drive(sch) -> tuple:
    """(scheduler steps, seconds) until `sch` has no work left."""
    steps, t0 = 0, time.perf_counter()
    while sch.has_work:
        sch.step()
        steps += 1
    return steps, time.perf_counter() - t0


def host_us_per_step(rt, batch: int, spec: bool, gamma: int, new_tokens: int, prompt_len: int = 40) -> tuple:
    """(us per scheduler step, steps) decoding `batch` requests of `new_tokens` after their admission."""
    rng = np.random.default_rng(batch)
    for _ in range(batch):
        rt.add_request([int(t) for t in rng.integers(0, rt.tcfg.vocab_size - 1, prompt_len)], new_tokens,
                       gamma=gamma if spec else None, spec=spec)
    rt.scheduler.admit()
    steps, secs = drive(rt.scheduler)
    return secs / steps * 1e6, steps


def serve_window(rt, batch: int, spec: bool, gamma: int, per_slot: int = 4) -> dict:
    """A serving run (module doc): host us a scheduler step and the collect -> next launch windows, in us."""
    from dflash_trt.runtime.backends.graph_executor import PrefillRow
    rng = np.random.default_rng(batch)
    for _ in range(batch * per_slot):
        rt.add_request([int(t) for t in rng.integers(0, rt.tcfg.vocab_size - 1, int(rng.integers(100, 500)))],
                       int(rng.integers(64, 192)), gamma=gamma if spec else None, spec=spec)
    sch, ex, marks = rt.scheduler, rt.executor, []
    sch.max_batch = batch
    launch, collect = ex.launch, ex.collect

    def timed_launch(plan):
        marks.append(("launch", time.perf_counter()))
        return launch(plan)

    def timed_collect(pending):
        r = collect(pending)
        if not isinstance(pending, PrefillRow):
            marks.append(("collect", time.perf_counter()))
        return r

    ex.launch, ex.collect = timed_launch, timed_collect
    try:
        steps, secs = drive(sch)
    finally:
        del ex.launch, ex.collect  # the instance attributes: the class's methods again
    win = np.array([b[1] - a[1] for a, b in zip(marks, marks[1:]) if a[0] == "collect" and b[0] == "launch"]) * 1e6
    return {"requests": batch * per_slot, "steps": steps, "host_us_per_step": secs / steps * 1e6,
            "window_us_median": float(np.median(win)), "window_us_p90": float(np.percentile(win, 90)),
            "window_us_max": float(win.max())}


def main(argv=None) -> int:
    from dflash_trt.abi import PoolSizes
    from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
    from dflash_trt.runtime.load import UsageError
    from dflash_trt.runtime.runtime import Runtime
    from dflash_trt.runtime.batching import BUCKETS
    from dflash_trt.runtime.scheduler import PREFETCH
    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.tools.bench import hardware
    from dflash_trt.tools.demo import default_pair

    p = ArgumentParser(prog="dflash-trt bench host", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target checkpoint dir (default: the demo pair)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir")
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--gamma", type=int, default=15)
    p.add_argument("--accepted", type=int, default=3, help="drafts the stand-in accepts per spec step")
    p.add_argument("--max-new-tokens", type=int, default=129)
    p.add_argument("--json")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batch.split(",")]
    top = BUCKETS[-1]
    if not all(1 <= b <= top for b in batches) or a.max_new_tokens < 2 or not 0 <= a.accepted <= a.gamma:
        raise UsageError(f"--batch values must be in 1..{top}, --max-new-tokens >= 2, 0 <= --accepted <= --gamma")
    tdir, ddir = (a.model, a.drafter) if a.model else default_pair()[:2]
    target = load_target(tdir)
    drafter = load_drafter(ddir, target) if ddir else None
    widest = max(batches)  # pages for that many sequences of up to 1024 rows, and the serving run's prefetched ones
    sizes = PoolSizes(max_seq_len=1024, kv_blocks=(widest + PREFETCH) * 64, page_size=16, max_seqs=widest + PREFETCH,
                      dkv_blocks=(widest + PREFETCH) * 64, ctx_window=1024, prefill_chunk=64)
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg if drafter else None, sizes,
                 device=TorchCpuDevice(), executor=GraphStepExecutor)
    rt.executor.steps = StandInSteps(rt.executor.steps.state, a.accepted)
    hw = hardware("cpu")
    print(f"bench host: scheduler step, device work stood in (spec accepts {a.accepted} of {a.gamma}); {hw}")
    rows = []
    for spec in ([False, True] if drafter is not None else [False]):
        host_us_per_step(rt, 1, spec, a.gamma, 16)  # warm-up (buffers of the bucket)
        base = None
        for b in batches:
            host_us_per_step(rt, b, spec, a.gamma, 16)
            us, steps = host_us_per_step(rt, b, spec, a.gamma, a.max_new_tokens)
            base = us if base is None else base
            rows.append({"kind": "dflash" if spec else "plain", "batch": b, "host_us_per_step": us, "steps": steps,
                         "over_first_batch": us / base})
            print(f"  {rows[-1]['kind']:<6} batch {b:2d}: {us:8.1f} us a step ({us / b:6.1f} per sequence; "
                  f"{us / base:.2f}x batch {batches[0]}), {steps} steps")
    serve = []
    for spec in ([False, True] if drafter is not None else [False]):
        w = dict(serve_window(rt, batches[-1], spec, a.gamma), kind="dflash" if spec else "plain", batch=batches[-1])
        serve.append(w)
        print(f"  serve {w['kind']:<6} batch {w['batch']:2d}, {w['requests']} requests: {w['host_us_per_step']:.1f} us"
              f" a step; collect -> next launch {w['window_us_median']:.0f} us median, {w['window_us_p90']:.0f} p90,"
              f" {w['window_us_max']:.0f} max ({w['steps']} steps)")
    if a.json:
        write_json(a.json, {"hardware": hw, "rows": rows, "serve": serve, "gamma": a.gamma, "accepted": a.accepted})
    return 0
