"""Per-sequence bookkeeping of the DFlash drafter context (ctx K/V rows in drafter pages).

The K/V rows live in `dkv_pool [Ld, 2, num_blocks, block_size, H, hd]`; K already carries
RoPE at its absolute position, so rows are never recomputed or moved -- only pages freed.

Representation (logical rows index the sequence's page list `pages`):
    row r  ->  page pages[r // block_size], offset r % block_size
    held rows   [start, end)     absolute positions contiguous, ending at `_last` (O(1) per append)
    visible     [end - ctx_len, end),  ctx_len = min(total appended, window)
Invariants after every finish_append: 0 <= start < block_size (pages holding only dropped
rows are freed), end - start >= ctx_len, end <= max(2*window, window + block_size - 1), end <= total
(so a window of max_seq_len rows or more never slides and needs a table of one sequence's rows).

Capacity = 2*window rows. When `end` exceeds it, the window SLIDES: the newest `window` rows are
kept (watermark = newest half of capacity); every page that holds only dropped rows is freed
and the remaining offset into the first kept page simply stays in `start` (kv_start), no copy.

Block tables are padded with 0 to `max_blocks` (static width for the graphs,
dflash_trt.abi.ctx_block_table_width), which bounds the pages ever held; `max_append`
(default: window) caps n per append.

Two ways to drive it:
  * synchronous (host path): plan_append(n) -> write -> finish_append(n) (slides itself when over capacity);
  * ahead (GPU path, steps in flight): reserve(rows) for the worst case of every step not yet finished,
    slide() only before a launch (so a slide never moves rows under a step in flight), finish_append(n)
    with auto_slide=False, trim(rows) gives back pages past the rows still reserved.
`base` (= total - end, the rows dropped by slides) maps an absolute position p to its logical row p - base,
which is all a device needs to address the window without any per-sequence device state.
numpy only.
"""

from __future__ import annotations

import numpy as np

from dflash_trt.abi import ctx_block_table_width
from dflash_trt.runtime.commit import cdiv
from dflash_trt.runtime.pools import BlockAllocator


