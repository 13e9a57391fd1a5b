"""Who joins at one scheduler step: the admission decision, in plain numbers (the scheduler does the joining).

The rules, in the order they are checked for the request at the head of the waiting queue:

  cap      at most PREFILL_BATCH joiners a step while steps are in flight (one shared prefill launch's host work,
           so a batch that ends together refills over a few steps with the device kept busy), else max_batch;
  room     the requests stepping plus the joiners stay within max_batch, or within max_batch + PREFETCH while
           steps are in flight: a prefetched joiner's prefill runs while it waits for a row, so the row that frees
           is filled at the next launch;
  slot     a state slot is free;
  pages    with requests running or landing, the pages to start it are free (else it waits for them to end rather
           than fail); a prefetched joiner (past max_batch) also needs its life's worst case plus what the running
           and earlier joiners are owed, so it never takes a page that one of them may still need.

The queue stops at the first request refused (first come, first served). Nothing here touches a pool.
"""
from __future__ import annotations

from dflash_trt.runtime.batching import PREFILL_BATCH
from dflash_trt.runtime.page_budget import PageBudget, Pages, fits

PREFETCH = 2  # requests admitted (prefilled) ahead of a free row while steps are in flight


class Admission:
    """One scheduler step's admission decision. Built with what the step sees: `stepping` (running requests that
    still want a step), `overlapping` (a device executor with launches in flight), `busy` (requests running or
    launches in flight: pages come back later), the free pages of both pools and `owed` (what the running
    requests may still take; used only while overlapping). Each admits() that says yes takes the joiner's pages
    from the free count, so the next request is judged against what is left."""

    def __init__(self, budget: PageBudget, *, max_batch: int, stepping: int, overlapping: bool, busy: bool,
                 free: Pages, owed: Pages = (0, 0)):
        self.budget, self.max_batch, self.stepping = budget, max_batch, stepping
        self.overlapping, self.busy = overlapping, busy
        self.cap = PREFILL_BATCH if overlapping else max_batch
        self.room = max_batch + PREFETCH if overlapping else max_batch
        self.free, self.owed = tuple(free), tuple(owed)

    def has_room(self, joined: int, free_slots: int) -> bool:
        """Another joiner may come after `joined` this step (cap, room and a free state slot)."""
        return joined < self.cap and self.stepping + joined < self.room and free_slots > 0

    def admits(self, prompt_len: int, max_new_tokens: int, joined: int) -> bool:
        """The request may join after `joined` others; yes takes its pages to start from the free count (whether or
        not its sequence is then made)."""
        need = self.budget.to_start(prompt_len)
        if self.busy and not fits(need, self.free):
            return False  # requests running or landing give pages back as they end: wait for them
        if self.overlapping:
            life = self.budget.for_life(prompt_len, max_new_tokens)
            prefetched = self.stepping + joined >= self.max_batch
            if prefetched and not fits((life[0] + self.owed[0], life[1] + self.owed[1]), self.free):
                return False
            self.owed = (self.owed[0] + life[0] - need[0], self.owed[1] + life[1] - need[1])
        self.free = (self.free[0] - need[0], self.free[1] - need[1])
        return True
