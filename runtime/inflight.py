"""The scheduler's launches in flight, in launch order, and which of them is due to be collected.

An entry is a pair (launch, pending): launch is a batching.StepPlan (one step of its rows) or a Join (one
request's prefill, whose collect emits its first token); pending is the executor's handle for it. The rules:

  landed joins  a joiner's prefill is collected once it has landed, never waited for beside a step;
  due           with a step just launched, the oldest steps are collected while more than the executor keeps
                running are in flight; with none launched, everything in flight is;
  next due      the oldest step, after the prefills of its own rows' joiners (their first tokens come first);
                with no step in flight, the oldest prefill.

Entries are compared by identity (two launches are never the same entry). Host bookkeeping only.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dflash_trt.runtime.request import Request


@dataclass(frozen=True)
class Join:
    """An admitted request's prefill in flight (its entry in Scheduler.inflight): collecting it emits the first
    token. A device executor's next step may run on the request before then (the device holds that token)."""
    req: Request


class InFlightQueue:
    """The (launch, pending) entries in flight, oldest first; iterating yields them in that order."""

    def __init__(self):
        self._entries: deque = deque()

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries))

    def push(self, launch, pending) -> None:
        self._entries.append((launch, pending))

    def pop_newest(self) -> tuple:
        return self._entries.pop()

    def pop_oldest(self) -> tuple:
        return self._entries.popleft()

    def take(self, entry: tuple) -> None:
        """Remove this entry (by identity), wherever it is in the queue."""
        self._entries = deque(e for e in self._entries if e is not entry)

    def steps(self) -> int:
        """Steps (not prefills) in flight."""
        return sum(not isinstance(launch, Join) for launch, _ in self._entries)

    def landed_joins(self, landed) -> list:
        """The prefill entries whose pending handle has landed (landed(pending) -> bool, asked in launch order)."""
        return [e for e in self._entries if isinstance(e[0], Join) and landed(e[1])]

    def due(self, launched: bool, keep_running: int) -> bool:
        """Something must be collected now: anything in flight when nothing was launched, else more than
        keep_running steps."""
        return bool(self._entries) and (not launched or self.steps() > keep_running)

    def next_due(self) -> list:
        """The entries to collect next, in order: the oldest step preceded by its rows' joiners' prefills, or the
        oldest prefill when no step is in flight. The queue must not be empty."""
        first_step = next((i for i, (launch, _) in enumerate(self._entries) if not isinstance(launch, Join)), 0)
        entry = self._entries[first_step]
        if isinstance(entry[0], Join):
            return [entry]
        joins = [e for e in list(self._entries)[:first_step] if e[0].req in entry[0].reqs]
        return joins + [entry]
