"""The one commit path (DESIGN §5): every step — prefill chunk, decode, verify, gated-off decode —
ends here with n committed rows per sequence. Graphs never mutate pools; this does, in order:
  1. reserve target KV pages and drafter ctx pages for the new rows (all-or-nothing across the batch)
  2. write the n K/V rows into pages
  3. GDN: fold the first n rows of fold data into the slot (verify) or set the final state (prefill)
  4. conv: roll the state by the n pre-conv columns
  5. append the n drafter ctx K/V rows with their absolute positions (slides the window when full)
  6. seq_len += n
A failed reservation raises before anything is written, so every pool stays consistent.
"""
from __future__ import annotations

import numpy as np

from dflash_trt.runtime.pools import BlockAllocator, PoolExhausted


def _reserve(seqs, n, kv_alloc: BlockAllocator, page_size: int, with_ctx: bool):
    """Allocate the pages every sequence needs for its n new rows; on failure give all back."""
    got: list[tuple[object, list[int]]] = []
    planned = []
    try:
        for s, k in zip(seqs, n):
            need = -(-(s.seq_len + int(k)) // page_size) - len(s.pages)
            if len(s.pages) + max(need, 0) > s.max_blocks:
                raise PoolExhausted(f"sequence {s.seq_id} block table", need, s.max_blocks - len(s.pages))
            if need > 0:
                got.append((s, kv_alloc.alloc(need)))
        if with_ctx:
            for s, k in zip(seqs, n):
                before = list(s.ctx.pages)
                planned.append((s, before, s.ctx.plan_append(int(k))))
    except Exception:
        for _, pages in got:
            kv_alloc.free(pages)
        for s, before, _ in planned:  # give back ctx pages added by plan_append
            extra = s.ctx.pages[len(before):]
            if extra:
                s.ctx.allocator.free(extra)
            s.ctx.pages = before
        raise
    for s, pages in got:
        s.pages.extend(pages)
    return [p[2] for p in planned]


def commit(rt, seqs, out: dict, n, dkv_rows=None) -> None:
    """Commit n[b] rows of graph output `out` (target graph outputs, numpy) for each sequence.
    dkv_rows [Ld,2,B,R,H,hd] are the drafter ctx rows of the same tokens (None: no drafter)."""
    n = np.asarray(n, dtype=np.int64).reshape(-1)
    B = len(seqs)
    T = out["argmax"].shape[1]
    if n.shape[0] != B or np.any(n < 0) or np.any(n > T):
        raise ValueError(f"commit: n={n.tolist()} must have {B} entries in [0, {T}]")
    dev = rt.device
    with_ctx = dkv_rows is not None
    plans = _reserve(seqs, n, rt.kv_alloc, rt.sizes.page_size, with_ctx)
    slots = np.array([s.slot for s in seqs], dtype=np.int64)
    start = np.array([s.seq_len for s in seqs], dtype=np.int64)
    bt = np.stack([s.block_table() for s in seqs])
    if out.get("kv_rows") is not None:
        dev.kv_write(rt.pools["kv_pool"], out["kv_rows"], bt, start, n)
    if out.get("conv_cols") is not None:
        if "gdn_state" in out:
            dev.gdn_set(rt.pools["gdn_pool"], slots, out["gdn_state"], n)
        else:
            dev.gdn_fold(rt.pools["gdn_pool"], slots, out["gdn_k"], out["gdn_v"], out["gdn_gamma"], n)
        dev.conv_roll(rt.pools["conv_pool"], slots, out["conv_cols"], n)
    if with_ctx:
        cbt = np.stack([p[0] for p in plans]).astype(np.int64)
        cstart = np.array([p[1] for p in plans], dtype=np.int64)
        dev.kv_write(rt.pools["dkv_pool"], dkv_rows, cbt, cstart, n)
        for s, k in zip(seqs, n):
            s.ctx.finish_append(int(k), np.arange(s.seq_len, s.seq_len + int(k)))
    for s, k in zip(seqs, n):
        s.seq_len += int(k)
