"""The numpy twin of the commit kernel conv_roll (the host device's method; numpy only)."""
from __future__ import annotations

import numpy as np

from dflash_trt.plugins.host_util import commit_counts


def conv_roll(pool, slots, cols, n) -> None:
    """Roll the causal-conv state by n committed columns.

    pool [L, num_slots, C, W-1]; slots [B]; cols [L, B, T, C] (pre-conv columns); n [B]
    new state = last W-1 columns of [state | cols_0 .. cols_{n-1}].
    """
    L, B, T, C = cols.shape
    W1 = pool.shape[3]
    n = commit_counts(n, B, T)
    sel = np.nonzero(n > 0)[0]
    if sel.size == 0:
        return
    sl = np.asarray(slots, dtype=np.int64).reshape(-1)[sel]
    cat = np.concatenate(
        [pool[:, sl], np.swapaxes(cols[:, sel], 2, 3).astype(pool.dtype)], axis=3
    )  # [L, b, C, W-1+T]
    idx = n[sel][:, None] + np.arange(W1)[None, :]                     # [b, W-1]
    pool[:, sl] = np.take_along_axis(cat, idx[None, :, None, :], axis=3)
