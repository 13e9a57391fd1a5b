"""One step's batch: which sequences run, in which bucket, and the host arrays that describe them.

A step runs its live sequences in the smallest batch bucket (1, 2, ..., 64) that holds them, so the
device needs one static graph per bucket, not per batch size (and only for the buckets up to max_seqs).
Padding rows are inert: live = 0 makes n = 0, which every commit kernel treats as "touch nothing"; they read
slot 0 and page 0 (harmless reads) and their per-slot device state is a dummy row (index max_seqs) that only
padding rows ever use.
numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Up to 64 sequences a step: a 27B-class model's decode step reads its weights once for every row, so throughput
# grows with the batch until the rows' own reads (KV, state) or the GEMMs' FLOPs catch up (docs/PERF.md).
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SPEC, DECODE, PREFILL_STEP = "spec", "decode", "prefill"
# Prefill chunks of requests that join together share a launch, up to this many rows (buckets 1, 2, 4): one
# launch per join was most of a serving batch's prefill time (figures: docs/PERF.md). The cap keeps the prefill's
# compiled graphs to three keys (each an Inductor compile on first use) and the rows a launch pads small.
PREFILL_BATCH = 4


def prefill_width(longest: int, chunk: int) -> int:
    """The row width of a prefill launch whose longest chunk has `longest` rows: half the chunk when they fit, else
    the chunk. A joiner's prompt is often shorter than a chunk, and the GDN kernel runs a launch's 16-row chunks one
    after another (figures: docs/PERF.md). Two widths keep the compiled prefill graphs at two per bucket."""
    return chunk // 2 if chunk % 2 == 0 and longest <= chunk // 2 else chunk


def bucket_for(n: int) -> int:
    """Smallest bucket holding n live rows."""
    for b in BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"a step holds at most {BUCKETS[-1]} sequences, got {n}")


@dataclass
class StepPlan:
    """kind: SPEC (drafter_block -> target_k{K} -> accept) or DECODE (target_k1 on the bonus token);
    rows: the bucket's rows, a Sequence or None (padding); reqs: whatever the caller tracks per live row;
    index: its number among the scheduler's steps (runtime.draft_length weighs its acceptance by it)."""
    kind: str
    K: int
    rows: list
    reqs: list | None = None
    index: int | None = None

    @property
    def bucket(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> np.ndarray:
        return np.array([s is not None for s in self.rows], dtype=np.int64)

    @property
    def gamma(self) -> int:
        return self.K - 1


def pad_rows(seqs: list) -> list:
    """Live sequences followed by None up to their bucket."""
    return list(seqs) + [None] * (bucket_for(len(seqs)) - len(seqs))


def step_tables(rows: list, max_blocks: int, ctx_blocks: int | None, max_seqs: int) -> dict:
    """What the host knows of a step's rows, int64 (padding rows: slot 0, dummy state row, empty tables).
    slot: state slot (pools); srow: per-slot device state row; live; block_table; ctx_table / ctx_base
    (rows dropped from the ctx window, so logical ctx row = position - ctx_base)."""
    B = len(rows)
    t = {
        "slot": np.array([s.slot if s else 0 for s in rows], dtype=np.int64),
        "srow": np.array([s.slot if s else max_seqs for s in rows], dtype=np.int64),
        "live": np.array([1 if s else 0 for s in rows], dtype=np.int64),
        "block_table": np.zeros((B, max_blocks), dtype=np.int64),
    }
    for b, s in enumerate(rows):
        if s is not None:
            t["block_table"][b, : len(s.pages)] = s.pages
    if ctx_blocks is not None:
        t["ctx_table"] = np.zeros((B, ctx_blocks), dtype=np.int64)
        t["ctx_base"] = np.zeros(B, dtype=np.int64)
        for b, s in enumerate(rows):
            if s is not None:
                t["ctx_table"][b, : len(s.ctx.pages)] = s.ctx.pages
                t["ctx_base"][b] = s.ctx.base
    return t


def prefill_rows(seqs: list, chunks: list, C: int) -> dict:
    """One prefill launch's chunk rows in the bucket of seqs, int64: ids [B, C] (each chunk left-aligned), start (its
    first position: seq_len) and valid (its length; 0 on padding rows, which commit nothing)."""
    B = bucket_for(len(seqs))
    ids, start, valid = np.zeros((B, C), dtype=np.int64), np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
    for b, (seq, chunk) in enumerate(zip(seqs, chunks)):
        ids[b, : len(chunk)] = chunk
        start[b], valid[b] = seq.seq_len, len(chunk)
    return {"ids": ids, "start": start, "valid": valid}


@dataclass
class StepResult:
    """What comes back from a step, per bucket row: tokens [B,K] (the target argmax: accepted drafts equal it,
    and the bonus is the argmax at the first mismatch, so the emitted tokens are tokens[b, :n[b]]); n [B]
    committed rows (0 for padding); ctx_start / ctx_len [B]: the drafter window the step attended
    (rows [kv_start, kv_len) of the ctx pages), reported so tests can check it against the host's; logprobs: the
    tokens' logprobs and top alternatives (runtime/logprobs.py's numpy triple) when a row asked for them, else None."""
    tokens: np.ndarray
    n: np.ndarray
    kv_start: np.ndarray | None = None
    kv_len: np.ndarray | None = None
    logprobs: tuple | None = None
