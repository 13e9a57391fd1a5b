"""The numpy twin of the commit kernel kv_write (the host device's method; numpy only)."""
from __future__ import annotations

import numpy as np

from dflash_trt.plugins.host_util import commit_counts


def kv_write(pool, rows, block_table, start_row, n) -> None:
    """Scatter new K/V rows into pages.

    pool        [L, 2, num_blocks, block_size, H, hd]
    rows        [L, 2, B, T, H, hd]
    block_table [B, max_blocks] int
    start_row   [B] int   logical row of rows[:, :, b, 0] in sequence b's page list
    n           [B] int   rows to write (row i < n[b])
    Row i of sequence b -> page block_table[b, (start_row[b]+i)//bs], offset (..)%bs.
    """
    B, T = rows.shape[2], rows.shape[3]
    n = commit_counts(n, B, T)
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
