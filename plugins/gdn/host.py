"""The numpy twins of the GDN commit writes: the kernel gdn_fold and the prefill's gdn_set (the host device's
methods; numpy only)."""
from __future__ import annotations

import numpy as np

from dflash_trt.plugins.host_util import commit_counts


def gdn_fold(pool, slots, k_hat, v, g, beta, n) -> None:
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
    n = commit_counts(n, B, T)
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


def gdn_set(pool, slots, state, n) -> None:
    """Overwrite state (prefill's final state) for sequences with n[b] > 0.

    pool [L, num_slots, Hv, dk, dv]; slots [B]; state [L, B, Hv, dk, dv]; n [B]
    """
    sel = np.nonzero(commit_counts(n, state.shape[1]) > 0)[0]
    if sel.size == 0:
        return
    sl = np.asarray(slots, dtype=np.int64).reshape(-1)[sel]
    pool[:, sl] = state[:, sel].astype(pool.dtype)
