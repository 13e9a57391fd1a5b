"""What a traced decode run measured: mean GPU time per launch, the GPU's idle share, the joiners' prefill time
beside the steps (timing events the executor records around every launch), and the host's GC pauses."""
from __future__ import annotations

import gc
import time

import numpy as np

from dflash_trt.runtime.batching import PREFILL_STEP


def step_ms(dev, launches) -> float:
    """Mean GPU time of one launch (its input copy, graph and read-back), from its trace events."""
    dev.synchronize()
    return float(np.mean([dev.elapsed_ms(t0, t1) for t0, t1, _ in launches]))


def _spans(dev, trace) -> list:
    """(start, end, kind) of every traced launch, ms from the first one's start, by start."""
    dev.sync_all()
    return sorted((dev.elapsed_ms(trace[0][0], a), dev.elapsed_ms(trace[0][0], b), k) for a, b, k in trace)


def idle_pct(dev, trace) -> float:
    """GPU idle: the traced wall time on the GPU that no launch covers (steps, and the prefills of requests that
    join mid-run, which run on a second stream and may overlap the steps), as a share of that wall time."""
    if len(trace) < 2:
        return 0.0
    spans = _spans(dev, trace)
    idle, reach = 0.0, spans[0][1]
    for a, b, _ in spans[1:]:
        idle += max(0.0, a - reach)
        reach = max(reach, b)
    return 100.0 * idle / (reach - spans[0][0])


def prefill_beside_steps_ms(dev, trace) -> float:
    """GPU time of the joiners' prefills that ran while a step ran too (the steps share one stream: disjoint)."""
    if not trace:
        return 0.0
    spans = _spans(dev, trace)
    steps = [(a, b) for a, b, k in spans if k != PREFILL_STEP]
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b, k in spans if k == PREFILL_STEP for c, d in steps)


class GcPauses:
    """The host's garbage-collector pauses while entered: collections, full (generation 2) ones, total ms. A pause
    while steps are in flight idles the GPU once the step in flight has landed."""

    def __enter__(self):
        self.count, self.full, self.ms, self._t = 0, 0, 0.0, None
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.count += 1
            self.full += info["generation"] == 2
            self.ms += (time.perf_counter() - self._t) * 1e3
