"""A request's state in the scheduler, in a module of its own so that the scheduler's parts (runtime.inflight) can
name it without importing the scheduler; `dflash_trt.runtime.scheduler` re-exports it with its states."""
from __future__ import annotations

from dataclasses import dataclass, field

from dflash_trt.runtime.sampling import GREEDY, SamplingParams

WAITING, RUNNING, FINISHED, FAILED = "waiting", "running", "finished", "failed"


@dataclass(eq=False)  # identity: a request is one object, compared and hashed as such
class Request:
    """One request's life in the scheduler: WAITING (queued) -> RUNNING (admitted: seq holds its slot and pages) ->
    FINISHED or FAILED (left; seq is None once no launch of it is in flight). tokens grow as its launches are
    collected; rows_in_flight and launches_in_flight count what of it the executor has not given back yet."""
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far (first one from the prefill)
    logprobs: list = field(default_factory=list)  # a runtime.logprobs.TokenLogprob per token when sampling asks
    seq: object = None  # runtime.sequence.Sequence while admitted
    status: str = WAITING
    finish_reason: str | None = None  # "eos" | "length" | "released" | "error"
    error: Exception | None = None
    rows_in_flight: int = 0  # rows reserved for this request's steps still in flight (their worst case)
    launches_in_flight: int = 0  # its launches (prefill, steps) not yet collected
    steps: int = 0  # target launches after the prefill
    accepted: list = field(default_factory=list)  # accepted drafts per spec step
    rt: object = field(default=None, repr=False)  # the Runtime that queued it (release_request checks it)
    sampling: SamplingParams = GREEDY  # seed resolved when queued (req.sampling.seed reproduces it)
    ignore_eos: bool = False  # EOS is an ordinary token: only max_new_tokens (or a release) ends it

    @property
    def done(self) -> bool:
        return self.status in (FINISHED, FAILED)

    @property
    def wants_step(self) -> bool:
        """Running and not certain to be complete once its launches in flight land (each yields >= 1 token)."""
        return self.status == RUNNING and len(self.tokens) + self.launches_in_flight < self.max_new_tokens
