"""One sequence's state on the host: tokens, where its rows live, and its drafter context."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflash_trt.runtime.ctx import CtxWindow


@dataclass
class Sequence:
    seq_id: int
    tokens: list[int]  # the prompt (generated tokens are returned by the steps, not kept here)
    slot: int  # GDN / conv state slot
    max_blocks: int
    pages: list[int] = field(default_factory=list)  # target KV pages, logical order
    seq_len: int = 0  # rows committed to the cache (== positions 0..seq_len-1)
    ctx: CtxWindow | None = None
    bonus: int | None = None  # next token: emitted, not yet in the cache

    def block_table(self) -> np.ndarray:
        bt = np.zeros(self.max_blocks, dtype=np.int64)
        bt[: len(self.pages)] = self.pages
        return bt
