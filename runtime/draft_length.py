"""How many tokens a step verifies: the width K of each launch (K - 1 drafts; K = 1 is a plain decode step, its ctx
row still appended by the same commit path), chosen per step for the whole batch. Policy only: numbers in, a K out.

  fixed   a given gamma: every step runs K = gamma + 1.
  auto    the K among the widths the backend runs that maximises expected committed tokens per second:
              rate(K) = rows * E[n | K] / seconds(K, bucket),  E[n | K] = 1 + sum_{j<K} prod_{i<=j} a_i
          a_i: the acceptance of draft i given drafts < i were accepted (the chain rule makes E[n] exact for any
          acceptance distribution, no independence assumed). Every spec step observes positions 1..m+1 of each row
          (m accepted: m successes, then a rejection when m < K - 1); per position the successes and trials are
          discounted sums over the steps that observed it (DISCOUNT per step: a memory of ~14 steps, long enough that
          a noisy stationary acceptance picks a steady K, short enough to follow a phase change), and a position
          keeps its value while no step reaches it.
          One estimate per batch (per scheduler): the K is one per launch anyway, a pooled count over the rows is
          exactly the batch's per-position rate, and it gets `rows` observations a step, carried across the
          requests that come and go (a joiner does not re-learn).
  lag     the acceptance of step s is weighed from choice s + 2 on, whenever it lands: an executor that keeps a step
          in flight chooses step s + 1 before step s lands, and one lag for every executor makes the choices (and
          so a seeded sampling run's tokens) the same on all of them.
  probes  a step of width K observes drafts 1..K-1 only: while K = 1 is chosen nothing is observed (a return of high
          acceptance would go unseen), and at K the estimates past K - 1 go stale (an unlucky low one would keep K
          narrow for good). So every so many steps at the chosen K one step runs the next wider width. The interval
          spends at most PROBE_BUDGET of the time on probes: (seconds(wider) / seconds(K) - 1) / interval <= budget.

Lossless by construction: any K verifies its drafts with the same accept (greedy or rejection sampling), so only the
speed depends on the choice. Step costs come from a `StepCosts` (seconds(K, bucket)): by default `MeasuredCosts`, the
steps' own times on this device as they are built (the default cost model until a step was timed: the CPU path),
or a given table or model. A step with a sampling row weighs the widths by the measured costs' model instead: its
draws depend on the widths, and a seeded run must take the same ones in every run (measured times vary).
"""
from __future__ import annotations

import math
import numbers
from typing import Protocol

DISCOUNT = 0.93  # weight of a position's past observations per step that observes it again
PRIOR = (0.5, 1.0)  # (acceptance, weight in trials) before anything is observed: one coin flip per position
PROBE_BUDGET = 0.01  # at most this share of the time at a chosen width goes to probes of the next wider one


class GammaError(ValueError):
    """gamma (drafts per spec step) is not "auto" / None or an integer in 1..block_size-1 of the drafter."""


AUTO = "auto"  # gamma chosen per step (None means the same)


def check_gamma(gamma, block_size: int) -> int | None:
    """gamma (drafts per step) against the drafter's block size: 1..block_size-1, or None / "auto" (chosen per step:
    returns None). Callers check it before loading weights or exporting graphs, so a bad --gamma costs nothing."""
    if gamma is None or gamma == AUTO:
        return None
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral):
        raise GammaError(f"gamma must be an integer, got {gamma!r}")
    if not 1 <= gamma <= block_size - 1:
        raise GammaError(f"gamma {gamma} outside [1, block_size-1={block_size - 1}] of this drafter")
    return int(gamma)


class StepCosts(Protocol):
    def seconds(self, K: int, bucket: int) -> float:
        """Wall time of one step of width K over a batch bucket (any unit, the same for every K)."""