class CtxWindow:
    def __init__(self, window: int, block_size: int, allocator: BlockAllocator,
                 max_append: int | None = None, auto_slide: bool = True, max_seq_len: int | None = None):
        if window <= 0 or block_size <= 0:
            raise ValueError(f"window and block_size must be > 0 (got {window}, {block_size})")
        self.window = int(window)
        self.block_size = int(block_size)
        self.allocator = allocator
        self.max_append = int(max_append) if max_append is not None else self.window
        self.capacity = 2 * self.window
        self.auto_slide = bool(auto_slide)
        self.max_blocks = ctx_block_table_width(self.window, self.block_size, self.max_append, max_seq_len)
        self.pages: list[int] = []
        self.start = 0
        self.end = 0
        self.total = 0  # rows ever appended (== seq_len when every position is appended)
        self._last: int | None = None  # absolute position of the newest held row (None: nothing appended)

    # ---- queries ----------------------------------------------------------------------
    @property
    def ctx_len(self) -> int:
        return min(self.total, self.window)

    @property
    def base(self) -> int:
        """Rows dropped by slides so far: absolute position p lives at logical row p - base."""
        return self.total - self.end

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    def block_table(self) -> np.ndarray:
        bt = np.zeros(self.max_blocks, dtype=np.int32)
        bt[: len(self.pages)] = self.pages
        return bt

    def visible(self) -> tuple[np.ndarray, int, int]:
        """(block_table_row [max_blocks] int32, kv_start, kv_len): attend rows [kv_start, kv_len)."""
        return self.block_table(), self.end - self.ctx_len, self.end

    def positions_visible(self) -> np.ndarray:
        """Absolute positions of the visible rows (contiguous, ending at the last appended)."""
        return self._positions(self.ctx_len)

    def positions_held(self) -> np.ndarray:
        """Absolute positions of the held rows [start, end) (what a snapshot saves)."""
        return self._positions(self.end - self.start)

    def _positions(self, rows: int) -> np.ndarray:
        if self._last is None or rows <= 0:
            return np.zeros(0, dtype=np.int64)
        return np.arange(self._last - rows + 1, self._last + 1, dtype=np.int64)

    # ---- append -----------------------------------------------------------------------
    def plan_append(self, n: int) -> tuple[np.ndarray, int]:
        """Ensure pages for logical rows [end, end+n); returns (block_table_row, start_row=end).

        All-or-nothing: PoolExhausted leaves this window unchanged. Advances nothing.
        """
        n = int(n)
        if n < 0 or n > self.max_append:
            raise ValueError(f"append of {n} rows outside [0, max_append={self.max_append}]")
        self.reserve(n)
        return self.block_table(), self.end

    def reserve(self, rows: int) -> int:
        """Ensure pages for logical rows [end, end+rows); returns the pages added (all-or-nothing)."""
        need = cdiv(self.end + int(rows), self.block_size) - len(self.pages)
        if need <= 0:
            return 0
        if len(self.pages) + need > self.max_blocks:
            raise ValueError(f"ctx window of {self.max_blocks} pages cannot hold {rows} more rows after row {self.end}")
        self.pages.extend(self.allocator.alloc(need))  # raises before any change
        return need

    def unreserve(self, count: int) -> None:
        """Give back the last `count` pages added by reserve() (undo of a failed multi-pool reservation)."""
        if count > 0:
            self.allocator.free(self.pages[-count:])
            del self.pages[-count:]

    def trim(self, rows_ahead: int = 0) -> None:
        """Give back pages past logical row end + rows_ahead (a reservation's unused tail)."""
        keep = max(cdiv(self.end + int(rows_ahead), self.block_size), 0)
        if len(self.pages) > keep:
            self.unreserve(len(self.pages) - keep)

    def finish_append(self, n: int, positions) -> None:
        """Record n written rows (absolute positions: an array, or a range as the commit path passes them), advance
        end, slide if over capacity."""
        n = int(n)
        if isinstance(positions, range) and positions.step == 1:  # contiguous: no numpy checks
            pos, first, count = None, positions.start, len(positions)
        else:
            pos = np.asarray(positions, dtype=np.int64).reshape(-1)
            first, count = (int(pos[0]) if pos.size else 0), pos.shape[0]
        if count != n:
            raise ValueError(f"{n} rows but {count} positions")
        if len(self.pages) * self.block_size < self.end + n:
            raise RuntimeError("finish_append without a matching plan_append (no pages)")
        if n == 0:
            return
        prev = self._last if self._last is not None else first - 1
        # contiguous from prev + 1 <=> first and last fit and every step is 1 (numpy only past the ends)
        if first != prev + 1 or (pos is not None and (int(pos[-1]) != prev + n or (
                n > 2 and not np.array_equal(pos, np.arange(prev + 1, prev + n + 1))))):
            got = list(positions) if pos is None else pos.tolist()
            raise ValueError(f"ctx positions must be contiguous: last {int(prev)}, got {got}")
        self._last = prev + n
        self.end += n
        self.total += n
        if self.auto_slide and self.end > self.capacity:
            self._slide()

    def slide(self) -> int:
        """Free every page that holds only rows older than the newest `window`; returns rows dropped.
        Safe while a step is in flight: that step reads at most the newest `window` rows before `end`."""
        before = self.base
        if self.end - self.start > self.window:
            self._slide()
        return self.base - before

    def _slide(self) -> None:
        keep = min(self.end - self.start, self.window)
        if keep < self.ctx_len:  # would drop a row the drafter still attends to
            raise AssertionError(f"slide would keep {keep} < ctx_len {self.ctx_len} rows")
        new_start = self.end - keep
        drop = new_start // self.block_size  # pages holding only dropped rows
        if drop:
            self.allocator.free(self.pages[:drop])
            del self.pages[:drop]
        self.start = new_start - drop * self.block_size
        self.end -= drop * self.block_size
        assert 0 <= self.start < self.block_size and self.end - self.start == keep

    def release(self) -> None:
        """Free every page (idempotent); the window is empty afterwards."""
        if self.pages:
            self.allocator.free(self.pages)
        self.pages = []
        self.start = self.end = self.total = 0
        self._last = None
