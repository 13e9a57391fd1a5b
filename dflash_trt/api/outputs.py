"""What `LLM.generate` returns: one `RequestOutput` per prompt, with one `CompletionOutput` per sample."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompletionOutput:
    """One completion. finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens).
    stop_reason: the stop string or stop token id that ended it (None for EOS and "length").
    token_ids: every generated token, the one that stopped it included (a stop string's tokens too: the text ends
    before the stop string, the tokens are what the model emitted). tau: tokens per speculative step (accepted drafts
    + 1; 0.0 without spec steps); steps: target launches after the prefill. logprobs (SamplingParams.logprobs set):
    one `TokenLogprob(token_id, logprob, top)` per token of token_ids, top = ((token id, logprob), ...) best first
    (dflash_trt.runtime.logprobs); None when not asked."""

    index: int
    text: str
    token_ids: tuple
    finish_reason: str
    stop_reason: str | int | None = None
    tau: float = 0.0
    steps: int = 0
    logprobs: tuple | None = None


@dataclass(frozen=True)
class RequestOutput:
    """A prompt's completions. first_token_s / seconds: from submission to the first token / to the last
    completion's end (the prompt's own, in a batch with others)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: tuple
    outputs: tuple
    first_token_s: float
    seconds: float
