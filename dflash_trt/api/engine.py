"""`Engine`: the text layer over a Runtime's continuous batching, shared by `LLM` and the server's engine loop.

A `Track` is one completion: the runtime `Request` that makes its tokens, its incremental detokenizer and stop
strings. `Engine.step()` runs one `Runtime.step()` and then reads every live track's new tokens: stop tokens,
EOS and stop strings end a track early (its request is released at once: slot and pages back), max_tokens ends it
through the runtime. A step fault (Runtime.step re-raises it after failing the requests it belongs to) fails only
those tracks; the others go on. Not thread-safe: one thread owns an Engine (it owns the Runtime)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_trt.api.detok import IncrementalDetokenizer, StopStrings
from dflash_trt.api.params import SamplingParams
from dflash_trt.runtime.runtime import CapacityError, check_gamma
from dflash_trt.runtime.scheduler import FAILED


@dataclass(eq=False)
class Track:
    """One completion in progress. text: decoded so far (ends before a matched stop string); sent: how much of it
    take_delta() handed out; finish_reason: None while running, else "stop" / "length" / "abort" / "error"."""

    req: object
    params: SamplingParams
    index: int
    detok: IncrementalDetokenizer
    stops: StopStrings
    submitted: float
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per token of token_ids when params.logprobs is set
    text: str = ""
    sent: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: Exception | None = None
    first_token_s: float | None = None
    seconds: float | None = None
    sink: object = None  # the server's per-request callback (engine thread); unused by LLM

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tau(self) -> float:
        acc = self.req.accepted
        return (sum(acc) + len(acc)) / len(acc) if acc else 0.0

    def take_delta(self) -> tuple[str, list]:
        """Text and tokens not handed out yet. While running, text that could start a stop string is held back."""
        end = len(self.text) if self.finished else len(self.text) - self.stops.held(self.text)
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        tokens, self.sent_tokens = self.token_ids[self.sent_tokens:], len(self.token_ids)
        return delta, tokens


class Engine:
    def __init__(self, rt, codec, gamma: int | str | None = None, spec: bool = True):
        """gamma: drafts per step, or None / "auto": chosen per step (runtime.draft_length)."""
        self.rt, self.codec = rt, codec
        self.spec = spec and rt.dcfg is not None
        self.gamma = check_gamma(gamma, rt.dcfg.block_size) if self.spec else 0
        self.K = rt.draft_length(self.gamma).widest if self.spec else 1
        self.live: list[Track] = []

    @property
    def has_work(self) -> bool:
        return bool(self.live) or self.rt.has_work

    def room(self, prompt_len: int) -> int:
        """New tokens the runtime can hold after a prompt of prompt_len tokens (max_tokens=None asks for this)."""
        return self.rt.sizes.max_seq_len - prompt_len - self.K * (1 + self.rt.executor.max_inflight)

    def add(self, prompt_ids, params: SamplingParams, index: int = 0) -> Track:
        """Queue sample `index` of a prompt; bad input raises the runtime's typed error before anything is queued."""
        ids = self.rt.check_prompt(prompt_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.room(len(ids))
        if max_tokens < 1:
            raise CapacityError(f"prompt of {len(ids)} tokens leaves no room for new tokens "
                                f"(max_seq_len={self.rt.sizes.max_seq_len})")
        sp = params.token_sampling(index)
        req = self.rt.add_request(ids, max_tokens, self.gamma, self.spec,
                                  temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                                  seed=sp.seed, ignore_eos=params.ignore_eos, logprobs=sp.logprobs)
        track = Track(req, params, index, IncrementalDetokenizer(self.codec.decode), StopStrings(params.stop),
                      time.perf_counter())
        self.live.append(track)
        return track

    def abort(self, track: Track, reason: str = "abort") -> None:
        """End a track now (client gone, caller interrupted): its request leaves, slot and pages go back."""
        if track.finished:
            return
        self._end(track, reason)

    def step(self) -> tuple[list[Track], Exception | None]:
        """One runtime step; returns the tracks that changed (new text or finished) and the step's fault, if any
        (its requests failed; the runtime goes on)."""
        fault = None
        if self.rt.has_work:
            try:
                self.rt.step()
            except Exception as err:  # a fault: Runtime.step failed the requests it belongs to, the others moved on
                fault = err
        changed = []
        for t in list(self.live):
            try:
                if self._advance(t):
                    changed.append(t)
            except Exception as err:  # this track's text work failed (a decoder error): it fails alone
                t.error = err
                self._end(t, "error")
                changed.append(t)
        return changed, fault

    def _advance(self, t: Track) -> bool:
        """Read t's new tokens; True if it changed."""
        new = t.req.tokens[len(t.token_ids):]
        for tok in new:
            if t.first_token_s is None:
                t.first_token_s = time.perf_counter() - t.submitted
            if t.params.logprobs is not None:  # the runtime appends a token's logprobs with it
                t.logprobs.append(t.req.logprobs[len(t.token_ids)])
            t.token_ids.append(tok)
            if tok in t.params.stop_token_ids:
                t.stop_reason = tok
                return self._end(t, "stop")
            if tok in self.rt.eos and not t.params.ignore_eos:
                return self._end(t, "stop")
            before = len(t.text)
            t.text += t.detok.push(tok)
            hit = t.stops.find(t.text, before)
            if hit is not None:
                t.text, t.stop_reason = t.text[:hit[0]], hit[1]
                return self._end(t, "stop")
        if t.req.status == FAILED:
            t.error = t.req.error
            return self._end(t, "error")
        if t.req.done:  # max_tokens (EOS was seen above)
            t.text += t.detok.flush()
            return self._end(t, "length")
        return bool(new)

    def _end(self, t: Track, reason: str) -> bool:
        t.finish_reason = reason
        t.seconds = time.perf_counter() - t.submitted
        if not t.req.done:
            self.rt.release_request(t.req)
        self.live.remove(t)
        return True
