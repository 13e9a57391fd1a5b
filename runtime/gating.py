"""Adaptive gating: turn speculation off while drafts are mostly rejected, back on later.

While off, the runtime runs plain K=1 decode steps, and the same commit path still appends their
ctx rows, so the drafter's context is complete when speculation resumes.
"""
from __future__ import annotations

from collections import deque


class Gate:
    def __init__(self, min_rate: float = 0.1, window: int = 8, off_steps: int = 16):
        """min_rate: accepted drafts / proposed drafts over the last `window` spec steps below which
        speculation pauses for `off_steps` decode steps. min_rate=0 never pauses."""
        self.min_rate, self.window, self.off_steps = min_rate, window, off_steps
        self.reset()

    def reset(self) -> None:
        self.history: deque = deque(maxlen=self.window)
        self.off_left = 0
        self.pauses = 0

    def spec_on(self) -> bool:
        return self.off_left == 0

    def record(self, accepted: int, gamma: int) -> None:
        self.history.append(accepted / gamma)
        if len(self.history) == self.window and sum(self.history) / self.window < self.min_rate:
            self.off_left = self.off_steps
            self.pauses += 1
            self.history.clear()

    def tick(self) -> None:
        """One gated-off decode step done."""
        if self.off_left > 0:
            self.off_left -= 1
