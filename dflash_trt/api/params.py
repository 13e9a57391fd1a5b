"""`SamplingParams` of the front door: what a caller asks of one prompt's completions, validated when built.

The token-picking fields (temperature, top_k, top_p, min_p, seed) and logprobs are checked by the runtime's own
`dflash_trt.runtime.sampling.SamplingParams`, so the front door and `Runtime.add_request` accept exactly the same
values; the rest (max_tokens, stop, stop_token_ids, ignore_eos, n) are the front door's."""
from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass

from dflash_trt.runtime.sampling import SEED_BITS, SamplingError
from dflash_trt.runtime.sampling import SamplingParams as TokenSampling


class ParamError(ValueError):
    """A request parameter out of range or of the wrong type; `param` names the field (the server's 400 says it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ParamError(name, f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _strings(name: str, v) -> tuple:
    items = (v,) if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ParamError(name, f"{name} must be a non-empty string or a list of them, got {v!r}")
    return tuple(items)


@dataclass(frozen=True)
class SamplingParams:
    """How one prompt is completed.

    max_tokens: new tokens at most (None: as many as the runtime's max_seq_len leaves after the prompt).
    temperature 0: greedy (default); > 0 samples with top_k (0 off) / top_p (1 off) / min_p (0 off).
    seed: reproduces a sampled completion; with n > 1, sample i uses `sample_seed(seed, i)` (sample 0: seed itself),
      so the samples differ and each reproduces. None: a fresh seed per sample. A seeded call reproduces when it
      runs the same way: alone on an idle runtime, or in the same batch. Beside other requests the batch's draft length
      (runtime/draft_length.py) may choose other widths at its steps; the sample is then another, equally exact draw.
    stop: strings matched on the decoded text (also across token boundaries); the text ends before the first match.
    stop_token_ids: tokens that end the completion (kept in token_ids, not in the text), like EOS.
    ignore_eos: EOS does not end the completion.
    n: independent completions of the prompt.
    logprobs: k in 0..20: each completion's `logprobs` holds, per generated token, its logprob and the k most likely
      tokens at its position (0: the token's own only), under the target's raw distribution (log_softmax of its
      logits, before temperature / top_k / top_p / min_p, as vLLM reports them); exact under speculation: the same
      values plain decoding gives. None: not computed (no cost)."""

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self):
        if self.max_tokens is not None:
            object.__setattr__(self, "max_tokens", _int("max_tokens", self.max_tokens, 1))
        try:
            tok = TokenSampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.logprobs)
        except SamplingError as e:  # its messages start with the field's name
            raise ParamError(str(e).split()[0], str(e)) from None
        for f in ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs"):
            object.__setattr__(self, f, getattr(tok, f))
        object.__setattr__(self, "stop", () if self.stop is None else _strings("stop", self.stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ParamError("stop_token_ids", f"stop_token_ids must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(_int("stop_token_ids", i, 0) for i in ids))
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        object.__setattr__(self, "n", _int("n", self.n, 1))

    def token_sampling(self, index: int = 0) -> TokenSampling:
        """The runtime's parameters for sample `index` of this prompt."""
        seed = None if self.seed is None else sample_seed(self.seed, index)
        return TokenSampling(self.temperature, self.top_k, self.top_p, self.min_p, seed, self.logprobs)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: sample 0 keeps it (n=1 reproduces a plain seeded
    run); the others hash (seed, index), so they differ from each other and from every small seed."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << SEED_BITS) - 1)
