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
times of a `StepCosts`, and returns tokens per second.
"""
from __future__ import annotations

import random

from dflash_trt.runtime.draft_length import DraftLength, StepCosts

ACCEPTED = (3, 1, 6, 0, 2, 4, 2, 5, 0, 3)  # scripted accepted drafts per spec step: tau = 1 + mean = 3.6 at K = 16
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
    chosen by `policy` and timed by `costs` (each row at its own position: the phases of the rows drift apart as their runs differ)."""
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
