"""DFlash tok/s at a scripted acceptance, computed from step times: the fixed-K and cost-aware (auto) K lines of the
benches, and the chooser's checks on the CPU.

A script gives, per generated position of a row, how many of the drafts that follow it the drafter gets right (the
run m*); a step of width K at that position accepts min(m*, K - 1) and commits that + 1 tokens. Scripts are defined
over positions, not steps, so widths that commit at different speeds still see the same text:

  random      m* = 0 everywhere (a drafter that is never right: tau 1)
  stationary  m* drawn afresh at each step from ACCEPTED (tau 3.6 at K = 16)
  phased      PHASE positions where every draft of the block is right, then PHASE where none is, and again (code
              vs prose, think blocks)

`simulate` runs a `runtime.draft_length.DraftLength` over `batch` rows that all follow the script, with the step
times of a `StepCosts`, and returns tokens per second; `step_costs` makes that table from a bench's measured steps,
`scripted_lines` the benches' lines and checks.
"""
from __future__ import annotations

import random

from dflash_trt.runtime.draft_length import CostTable, DraftLength, StepCosts

ACCEPTED = (3, 1, 6, 0, 2, 4, 2, 5, 0, 3)  # scripted accepted drafts per spec step: tau 3.6 at K = 16
PHASE = 512  # positions per phase of the phased script
SCRIPTS = ("random", "stationary", "phased")


def script_run(name: str, pos: int, rng: random.Random) -> int:
    """m* at position pos of the named script: the drafts after it the drafter gets right (capped by the width)."""
    if name == "random":
        return 0
    if name == "stationary":
        return rng.choice(ACCEPTED)
    if name == "phased":
        return 1 << 30 if (pos // PHASE) % 2 == 0 else 0
    raise ValueError(f"unknown acceptance script {name!r} ({', '.join(SCRIPTS)})")


def simulate(policy: DraftLength, costs: StepCosts, script: str, tokens: int, batch: int = 1,
             seed: int = 0) -> float:
    """Tokens per second of `batch` rows generating `tokens` each at the script's acceptance, every step's width
    chosen by `policy` and timed by `costs` (each row at its own position: the rows' phases drift apart as their
    runs differ)."""
    rng = random.Random(seed)
    pos, seconds = [0] * batch, 0.0
    while min(pos) < tokens:
        K = policy.choose(batch)
        accepted = [min(script_run(script, p, rng), K - 1) for p in pos]
        seconds += costs.seconds(K, batch)
        policy.record(K, accepted)
        pos = [p + m + 1 for p, m in zip(pos, accepted)]
    return sum(pos) / seconds


def fixed_and_auto(widths, costs: StepCosts, script: str, tokens: int, batch: int = 1) -> dict:
    """tok/s of every fixed width and of auto at the script: {"K=k": tok/s, ..., "auto": tok/s}, plus the best
    fixed width's name under "best"."""
    out = {f"K={k}": simulate(DraftLength(widths, costs, fixed=k), costs, script, tokens, batch) for k in widths}
    best = max(out, key=out.get)
    out["auto"] = simulate(DraftLength(widths, costs), costs, script, tokens, batch)
    out["best"] = best
    return out


def step_costs(steps_ms: dict, plain_ms: float, spec_ms: float, gamma: int, bucket: int = 1) -> CostTable:
    """A cost table (seconds) from a bench's measurements in ms: width 1 the measured plain step; width K > 1 the
    verify step of K (steps_ms[K]) plus what the measured spec step of gamma + 1 took beyond its verify step
    (drafter block, accept: taken as the same at every width)."""
    extra = max(spec_ms - steps_ms[gamma + 1], 0.0)
    return CostTable({(1, bucket): plain_ms / 1e3, **{(k, bucket): (ms + extra) / 1e3 for k, ms in steps_ms.items()
                                                       if k > 1}})


def scripted_lines(costs: CostTable, bucket: int = 1, tokens: int = 4096) -> dict:
    """Per script, tok/s of every fixed width and of auto (the cost table's widths), and the checks: with a drafter
    that is never right auto >= 0.97x plain; stationary: within 3% of the best fixed width; phased: >= 10% above it."""
    widths = sorted({k for k, b in costs.table if b == bucket})
    rows = {s: fixed_and_auto(widths, costs, s, tokens, bucket) for s in SCRIPTS}
    rnd, st, ph = rows["random"], rows["stationary"], rows["phased"]
    checks = {f"batch {bucket} auto K, never-right drafter >= 0.97x plain": (rnd["auto"] / rnd["K=1"], 0.97),
              f"batch {bucket} auto K, stationary script >= 0.97x best fixed K": (st["auto"] / st[st["best"]], 0.97),
              f"batch {bucket} auto K, phased script >= 1.10x best fixed K": (ph["auto"] / ph[ph["best"]], 1.10)}
    return {"bucket": bucket, "tokens": tokens, "rows": rows,
            "targets": {name: (v, thr, v >= thr) for name, (v, thr) in checks.items()}}


def bench_scripted(res: dict) -> None:
    """A bench's scripted lines from its per-K steps and decode timings (res["steps"], res["decode"]), into
    res["scripted"] and its checks into res["targets"]; skipped (said in res) when gamma + 1 was not measured."""
    d, steps = res["decode"], {k: s["ms"] for k, s in res["steps"].items()}
    if d["gamma"] + 1 not in steps:
        res["scripted"] = {"skipped": f"--step-ks has no K = gamma + 1 = {d['gamma'] + 1}"}
        return
    res["scripted"] = scripted_lines(step_costs(steps, d["plain_step_ms"], d["spec_step_ms"], d["gamma"]))
    res.setdefault("targets", {}).update(res["scripted"]["targets"])


def print_scripted(res: dict) -> None:
    """One line per script: tok/s of each fixed width, auto, and the best fixed width."""
    if "skipped" in res:
        print(f"scripted fixed / auto K lines skipped: {res['skipped']}")
        return
    for script, row in res["rows"].items():
        fixed = " ".join(f"{k} {v:.0f}" for k, v in row.items() if k.startswith("K="))
        print(f"scripted {script} (batch {res['bucket']}): fixed {fixed} tok/s; auto {row['auto']:.0f} tok/s = "
              f"{row['auto'] / row[row['best']]:.2f}x best fixed ({row['best']})")