class CostModel:
    """The default when no step was measured: a step streams the weights once (`fixed`) and computes per row
    (`per_row`, relative); a spec step adds the drafter block (`draft`). Shapes the choice, not measured."""

    def __init__(self, fixed: float = 1.0, per_row: float = 0.02, draft: float = 0.15):
        self.fixed, self.per_row, self.draft = fixed, per_row, draft

    def seconds(self, K: int, bucket: int) -> float:
        return self.fixed + self.per_row * K * bucket + (self.draft if K > 1 else 0.0)


class CostTable:
    """Measured step times {(K, bucket): seconds} (from start-up timings or captured graphs); a bucket not measured
    takes the nearest measured one's (the choice weighs widths against each other at one bucket)."""

    def __init__(self, table: dict):
        if not table or any(v <= 0 for v in table.values()):
            raise ValueError(f"a cost table needs positive step times, got {table!r}")
        self.table = {(int(k), int(b)): float(v) for (k, b), v in table.items()}

    def seconds(self, K: int, bucket: int) -> float:
        if (K, bucket) in self.table:
            return self.table[K, bucket]
        near = [b for k, b in self.table if k == K]
        if not near:
            raise KeyError(f"no step time for width {K} in the cost table")
        return self.table[K, min(near, key=lambda b: (abs(b - bucket), b))]


class MeasuredCosts:
    """Step times measured on this device as its steps are built (the graph executor times replays of each captured
    decode / spec step, runtime/backends/graph_executor.py), so auto draft length weighs the widths by what they
    cost here: a verify width's price differs by model, quantization and batch (a 27B FP8 spec step costs ~2x its
    plain step, the default model says 1.5x). A width not measured yet is estimated from the measured ones at the
    nearest measured bucket: between two measured widths of its kind (plain: K = 1; spec: K > 1) linearly in K,
    else the default model's shape scaled to the nearest measured width (of its kind when there is one); with nothing
    measured, the default model."""

    def __init__(self, model: CostModel | None = None):
        self.model = model or CostModel()
        self.table: dict = {}  # (K, bucket) -> seconds
        self._estimates: dict = {}

    def has(self, K: int, bucket: int) -> bool:
        return (K, bucket) in self.table

    def add(self, K: int, bucket: int, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"a step time must be positive, got {seconds!r} for width {K} at bucket {bucket}")
        self.table[int(K), int(bucket)] = float(seconds)
        self._estimates.clear()

    def seconds(self, K: int, bucket: int) -> float:
        key = (K, bucket)
        if key in self.table:
            return self.table[key]
        if key not in self._estimates:
            self._estimates[key] = self._estimate(K, bucket)
        return self._estimates[key]

    def _estimate(self, K: int, bucket: int) -> float:
        buckets = {b for _, b in self.table}
        if not buckets:
            return self.model.seconds(K, bucket)
        b = min(buckets, key=lambda v: (abs(v - bucket), v))
        at = {k: s for (k, v), s in self.table.items() if v == b}
        if K in at:
            return at[K]
        kin = sorted(k for k in at if (k > 1) == (K > 1)) or sorted(at)
        lo = [k for k in kin if k < K]
        hi = [k for k in kin if k > K]
        if lo and hi and K > 1:
            k0, k1 = lo[-1], hi[0]
            return at[k0] + (at[k1] - at[k0]) * (K - k0) / (k1 - k0)
        near = min(kin, key=lambda k: (abs(k - K), k))
        return at[near] * self.model.seconds(K, b) / self.model.seconds(near, b)


class Acceptance:
    """Per-position acceptance a_i (i = 1..positions) from discounted success / trial counts."""

    def __init__(self, positions: int, discount: float = DISCOUNT, prior: tuple = PRIOR):
        self.discount = discount
        self.hits = [prior[0] * prior[1]] * positions
        self.trials = [prior[1]] * positions

    def rates(self) -> list[float]:
        return [h / t if t > 0 else 0.0 for h, t in zip(self.hits, self.trials)]

    def record(self, gamma: int, accepted) -> None:
        """One spec step of gamma drafts; accepted: the accepted drafts of each of its rows."""
        hits, trials = [0] * gamma, [0] * gamma
        for m in accepted:
            for i in range(min(m + 1, gamma)):  # drafts 1..m accepted, draft m+1 (if any) rejected
                trials[i] += 1
                hits[i] += i < m
        for i in range(gamma):
            if trials[i]:
                self.hits[i] = self.discount * self.hits[i] + hits[i]
                self.trials[i] = self.discount * self.trials[i] + trials[i]


