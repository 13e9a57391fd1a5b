"""Fast CPU tests: pools, HostDevice commit kernels vs naive loops, CtxWindow bookkeeping."""

import numpy as np
import pytest

from dflash_trt.abi import MAX_K, PoolSizes, ctx_block_table_width
from dflash_trt.runtime.ctx import CtxWindow
from dflash_trt.runtime.devices.host import HostDevice
from dflash_trt.runtime.pools import BlockAllocator, PoolExhausted, SlotPool


# ---------------------------------------------------------------- pools
def test_allocator_all_or_nothing():
    a = BlockAllocator(10, name="test pages")
    got = a.alloc(7)
    assert len(set(got)) == 7 and a.num_free == 3
    before = list(a._free)
    with pytest.raises(PoolExhausted) as ei:
        a.alloc(4)
    msg = str(ei.value)
    assert "test pages" in msg and "4" in msg and "3" in msg
    assert ei.value.requested == 4 and ei.value.free == 3
    assert list(a._free) == before and a.num_free == 3
    a.free(got)
    assert a.num_free == a.num_total == 10
    assert a.alloc(0) == []


def test_allocator_refcounts_and_double_free():
    a = BlockAllocator(4)
    b = a.alloc(2)
    a.incref([b[0]])
    a.free(b)
    assert a.num_free == 3  # b[0] still referenced
    a.free([b[0]])
    assert a.num_free == 4
    with pytest.raises(ValueError):
        a.free([b[0]])
    c = a.alloc(1)
    with pytest.raises(ValueError):
        a.free([c[0], c[0]])  # more frees than refs: rejected, nothing changed
    assert a.refcount(c[0]) == 1 and a.num_free == 3
    with pytest.raises(ValueError):
        a.incref([b[1]] if b[1] != c[0] else [b[0]])
    a.free(c)
    assert a.num_free == 4


def test_slot_pool():
    p = SlotPool(2, "gdn slots")
    s0, s1 = p.alloc(), p.alloc()
    assert {s0, s1} == {0, 1} and p.num_free == 0
    with pytest.raises(PoolExhausted, match="gdn slots"):
        p.alloc()
    p.free(s0)
    with pytest.raises(ValueError):
        p.free(s0)
    assert p.num_free == 1


# ---------------------------------------------------------------- kernels
D = HostDevice()


