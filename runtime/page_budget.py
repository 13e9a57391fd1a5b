"""The scheduler's page arithmetic: how many KV pages and drafter ctx pages a request needs to start, may hold over
its whole life, and how many the running requests may still take before they end.

Every count is a (KV pages, drafter ctx pages) pair and a worst case: a step reserves its full verify width K
(commit.reserve), so a request that starts holds its prompt plus one step, and one that runs to its max new tokens
holds at most those rows plus one step. The admission (runtime.admission) compares these sums with the free pages;
nothing here touches a pool. Plain numbers only (no runtime, no numpy), so it is tested with numbers alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.runtime.commit import cdiv

Pages = tuple  # (KV pages, drafter ctx pages)


def fits(need: Pages, free: Pages) -> bool:
    """Both pools have at least `need` pages free."""
    return need[0] <= free[0] and need[1] <= free[1]


@dataclass(frozen=True)
class PageBudget:
    """Worst-case page counts of one scheduler's requests.

    page_size: rows per page (both pools); step_rows: the verify width K a step reserves; ctx_window: the drafter's
    ctx window in rows, None without a drafter (then every ctx count is 0); ctx_blocks: the width of a ctx block
    table (a window never holds more pages than that)."""
    page_size: int
    step_rows: int
    ctx_window: int | None
    ctx_blocks: int

    def to_start(self, prompt_len: int) -> Pages:
        """Pages a request's prefill and first step reserve."""
        rows = prompt_len + self.step_rows
        ctx = cdiv(min(rows, self.ctx_window), self.page_size) if self.ctx_window is not None else 0
        return cdiv(rows, self.page_size), ctx

    def for_life(self, prompt_len: int, max_new_tokens: int) -> Pages:
        """Pages a request may hold at most: its prompt, its max new tokens and a step's worst case."""
        kv = cdiv(prompt_len + max_new_tokens + self.step_rows, self.page_size)
        return kv, min(kv, self.ctx_blocks) if self.ctx_window is not None else 0

    def owed(self, running) -> Pages:
        """Pages the running requests (anything with prompt, max_new_tokens and seq: pages, ctx.num_pages) may
        still take before they end: each one's life's worst case less what it holds; one without a sequence owes
        nothing."""
        kv = ctx = 0
        for req in running:
            if req.seq is not None:
                life, window = self.for_life(len(req.prompt), req.max_new_tokens), req.seq.ctx
                kv += max(0, life[0] - len(req.seq.pages))
                ctx += max(0, life[1] - (window.num_pages if window is not None else 0))
        return kv, ctx
