"""The one commit path (DESIGN §5): every step — prefill chunk, decode, verify, gated-off decode — ends
here with n committed rows per sequence. Graphs never mutate pools (one exception below); a commit does, in
three parts:

  reserve (host, before launch)  pages for the step's WORST case (T rows; prefill: the chunk's valid rows)
                                 in the target KV pool and the drafter ctx pool; all-or-nothing per
                                 sequence, so a failure changes nothing.
  write   (device)               KV rows into pages, GDN fold of n rows (verify) or the final state
                                 (prefill), conv roll by n columns, drafter ctx rows at the logical rows of
                                 their absolute positions. n is a device array: on the GPU this runs inside
                                 the step's CUDA graph, before the host knows n.
  finish  (host, once n is known) seq_len += n, ctx.finish_append(n rows at positions seq_len..), the
                                 reservation's unused tail pages given back.

The exception: the torch modules' plain decode step (FusedSteps.decode, StepGraphs.commits_decode_gdn) commits
its one GDN row inside the GDN kernel, where it reads the state (one read and one write of the state instead of
three passes: the state dominates a wide batch's decode step); its n is known before the launch (the live rows)
and the state bits are the fold's. write() then folds nothing for that step.
The host path (the scheduler and host_step) runs the three in sequence; the GPU path reserves before the launch
and finishes when the step's n comes back. A Device only; no torch here.
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.runtime.pools import PoolExhausted


def cdiv(a: int, b: int) -> int:
    """Pages of b rows that hold a rows (ceil(a / b))."""
    return -(-a // b)


@dataclass
class WriteTables:
    """Where a step's rows go, one entry per batch row (arrays of the device's kind: numpy or tensors).
    start: logical KV row of the step's first row (= seq_len); ctx_start: its logical ctx row."""
    slot: object
    start: object
    block_table: object
    ctx_table: object = None
    ctx_start: object = None


def reserve(seq, rows: int, kv_alloc, page_size: int, ahead: int = 0) -> None:
    """Pages for rows [seq_len, seq_len + ahead + rows) of one sequence, KV and drafter ctx together.
    `ahead` counts rows of this sequence's steps still in flight (their worst case). All-or-nothing:
    PoolExhausted / ValueError leave the sequence's pages exactly as they were."""
    upto = seq.seq_len + int(ahead) + int(rows)
    need = cdiv(upto, page_size) - len(seq.pages)
    if need > 0 and len(seq.pages) + need > seq.max_blocks:
        raise PoolExhausted(f"sequence {seq.seq_id} block table", need, seq.max_blocks - len(seq.pages))
    got = kv_alloc.alloc(need) if need > 0 else []
    if seq.ctx is not None:
        try:
            seq.ctx.reserve(upto - seq.seq_len)
        except Exception:
            if got:
                kv_alloc.free(got)
            raise
    seq.pages.extend(got)


def reserve_batch(seqs, rows, kv_alloc, page_size: int) -> None:
    """reserve() for every sequence of a batch, all-or-nothing across the batch (host-path steps)."""
    done = []
    try:
        for s, k in zip(seqs, rows):
            before = (len(s.pages), s.ctx.num_pages if s.ctx is not None else 0)
            reserve(s, int(k), kv_alloc, page_size)
            done.append((s, before))
    except Exception:
        for s, (kv, ctx) in done:
            kv_alloc.free(s.pages[kv:])
            del s.pages[kv:]
            if s.ctx is not None:
                s.ctx.unreserve(s.ctx.num_pages - ctx)
        raise


def write(dev, pools: dict, out: dict, n, t: WriteTables, dkv_rows=None) -> None:
    """The device part: commit n[b] rows of target-graph outputs `out` (and drafter ctx rows) into the pools.
    Rows i >= n[b] are never written, so n = 0 (padding rows of a batch bucket) touches nothing."""
    if out.get("kv_rows") is not None:
        dev.kv_write(pools["kv_pool"], out["kv_rows"], t.block_table, t.start, n)
    if out.get("conv_cols") is not None:
        if out.get("gdn_state") is not None:
            dev.gdn_set(pools["gdn_pool"], t.slot, out["gdn_state"], n)
        elif out.get("gdn_k") is not None:  # neither: a decode graph that committed its GDN rows (gdn_commit)
            dev.gdn_fold(pools["gdn_pool"], t.slot, out["gdn_k"], out["gdn_v"], out["gdn_g"], out["gdn_beta"], n)
        dev.conv_roll(pools["conv_pool"], t.slot, out["conv_cols"], n)
    if dkv_rows is not None:
        dev.kv_write(pools["dkv_pool"], dkv_rows, t.ctx_table, t.ctx_start, n)


def finish(seq, n: int, kv_alloc, page_size: int, ahead: int = 0) -> None:
    """The host part once n is known: advance the sequence, append n ctx positions, give back the
    reservation's unused tail past `ahead` more rows (those of steps still in flight; the scheduler adds its
    next step's worst case, which it would reserve straight back)."""
    n = int(n)
    if seq.ctx is not None:
        seq.ctx.finish_append(n, range(seq.seq_len, seq.seq_len + n))
        seq.ctx.trim(ahead)
    seq.seq_len += n
    keep = cdiv(seq.seq_len + int(ahead), page_size)
    if len(seq.pages) > keep:
        kv_alloc.free(seq.pages[keep:])
        del seq.pages[keep:]