def test_kv_write_random_pages():
    rng = np.random.default_rng(0)
    L, nb, bs, H, hd, B, T, mb = 2, 40, 4, 2, 3, 3, 6, 5
    pool = rng.standard_normal((L, 2, nb, bs, H, hd)).astype(np.float32)
    ref = pool.copy()
    perm = rng.permutation(nb)[: B * mb].reshape(B, mb)
    start = np.array([0, 5, 13])
    n = np.array([6, 0, 3])
    rows = rng.standard_normal((L, 2, B, T, H, hd)).astype(np.float32)
    D.kv_write(pool, rows, perm, start, n)
    for b in range(B):
        for i in range(n[b]):
            r = start[b] + i
            ref[:, :, perm[b, r // bs], r % bs] = rows[:, :, b, i]
    np.testing.assert_array_equal(pool, ref)
    got = D.gather_rows(pool, perm[2], start[2], n[2])
    np.testing.assert_array_equal(got, rows[:, :, 2, : n[2]])


def test_gdn_fold_vs_token_loop():
    """HostDevice.gdn_fold == the gated delta rule written out per (layer, sequence, row, head) in float64."""
    rng = np.random.default_rng(1)
    L, S, B, T, Hk, Hv, dk, dv = 2, 5, 3, 5, 2, 4, 3, 4
    pool = rng.standard_normal((L, S, Hv, dk, dv)).astype(np.float32)
    ref = pool.astype(np.float64)
    slots = np.array([3, 0, 4])
    n = np.array([5, 0, 2])
    k = rng.standard_normal((L, B, T, Hk, dk)).astype(np.float32)
    v = rng.standard_normal((L, B, T, Hv, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, (L, B, T, Hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (L, B, T, Hv)).astype(np.float32)
    untouched = pool[:, [0, 1, 2]].copy()  # slot 0 is b=1 (n=0); 1, 2 unused
    D.gdn_fold(pool, slots, k, v, g, beta, n)
    rep = Hv // Hk
    for l in range(L):
        for b in range(B):
            for i in range(n[b]):
                for h in range(Hv):
                    Sm = np.exp(g[l, b, i, h]) * ref[l, slots[b], h]
                    kk = k[l, b, i, h // rep].astype(np.float64)
                    u = beta[l, b, i, h] * (v[l, b, i, h] - Sm.T @ kk)
                    ref[l, slots[b], h] = Sm + np.outer(kk, u)
    np.testing.assert_allclose(pool, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pool[:, [0, 1, 2]], untouched)
    # n = 0 for every sequence: nothing changes, even with garbage fold data
    before = pool.copy()
    D.gdn_fold(pool, slots, k, v, np.full_like(g, np.nan), beta, np.zeros(B, int))
    np.testing.assert_array_equal(pool, before)


def test_gdn_fold_ignores_rows_past_n():
    rng = np.random.default_rng(2)
    L, S, B, T, H, dk, dv = 1, 2, 2, 4, 2, 2, 2
    pool = rng.standard_normal((L, S, H, dk, dv)).astype(np.float32)
    k = rng.standard_normal((L, B, T, H, dk)).astype(np.float32)
    v = rng.standard_normal((L, B, T, H, dv)).astype(np.float32)
    g = -rng.uniform(0, 1, (L, B, T, H)).astype(np.float32)
    beta = rng.uniform(0, 1, (L, B, T, H)).astype(np.float32)
    p1, p2 = pool.copy(), pool.copy()
    D.gdn_fold(p1, [0, 1], k, v, g, beta, np.array([2, 1]))
    k2, v2, g2, b2 = k.copy(), v.copy(), g.copy(), beta.copy()
    k2[:, 0, 2:] = 1e30; v2[:, 0, 2:] = np.nan; g2[:, 0, 2:] = -1e30; b2[:, 0, 2:] = np.nan
    k2[:, 1, 1:] = 1e30; v2[:, 1, 1:] = np.nan; g2[:, 1, 1:] = 1e30; b2[:, 1, 1:] = 1e30
    with np.errstate(all="ignore"):
        D.gdn_fold(p2, [0, 1], k2, v2, g2, b2, np.array([2, 1]))
    np.testing.assert_array_equal(p1, p2)


def test_gdn_fold_of_n_rows_is_n_one_row_folds():
    """HostDevice: n rows at once leave exactly the state of n one-row folds (each row rounds to fp32)."""
    rng = np.random.default_rng(4)
    L, B, T, H, dk, dv = 2, 3, 6, 2, 4, 3
    pool = rng.standard_normal((L, B, H, dk, dv)).astype(np.float32)
    k = rng.standard_normal((L, B, T, H, dk)).astype(np.float32)
    v = rng.standard_normal((L, B, T, H, dv)).astype(np.float32)
    g = -rng.uniform(0, 1, (L, B, T, H)).astype(np.float32)
    beta = rng.uniform(0, 1, (L, B, T, H)).astype(np.float32)
    n = np.array([6, 3, 1])
    at_once, steps = pool.copy(), pool.copy()
    D.gdn_fold(at_once, [0, 1, 2], k, v, g, beta, n)
    for i in range(T):
        sl = slice(i, i + 1)
        D.gdn_fold(steps, [0, 1, 2], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], (i < n).astype(int))
    np.testing.assert_array_equal(at_once, steps)


def test_gdn_set():
    rng = np.random.default_rng(3)
    pool = np.zeros((2, 4, 2, 3, 3), np.float32)
    st = rng.standard_normal((2, 3, 2, 3, 3)).astype(np.float32)
    D.gdn_set(pool, [2, 0, 1], st, np.array([1, 0, 7]))
    np.testing.assert_array_equal(pool[:, 2], st[:, 0])
    np.testing.assert_array_equal(pool[:, 1], st[:, 2])
    assert not pool[:, 0].any() and not pool[:, 3].any()


def test_conv_roll_vs_naive():
    rng = np.random.default_rng(4)
    L, S, C, W, B, T = 2, 6, 5, 4, 4, 7
    pool = rng.standard_normal((L, S, C, W - 1)).astype(np.float32)
    ref = pool.copy()
    slots = np.array([5, 1, 2, 0])
    n = np.array([1, 0, 7, 2])
    cols = rng.standard_normal((L, B, T, C)).astype(np.float32)
    D.conv_roll(pool, slots, cols, n)
    for b in range(B):
        st = ref[:, slots[b]].copy()
        for i in range(n[b]):
            st = np.concatenate([st[..., 1:], cols[:, b, i][..., None]], axis=-1)
        ref[:, slots[b]] = st
    np.testing.assert_array_equal(pool, ref)


# ---------------------------------------------------------------- ctx window
@pytest.mark.parametrize("window", [8, 20, 33])
@pytest.mark.parametrize("block_size", [4, 16])
def test_ctx_window_random(window, block_size):
    rng = np.random.default_rng(window * 100 + block_size)
    Ld, H, hd, nb = 2, 1, 2, 64
    alloc = BlockAllocator(nb, name="drafter kv pages")
    pool = np.full((Ld, 2, nb, block_size, H, hd), np.nan, np.float32)
    cw = CtxWindow(window, block_size, alloc, max_append=17)
    seq = 0
    for step in range(120):
        n = int(rng.integers(1, 18))
        bt, start = cw.plan_append(n)
        assert bt.shape == (cw.max_blocks,)
        pos = np.arange(seq, seq + n)
        # row content encodes its absolute position (distinct rows)
        rows = np.broadcast_to(
            pos[None, None, :, None, None].astype(np.float32)
            + np.arange(Ld)[:, None, None, None, None] * 1e4
            + np.arange(2)[None, :, None, None, None] * 1e5,
            (Ld, 2, n, H, hd),
        )[:, :, None]
        D.kv_write(pool, rows, bt[None], np.array([start]), np.array([n]))
        cw.finish_append(n, pos)
        seq += n
        vbt, kv_start, kv_len = cw.visible()
        vis = cw.positions_visible()
        assert len(vis) == min(seq, window) == kv_len - kv_start
        assert vis[-1] == seq - 1 and np.all(np.diff(vis) == 1)
        assert cw.num_pages <= cw.max_blocks
        assert cw.num_pages == alloc.num_total - alloc.num_free
        got = D.gather_rows(pool, vbt, kv_start, kv_len - kv_start)
        want = (vis[None, None, :, None, None].astype(np.float32)
                + np.arange(Ld)[:, None, None, None, None] * 1e4
                + np.arange(2)[None, :, None, None, None] * 1e5)
        np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
    cw.release()
    cw.release()
    assert alloc.num_free == nb


def test_full_context_window_table_holds_one_sequence():
    """A window of max_seq_len rows never slides: its table is one sequence's pages plus an append, not two
    windows', and a sequence of max_seq_len rows with an append reserved ahead still fits in it."""
    ps, append, max_len = 4, 16, 64
    alloc = BlockAllocator(64, name="drafter kv pages")
    cw = CtxWindow(max_len, ps, alloc, max_append=append, max_seq_len=max_len)
    assert cw.max_blocks == (max_len + append) // ps < ctx_block_table_width(max_len, ps, append)
    for first in range(0, max_len, append):
        cw.plan_append(append)
        cw.finish_append(append, range(first, first + append))
        cw.reserve(append)  # the rows of the step in flight
    assert cw.base == 0 and cw.num_pages == cw.max_blocks
    assert PoolSizes(max_seq_len=4096, max_seqs=8).max_ctx_blocks == -(-(4096 + 64 + MAX_K) // 16)


def test_ctx_window_exhaustion_and_contiguity():
    alloc = BlockAllocator(2, name="drafter kv pages")
    cw = CtxWindow(8, 4, alloc)
    cw.plan_append(8)
    cw.finish_append(8, np.arange(8))
    with pytest.raises(PoolExhausted, match="drafter kv pages"):
        cw.plan_append(1)
    assert cw.num_pages == 2 and cw.end == 8 and alloc.num_free == 0
    cw.release()
    assert alloc.num_free == 2
    cw.plan_append(2)
    with pytest.raises(ValueError):
        cw.finish_append(2, [0, 2])
    with pytest.raises(ValueError):
        cw.plan_append(9)  # > max_append (default window)


def test_ctx_finish_append_range_is_checked_like_an_array():
    """The commit path hands positions as a range (no numpy per step): the same checks as an array."""
    cw = CtxWindow(8, 4, BlockAllocator(4))
    cw.plan_append(3)
    cw.finish_append(3, range(0, 3))
    cw.plan_append(3)
    with pytest.raises(ValueError, match="contiguous: last 2, got \\[4, 5, 6\\]"):
        cw.finish_append(3, range(4, 7))  # a gap
    with pytest.raises(ValueError, match="3 rows but 2 positions"):
        cw.finish_append(3, range(3, 5))
    with pytest.raises(ValueError, match="contiguous"):
        cw.finish_append(3, range(3, 9, 2))  # a step of 2 takes the array path's checks
    assert cw.end == 3 and cw.total == 3  # a refused append changes nothing
    cw.finish_append(3, range(3, 6))
    assert cw.positions_visible().tolist() == list(range(6)) and cw.end == 6


def test_torch_gdn_set_padding_rows_never_overwrite_a_live_slot():
    """A batched prefill's padding rows (n = 0) name slot 0, which a live row of the same launch may hold: the
    sync-free torch write must leave that row's new state there whatever order the writes land in."""
    import torch

    from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice

    rng = np.random.default_rng(4)
    st = rng.standard_normal((2, 4, 2, 3, 3)).astype(np.float32)
    for slots, n in (([0, 1, 0, 0], [5, 3, 0, 0]), ([1, 0, 0, 0], [0, 2, 0, 0]), ([3, 0, 0, 0], [1, 0, 0, 0])):
        pool = torch.from_numpy(rng.standard_normal((2, 4, 2, 3, 3)).astype(np.float32))
        want = pool.clone().numpy()
        D.gdn_set(want, slots, st, np.array(n))  # the host device: only rows with n > 0 write
        TorchCpuDevice().gdn_set(pool, torch.tensor(slots), torch.from_numpy(st), torch.tensor(n))
        np.testing.assert_array_equal(pool.numpy(), want)
