"""Every step a run may launch, compiled (or loaded from the step store) and captured before the first request:
`dflash-trt build --backend torch` runs it offline, so the processes that serve later load stored steps instead of
compiling while a request waits (runtime/backends/step_store.py).

The keys: prefill at the widths a chunk launches (runtime/batching.prefill_width) for the batch buckets a prefill
launch fills (up to PREFILL_BATCH rows), and decode and every spec width of runtime.verify_widths() (auto draft
length picks among them) for the buckets up to max_seqs; greedy keys (a sampled or logprobs key compiles on first
use: its buffers carry other fields).
"""
from __future__ import annotations

from dflash_trt.runtime.batching import BUCKETS, DECODE, PREFILL_BATCH, PREFILL_STEP, SPEC, bucket_for, prefill_width


def step_keys(rt, gamma: int | None = None, max_batch: int | None = None) -> list[tuple[str, int, int]]:
    """(kind, K, batch bucket) of every greedy step a run of rt launches; gamma fixed: that width only; max_batch:
    a run of at most that many sequences at once (default: the pools' max_seqs)."""
    top = bucket_for(max_batch or rt.sizes.max_seqs)
    buckets = [b for b in BUCKETS if b <= top]
    C = rt.sizes.prefill_chunk
    widths = sorted({C, prefill_width(1, C)}) if rt.backend.any_prefill_width else [C]
    keys = [(PREFILL_STEP, w, b) for w in widths for b in buckets if b <= bucket_for(min(PREFILL_BATCH, top))]
    keys += [(DECODE, 1, b) for b in buckets]
    if rt.dcfg is not None:
        ks = [gamma + 1] if gamma is not None else [k for k in rt.verify_widths() if k > 1]
        keys += [(SPEC, k, b) for k in ks for b in buckets]
    return keys


def prebuild(rt, gamma: int | None = None, progress=None, max_batch: int | None = None) -> list[tuple[str, int, int]]:
    """Build (compile or load, then capture) every key of step_keys on rt's graph executor; returns the keys."""
    keys = step_keys(rt, gamma, max_batch)
    for i, (kind, K, B) in enumerate(keys):
        if progress is not None:
            progress(f"[{i + 1}/{len(keys)}] {kind} K={K} batch {B}")
        rt.executor.entry(kind, K, B)
    return keys
