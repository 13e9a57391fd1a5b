"""Logprobs of emitted tokens: for each token a step emits, its log-probability and the top-k alternatives under the
target's distribution at that position, taken from the logits of the same target rows that decided it (the verify
rows of a speculative step, the decode row, the prefill's last row). Accepted drafts equal what those rows give, so
the values are the ones plain decoding reports for the same tokens.

The distribution is the target's raw one: log_softmax of its logits, before temperature, top-k, top-p or min-p (as
vLLM and OpenAI report them). Only steps with a row that asks for logprobs compute them (and only those ask the
graphs for logits on the greedy path); every such step computes the top LOGPROBS_MAX, cut per row on the host.

`token_logprobs` is the one implementation (torch; capturable: no host syncs, static shapes), used by the host
executor on graph outputs and by the fused device step inside its CUDA graph. numpy at module level; no torch import.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

LOGPROBS_MAX = 20  # top alternatives per token at most (OpenAI's top_logprobs bound)


class TokenLogprob(NamedTuple):
    """One emitted token's logprob, and its position's top alternatives, best first: ((token id, logprob), ...)."""
    token_id: int
    logprob: float
    top: tuple


def logprobs_k(rows) -> int | None:
    """The most alternatives a row of a step asks for (0: only the tokens' own), None when no row asks."""
    ks = [s.sampling.logprobs for s in rows if s is not None and s.sampling is not None
          and s.sampling.logprobs is not None]
    return max(ks) if ks else None


def token_logprobs(logits, tokens):
    """logits [..., V] (any float dtype) and the tokens [...] they emitted -> (logprob [...], top ids [..., L],
    top logprobs [..., L]) float32 / int64, L = min(LOGPROBS_MAX, V), in fp32."""
    import torch

    lp = torch.log_softmax(logits.float(), -1)
    top_lp, top_ids = torch.topk(lp, min(LOGPROBS_MAX, lp.shape[-1]), -1)
    return lp.gather(-1, tokens[..., None].to(torch.int64))[..., 0], top_ids, top_lp


def to_numpy(triple) -> tuple:
    """token_logprobs' tensors as numpy arrays on the host."""
    return tuple(t.detach().cpu().numpy() for t in triple)


def row_entries(triple, row: int, tokens: list, k: int) -> list:
    """The TokenLogprob of each of `tokens` (a row's emitted tokens, its first len(tokens) columns) with the top k of
    their positions; triple: numpy (logprob [B, T], top ids [B, T, L], top logprobs [B, T, L])."""
    lp, ids, tlp = triple
    out = []
    for j, tok in enumerate(tokens):
        top = tuple(zip(ids[row, j, :k].tolist(), tlp[row, j, :k].tolist()))
        out.append(TokenLogprob(int(tok), float(lp[row, j]), top))
    return out


# ---- packing into the fused step's int64 result rows ---------------------------------------------------------
def packed_width(T: int, L: int = LOGPROBS_MAX) -> int:
    """int64 columns of T tokens' logprobs: T logprobs, T * L top ids, T * L top logprobs."""
    return T * (1 + 2 * L)


def pack(triple):
    """token_logprobs' [B, T] / [B, T, L] tensors -> [B, packed_width(T, L)] int64 (floats as their float64 bits)."""
    import torch

    lp, ids, tlp = triple
    B = lp.shape[0]
    bits = lambda x: x.to(torch.float64).view(torch.int64).reshape(B, -1)  # noqa: E731
    return torch.cat([bits(lp), ids.reshape(B, -1), bits(tlp)], 1)


def unpack(cols: np.ndarray, T: int, L: int = LOGPROBS_MAX) -> tuple:
    """pack's columns [B, packed_width(T, L)] (numpy int64) -> the numpy triple of row_entries."""
    B = cols.shape[0]
    lp = cols[:, :T].view(np.float64)
    ids = cols[:, T:T + T * L].reshape(B, T, L)
    tlp = cols[:, T + T * L:].view(np.float64).reshape(B, T, L)
    return lp, ids, tlp


class FirstToken(int):
    """A prefill's first token (an int) with its logprobs: the numpy triple of row_entries for one row and one
    token, or None when its sequence did not ask."""
    logprobs = None


def first_tokens(firsts, triple=None) -> list:
    """Per row, the prefill's first token with its own row of `triple` ([B] / [B, L] numpy arrays) attached (None:
    no row asked for logprobs)."""
    out = []
    for b, tok in enumerate(firsts):
        t = FirstToken(int(tok))
        t.logprobs = None if triple is None else tuple(x[b][None, None] for x in triple)
        out.append(t)
    return out