def expected_tokens(rates: list[float], K: int) -> float:
    """E[committed rows] of a step of width K: 1 + sum over drafts j < K of P(drafts 1..j accepted)."""
    total, p = 1.0, 1.0
    for a in rates[: K - 1]:
        p *= a
        total += p
    return total


class DraftLength:
    """The width of each step. fixed=K: always K. Else auto over `widths` (which must hold 1) with `costs`."""

    def __init__(self, widths, costs: StepCosts | None = None, fixed: int | None = None,
                 probe_budget: float = PROBE_BUDGET):
        self.widths = sorted({int(k) for k in widths} | ({fixed} if fixed is not None else set()))
        self.fixed = fixed
        if not self.widths or self.widths[0] != 1:
            raise ValueError(f"auto draft length needs width 1 (plain decode) among the widths, got {self.widths}")
        self.costs = costs or CostModel()
        self.probe_budget = probe_budget
        self.acceptance = Acceptance(self.widths[-1] - 1)
        self.since_probe = 0  # steps chosen since the last probe
        self.chosen = 0  # steps chosen so far (step s is the s-th choice, from 0)
        self.landed: list = []  # (step, gamma, accepted) recorded but not weighed yet

    @property
    def widest(self) -> int:
        """The widest step it may choose (the worst case a request reserves for)."""
        return self.fixed if self.fixed is not None else self.widths[-1]

    def rate(self, K: int, bucket: int, costs: StepCosts | None = None) -> float:
        """Expected committed tokens per second of a step of width K (per row: every row has the same estimate)."""
        return expected_tokens(self.acceptance.rates(), K) / (costs or self.costs).seconds(K, bucket)

    def choose(self, bucket: int, sampled: bool = False) -> int:
        """The width of the next step over `bucket` rows. sampled (a row samples): the widths are weighed by the
        costs' model when they are measured ones (MeasuredCosts.model), so that a seeded sampled run takes the same
        widths, and so the same tokens, in every run and on every executor (measured times vary; which drafts a
        rejection sampler sees changes its draws). Greedy tokens do not depend on the widths."""
        self.chosen += 1
        if self.fixed is not None:
            return self.fixed
        due = [obs for obs in self.landed if obs[0] <= self.chosen - 3]  # this is choice chosen - 1
        self.landed = [obs for obs in self.landed if obs[0] > self.chosen - 3]
        for _, gamma, accepted in sorted(due, key=lambda obs: obs[0]):
            self.acceptance.record(gamma, accepted)
        costs = getattr(self.costs, "model", self.costs) if sampled else self.costs
        K = max(self.widths, key=lambda k: (self.rate(k, bucket, costs), -k))
        if K == self.widths[-1]:
            return K
        self.since_probe += 1
        if self.since_probe > self.probe_interval(K, bucket, costs):
            self.since_probe = 0
            return self.widths[self.widths.index(K) + 1]
        return K

    def probe_interval(self, K: int, bucket: int, costs: StepCosts | None = None) -> int:
        """Steps at width K between probes of the next wider width: a probe's extra time over a step of K, spread
        so that it is at most probe_budget of their time."""
        costs = costs or self.costs
        wider = self.widths[self.widths.index(K) + 1]
        extra = costs.seconds(wider, bucket) / costs.seconds(K, bucket) - 1.0
        return max(1, math.ceil(extra / self.probe_budget - 1e-9))  # not one more for a rounding error

    def record(self, K: int, accepted, step: int | None = None) -> None:
        """A collected spec step of width K: the accepted drafts of each of its live rows; step: its number (None:
        the latest chosen)."""
        if K > 1 and accepted and self.fixed is None:
            self.landed.append((self.chosen - 1 if step is None else step, K - 1, list(accepted)))
