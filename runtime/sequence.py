"""One sequence's state on the host: tokens, where its rows live, and its drafter context."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from dflash_trt.runtime.ctx import CtxWindow


class SequenceError(ValueError):
    """A sequence handle (or request) that this runtime cannot act on: released, from another Runtime,
    twice in one batch, prefilled again, or owned by the scheduler. Raised before anything is written."""


class TokenIdError(ValueError):
    """A token id that is not an integer, or outside the vocabulary."""


def token_ids(prompt, vocab_size: int, what: str = "prompt") -> list[int]:
    """prompt as a list of Python ints, refusing (not truncating) floats, bools and ids outside the vocabulary."""
    if isinstance(prompt, (str, bytes)):
        raise TokenIdError(f"{what} must be a list of token ids, got {type(prompt).__name__}; encode the text first")
    try:
        items = list(prompt)
    except TypeError:
        raise TokenIdError(f"{what} must be a list of token ids, got {type(prompt).__name__}") from None
    # the common case, Python ints in range, checked in C (bool is its own type, so never passes here): a joiner's
    # admission checks its prompt again, and the per-id loop below is about three times slower (docs/PERF.md)
    if set(map(type, items)) == {int} and 0 <= min(items) and max(items) < vocab_size:
        return items
    out = []
    for i, t in enumerate(items):
        # operator.index accepts int / numpy / torch integers and rejects 3.7 or np.float32(4.0), which int() truncates
        if isinstance(t, (bool, np.bool_)):
            raise TokenIdError(f"{what} token {i} is a bool ({t}); token ids are integers")
        try:
            v = operator.index(t)
        except TypeError:
            raise TokenIdError(f"{what} token {i} is {t!r} ({type(t).__name__}); token ids are integers") from None
        if not 0 <= v < vocab_size:
            raise TokenIdError(f"{what} token id {v} outside the vocabulary [0, {vocab_size})")
        out.append(v)
    return out


@dataclass
class Sequence:
    seq_id: int
    tokens: list[int]  # the prompt (generated tokens are returned by the steps, not kept here)
    slot: int  # GDN / conv state slot
    max_blocks: int
    pages: list[int] = field(default_factory=list)  # target KV pages, logical order
    seq_len: int = 0  # rows committed to the cache (== positions 0..seq_len-1)
    ctx: CtxWindow | None = None
    bonus: int | None = None  # next token: emitted, not yet in the cache (None: not prefilled yet)
    owner: object = field(default=None, repr=False, compare=False)  # the Runtime whose pools hold it
    managed: bool = False  # admitted by the scheduler: steps and release go through its requests
    sampling: object = None  # runtime.sampling.SamplingParams (seed resolved); None = greedy

    @property
    def live(self) -> bool:
        return self.slot >= 0

    def block_table(self) -> np.ndarray:
        bt = np.zeros(self.max_blocks, dtype=np.int64)
        bt[: len(self.pages)] = self.pages
        return bt
