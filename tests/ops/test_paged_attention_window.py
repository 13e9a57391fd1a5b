"""PagedAttention's `window` attribute (sliding attention): the reference against a dense mask written
from positions (query at p sees key at k iff p - k < W); window 0 bit-identical to no window; the ONNX body in
ORT == the reference; on a GPU the kernel == the float64 reference for window x causal cases."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_trt.plugins.paged_attention.reference import paged_attention_ref

from op_helpers import close, record_err, run_op

DEV = "cuda"


def _case(B, T, Hq, Hkv, hd, L, NB, BS, MB, ks, kl, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    bt = torch.stack([torch.randperm(NB, generator=gen)[:MB] for _ in range(B)]).int()
    return (r(B, T, Hq, hd), r(B, T, Hkv, hd), r(B, T, Hkv, hd), r(L, 2, NB, BS, Hkv, hd), bt,
            torch.tensor(ks), torch.tensor(kl))


def _dense_by_positions(q, kn, vn, pool, layer, bt, ks, kl, causal, scale, window):
    """Keys at absolute positions: cached row j of [ks, kl) at position base + j - ks with the new rows right
    after (base arbitrary: only differences matter), the mask written from positions, SDPA."""
    B, T, Hq, hd = q.shape
    BS, r = pool.shape[3], Hq // kn.shape[2]
    outs = []
    for b in range(B):
        rows = torch.arange(int(ks[b]), int(kl[b]))
        pg, off = bt[b].long()[rows // BS], rows % BS
        K = torch.cat([pool[layer, 0, pg, off], kn[b]]).repeat_interleave(r, 1).transpose(0, 1)
        V = torch.cat([pool[layer, 1, pg, off], vn[b]]).repeat_interleave(r, 1).transpose(0, 1)
        Lc = len(rows)
        kpos = 1000 + torch.arange(Lc + T)
        qpos = 1000 + Lc + torch.arange(T)
        mask = torch.ones(T, Lc + T, dtype=torch.bool)
        if causal:
            mask &= kpos[None] <= qpos[:, None]
        if window:
            mask &= qpos[:, None] - kpos[None] < window
        o = F.scaled_dot_product_attention(q[b].transpose(0, 1), K, V, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


CASES = [  # (T, kv_start, kv_len, window)
    (1, [0, 3], [0, 20], 4), (5, [0, 2], [9, 30], 1), (16, [1, 0], [40, 7], 8), (16, [0, 5], [33, 60], 20),
    (3, [0, 0], [2, 3], 100),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_window_reference_vs_positions(case, causal):
    T, ks, kl, W = CASES[case]
    ins = _case(2, T, 4, 2, 8, 2, 40, 4, 16, ks, kl, seed=case)
    got = paged_attention_ref(*ins[:4], 1, *ins[4:], causal, 0.3, W)
    want = _dense_by_positions(*ins[:4], 1, *ins[4:], causal, 0.3, W)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_window_zero_is_no_window(causal):
    ins = _case(2, 7, 4, 2, 8, 2, 40, 4, 16, [0, 3], [20, 31], seed=5, dtype=torch.float32)
    a = paged_attention_ref(*ins[:4], 1, *ins[4:], causal, 0.3)
    b = paged_attention_ref(*ins[:4], 1, *ins[4:], causal, 0.3, 0)
    assert torch.equal(a, b)
    # a window wider than everything attended changes nothing either
    c = paged_attention_ref(*ins[:4], 1, *ins[4:], causal, 0.3, 10_000)
    assert torch.equal(a, c)


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_onnx_body_window(case, causal):
    pytest.importorskip("onnxruntime")
    T, ks, kl, W = CASES[case]
    q, kn, vn, pool, bt, ks_t, kl_t = _case(2, T, 4, 2, 16, 2, 40, 4, 16, ks, kl, seed=case, dtype=torch.float32)
    feeds = dict(q=q.numpy(), k_new=kn.numpy(), v_new=vn.numpy(), kv_pool=pool.numpy(),
                 block_table=bt.numpy().astype(np.int64), kv_start=ks_t.numpy(), kv_len=kl_t.numpy())
    got = run_op("PagedAttention", feeds, {"layer": 1, "causal": causal, "scale": 0.3, "window": W})["o"]
    close(got, paged_attention_ref(q, kn, vn, pool, 1, bt, ks_t, kl_t, bool(causal), 0.3, W))


@pytest.fixture
def _ops():
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)


def test_cpu_op_window(_ops):
    ins = _case(2, 5, 4, 2, 16, 2, 40, 4, 16, [0, 3], [20, 31], seed=9, dtype=torch.float32)
    o = torch.ops.dflash.paged_attention(*ins[:4], 1, *ins[4:], True, 0.25, 6)
    assert torch.equal(o, paged_attention_ref(*ins[:4], 1, *ins[4:], True, 0.25, 6))


@pytest.mark.gpu
@pytest.mark.parametrize("hd,G", [(64, 1), (128, 2), (128, 4), (256, 1)])
@pytest.mark.parametrize("T,window", [(1, 1), (1, 37), (5, 3), (16, 8), (16, 16), (16, 33), (16, 2048), (128, 50)])
def test_paged_attention_kernel_window(_ops, hd, G, T, window):
    """The CUDA kernel with a window == the float64 reference (sliding drafter layers: T = block, causal or not;
    windows shorter than a key tile, across tile edges, wider than the context)."""
    B, Hkv, L, BS, MB = 4, 2, 2, 16, 24
    gen = torch.Generator().manual_seed(hd * 1000 + T * 10 + window)
    kl = torch.randint(0, 250, (B,), generator=gen)
    ks = (torch.rand(B, generator=gen) * kl * 0.3).long()
    ins = _case(B, T, Hkv * G, Hkv, hd, L, B * MB + 3, BS, MB, ks.tolist(), kl.tolist(), seed=window,
                dtype=torch.float32)
    q, kn, vn, pool = (x.bfloat16().to(DEV) for x in ins[:4])
    bt, ks, kl = (x.to(DEV) for x in ins[4:])
    for causal in (True, False):
        o = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, hd ** -0.5, window)
        want = paged_attention_ref(q.double(), kn.double(), vn.double(), pool.double(), 1, bt, ks, kl, causal,
                                   hd ** -0.5, window)
        record_err(f"paged_attention hd{hd} W{window} {'causal' if causal else 'block'}", o, want, 1.5e-2)


@pytest.mark.gpu
def test_paged_attention_kernel_window_zero_bit_identical(_ops):
    """window=0 runs exactly the pre-window kernel path: same bits as a window wider than every context."""
    B, T, Hkv, hd, L, BS, MB = 4, 16, 2, 128, 2, 16, 24
    ins = _case(B, T, 2 * Hkv, Hkv, hd, L, B * MB + 3, BS, MB, [0, 3, 10, 0], [200, 31, 90, 0], seed=1,
                dtype=torch.float32)
    q, kn, vn, pool = (x.bfloat16().to(DEV) for x in ins[:4])
    bt, ks, kl = (x.to(DEV) for x in ins[4:])
    for causal in (True, False):
        a = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, 0.1)
        b = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, 0.1, 0)
        c = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, 0.1, 1 << 20)
        assert torch.equal(a, b) and torch.equal(a, c)
