"""State pools of the runtime: KV pages (refcounted block allocator) and fixed slots.

numpy only (no torch / tensorrt). Exhaustion is all-or-nothing: a failed request raises
`PoolExhausted` and leaves the pool exactly as it was (nothing leaked).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import numpy as np


class PoolExhausted(RuntimeError):
    """A pool could not satisfy a request. Carries `.pool`, `.requested`, `.free`."""

    def __init__(self, pool: str, requested: int, free: int):
        self.pool = pool
        self.requested = int(requested)
        self.free = int(free)
        super().__init__(
            f"{pool} pool exhausted: asked for {self.requested}, only {self.free} free"
        )


class _FreeList:
    """Ids 0..n-1 and the free list of those not in use (each id at most once); the pools add per-id state."""

    def __init__(self, n: int, name: str, what: str):
        if n < 0:
            raise ValueError(f"{what} must be >= 0, got {n}")
        self.name = name
        self._free: deque[int] = deque(range(int(n)))
        self._total = int(n)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._total


class BlockAllocator(_FreeList):
    """Refcounted page allocator. Free list is a deque; refcounts a numpy int32 array.

    A block is free iff its refcount is 0 (and then it is in the free list exactly once).
    """

    def __init__(self, num_blocks: int, name: str = "kv pages"):
        super().__init__(num_blocks, name, "num_blocks")
        self._ref = np.zeros(int(num_blocks), dtype=np.int32)

    def refcount(self, block: int) -> int:
        return int(self._ref[block])

    def alloc(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1; all-or-nothing (PoolExhausted, state unchanged)."""
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise PoolExhausted(self.name, n, len(self._free))
        out = [self._free.popleft() for _ in range(n)]
        self._ref[out] = 1
        return out

    def _check(self, blocks: Iterable[int], what: str) -> np.ndarray:
        b = np.asarray(list(blocks), dtype=np.int64).reshape(-1)
        if b.size and (b.min() < 0 or b.max() >= self.num_total):
            raise ValueError(f"{self.name}: {what} of out-of-range block in {b.tolist()}")
        return b

    def incref(self, blocks: Iterable[int]) -> None:
        """Share already-allocated blocks (refcount += 1 per occurrence)."""
        b = self._check(blocks, "incref")
        if b.size and np.any(self._ref[b] <= 0):
            bad = b[self._ref[b] <= 0].tolist()
            raise ValueError(f"{self.name}: incref of free block(s) {bad}")
        np.add.at(self._ref, b, 1)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per occurrence; a block returns to the free list at 0.

        Validated before any change: freeing a block more times than it is referenced
        (double free) raises ValueError and changes nothing.
        """
        # plain Python: a step frees one or two pages per sequence, where numpy's per-call cost (np.unique and
        # friends) dominates the host step (figures: docs/PERF.md)
        b = [int(x) for x in blocks]
        total = self.num_total
        if any(not 0 <= x < total for x in b):
            raise ValueError(f"{self.name}: free of out-of-range block in {b}")
        cnt: dict[int, int] = {}
        for x in b:
            cnt[x] = cnt.get(x, 0) + 1
        ref = self._ref
        over = sorted(x for x, c in cnt.items() if ref[x] < c)
        if over:
            raise ValueError(f"{self.name}: double free of block(s) {over}")
        for x in sorted(cnt):  # ascending: the order blocks return to the free list
            left = int(ref[x]) - cnt[x]
            ref[x] = left
            if left == 0:
                self._free.append(x)


class SlotPool(_FreeList):
    """Fixed slots (GDN state / conv state per sequence). alloc() -> int, free(slot)."""

    def __init__(self, num_slots: int, name: str = "slots"):
        super().__init__(num_slots, name, "num_slots")
        self._used = np.zeros(int(num_slots), dtype=bool)

    def alloc(self) -> int:
        if not self._free:
            raise PoolExhausted(self.name, 1, 0)
        s = self._free.popleft()
        self._used[s] = True
        return s

    def free(self, slot: int) -> None:
        slot = int(slot)
        if not 0 <= slot < self.num_total:
            raise ValueError(f"{self.name}: free of out-of-range slot {slot}")
        if not self._used[slot]:
            raise ValueError(f"{self.name}: double free of slot {slot}")
        self._used[slot] = False
        self._free.append(slot)
