"""The Device seam: allocation, host transfer and the commit kernels.

`HostDevice` is the numpy twin of the GPU devices (`TorchDevice`): same interface, so all runtime logic is
tested on CPU. Every commit kernel mutates a pool array IN PLACE, is vectorised over a batch
of B sequences, and takes `n` (int [B]): rows to commit per sequence (0 allowed = untouched).
numpy only (no torch / tensorrt).
"""

from __future__ import annotations

import numpy as np


def _n(n, B: int, T: int | None = None) -> np.ndarray:
    """Rows to commit per sequence as int64 [B]; with T, checked to lie in [0, T]."""
    n = np.asarray(n, dtype=np.int64).reshape(-1)
    if n.shape[0] != B:
        raise ValueError(f"n has {n.shape[0]} entries, batch is {B}")
    if T is not None and (np.any(n < 0) or np.any(n > T)):
        raise ValueError(f"n must be in [0, {T}], got {n.tolist()}")
    return n


class HostDevice:
    name = "host"

    # ---- memory -----------------------------------------------------------------------
    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def pad_rows(self, x, rows: int) -> np.ndarray:
        """x [B,T,...] -> [B,rows,...] zero-padded (graphs with a static row count)."""
        out = np.zeros((x.shape[0], rows) + x.shape[2:], dtype=x.dtype)
        out[:, : x.shape[1]] = x
        return out

    def to_host(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    def from_host(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    # ---- paged KV ---------------------------------------------------------------------
    def kv_write(self, pool, rows, block_table, start_row, n) -> None:
        """Scatter new K/V rows into pages.

        pool        [L, 2, num_blocks, block_size, H, hd]
        rows        [L, 2, B, T, H, hd]
        block_table [B, max_blocks] int
        start_row   [B] int   logical row of rows[:, :, b, 0] in sequence b's page list
        n           [B] int   rows to write (row i < n[b])
        Row i of sequence b -> page block_table[b, (start_row[b]+i)//bs], offset (..)%bs.
        """
        B, T = rows.shape[2], rows.shape[3]
        n = _n(n, B, T)
        bs = pool.shape[3]
        bt = np.asarray(block_table, dtype=np.int64)
        st = np.asarray(start_row, dtype=np.int64).reshape(-1)
        bi, ii = np.nonzero(np.arange(T)[None, :] < n[:, None])  # (b, i) pairs
        if bi.size == 0:
            return
        logical = st[bi] + ii
        pages = bt[bi, logical // bs]
        offs = logical % bs
        pool[:, :, pages, offs] = rows[:, :, bi, ii]

    def gather_rows(self, pool, block_table_row, start, count) -> np.ndarray:
        """Read logical rows [start, start+count) of one sequence's page list.

        pool [L, 2, num_blocks, bs, H, hd]; block_table_row [max_blocks]
        returns [L, 2, count, H, hd] (a copy)
        """
        bs = pool.shape[3]
        logical = int(start) + np.arange(int(count), dtype=np.int64)
        bt = np.asarray(block_table_row, dtype=np.int64)
        return pool[:, :, bt[logical // bs], logical % bs].copy()

    # ---- gated delta net state --------------------------------------------------------
    def gdn_fold(self, pool, slots, k_hat, v, g, beta, n) -> None:
        """Fold n committed rows into each sequence's GDN state, one row at a time by the recurrence
        (S' = e^g S; u = beta (v - S'^T k); S = S' + k u^T), each row in float64 and rounded back to the pool's
        dtype, so n rows at once == n one-row folds exactly (as the kernel).

        pool  [L, num_slots, Hv, dk, dv] float32
        slots [B] int
        k_hat [L, B, T, Hk, dk] (l2-normalised keys); v [L, B, T, Hv, dv]; g, beta [L, B, T, Hv]
        n     [B] int
        v-head h uses k-head h // (Hv // Hk). n = 0: state untouched; rows past n[b] are not read.
        """
        L, B, T, Hk, dk = k_hat.shape
        Hv = v.shape[3]
        n = _n(n, B, T)
        sel = np.nonzero(n > 0)[0]
        if sel.size == 0:
            return
        ns = n[sel]
        sl = np.asarray(slots, dtype=np.int64).reshape(-1)[sel]
        k = np.repeat(k_hat[:, sel].astype(np.float64), Hv // Hk, axis=3)  # [L,b,T,Hv,dk]
        v, g, beta = (np.asarray(x)[:, sel].astype(np.float64) for x in (v, g, beta))
        S = pool[:, sl]                                                      # [L,b,Hv,dk,dv]
        for i in range(int(ns.max())):
            Sd = S.astype(np.float64) * np.exp(g[:, :, i])[..., None, None]
            u = beta[:, :, i, :, None] * (v[:, :, i] - np.einsum("lbhkv,lbhk->lbhv", Sd, k[:, :, i]))
            Sd = Sd + k[:, :, i, :, :, None] * u[..., None, :]
            S = np.where((i < ns)[None, :, None, None, None], Sd.astype(pool.dtype), S)
        pool[:, sl] = S

    def gdn_set(self, pool, slots, state, n) -> None:
        """Overwrite state (prefill's final state) for sequences with n[b] > 0.

        pool [L, num_slots, Hv, dk, dv]; slots [B]; state [L, B, Hv, dk, dv]; n [B]
        """
        sel = np.nonzero(_n(n, state.shape[1]) > 0)[0]
        if sel.size == 0:
            return
        sl = np.asarray(slots, dtype=np.int64).reshape(-1)[sel]
        pool[:, sl] = state[:, sel].astype(pool.dtype)

    # ---- short conv state -------------------------------------------------------------
    def conv_roll(self, pool, slots, cols, n) -> None:
        """Roll the causal-conv state by n committed columns.

        pool [L, num_slots, C, W-1]; slots [B]; cols [L, B, T, C] (pre-conv columns); n [B]
        new state = last W-1 columns of [state | cols_0 .. cols_{n-1}].
        """
        L, B, T, C = cols.shape
        W1 = pool.shape[3]
        n = _n(n, B, T)
        sel = np.nonzero(n > 0)[0]
        if sel.size == 0:
            return
        sl = np.asarray(slots, dtype=np.int64).reshape(-1)[sel]
        cat = np.concatenate(
            [pool[:, sl], np.swapaxes(cols[:, sel], 2, 3).astype(pool.dtype)], axis=3
        )  # [L, b, C, W-1+T]
        idx = n[sel][:, None] + np.arange(W1)[None, :]                     # [b, W-1]
        pool[:, sl] = np.take_along_axis(cat, idx[None, :, None, :], axis=3)
