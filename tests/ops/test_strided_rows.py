"""Kernels read their row inputs in place at a row stride (plugins/torch_util.rows): q|k|v slices of the conv
output into the GDN kernel, g|beta of one gates tensor, the projection's columns into the conv, k/v slices of the
qkv projection into paged attention. A strided call must equal the call on contiguous copies, bit for bit (the
contiguous path is the one tested against the fp64 references); CPU: which layouts `rows` reads in place."""
import pytest
import torch

from dflash_trt.plugins import torch_util as U

from op_helpers import gdn_inputs

DEV = "cuda"


def _wide(parts, extra=8, seed=0):
    """Each [B,T,...] part as a slice of one [B,T,sum+extra] tensor (the row layout of a fused projection)."""
    B, T = parts[0].shape[:2]
    widths = [p[0, 0].numel() for p in parts]
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(B, T, sum(widths) + extra, generator=gen).to(parts[0].dtype).to(parts[0].device)
    views, off = [], 0
    for p, w in zip(parts, widths):
        buf[..., off:off + w] = p.reshape(B, T, w)
        views.append(buf[..., off:off + w].view(p.shape))
        off += w
    return views


@pytest.mark.parametrize("shape,sl,inplace", [
    ((2, 3, 64), (slice(None), slice(None), slice(0, 32)), True),
    ((1, 5, 64), (slice(None), slice(None), slice(8, 40)), True),
    ((2, 3, 64), (slice(None), slice(None), slice(1, 33)), False),   # 2-byte offset: not 16-byte aligned
    ((3, 4, 8), (slice(None), slice(0, 2), slice(None)), False),  # rows not evenly spaced across b
    ((3, 4, 8), (slice(None), slice(0, 4, 2), slice(None)), True),  # every other row: evenly spaced
    ((2, 3, 64), (slice(None), slice(None), slice(0, 64, 2)), False),  # a row's elements not packed
])
def test_rows_reads_in_place_only_what_fits(shape, sl, inplace):
    t = torch.zeros(shape, dtype=torch.bfloat16)[sl]
    r, rs = U.rows(t)
    assert (r.data_ptr() == t.data_ptr()) == inplace
    assert torch.equal(r, t)
    if inplace:
        assert rs == t.stride(1)
    else:
        assert r.is_contiguous() and rs == t[0, 0].numel()


def test_rows_of_a_contiguous_tensor_is_itself():
    t = torch.zeros(2, 3, 4, 16)
    r, rs = U.rows(t)
    assert r is t and rs == 64


@pytest.fixture()
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("dk", [64, 128])
def test_gdn_reads_strided_rows(_cuda, T, dk):
    B, Hk, Hv = 3, 2, 4
    q, k, v, g, beta, pool = gdn_inputs(B, T, Hk, Hv, dk, dk, torch.bfloat16, seed=T + dk, slots=B + 2, device=DEV)
    slot = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    qs, ks, vs = _wide([q, k, v])
    gs, bs = _wide([g, beta], extra=0)
    assert not qs.is_contiguous() and not gs.is_contiguous()
    want = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, None, False)
    got = torch.ops.dflash.gdn_wy16(qs, ks, vs, gs, bs, pool, slot, None, False)
    for name, a, b in zip(("o", "k_hat", "v_f32", "g_f32", "beta_f32"), got[:5], want[:5]):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_conv_reads_strided_rows(_cuda, T):
    B, C, W = 2, 96, 4
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, C, generator=gen).bfloat16().to(DEV)
    pool = torch.randn(B + 1, C, W - 1, generator=gen).bfloat16().to(DEV)
    w = torch.randn(C, W, generator=gen).bfloat16().to(DEV)
    slot = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    (xs,) = _wide([x], extra=40)
    assert not xs.is_contiguous() or T == 1
    assert torch.equal(torch.ops.dflash.conv_verify(xs, pool, w, slot), torch.ops.dflash.conv_verify(x, pool, w, slot))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_paged_attention_reads_strided_rows(_cuda, T):
    B, Hq, Hkv, hd, BS, NB = 2, 4, 2, 64, 16, 12
    gen = torch.Generator().manual_seed(T)
    r = lambda *s: torch.randn(*s, generator=gen).bfloat16().to(DEV)  # noqa: E731
    q, kn, vn = r(B, T, Hq, hd), r(B, T, Hkv, hd), r(B, T, Hkv, hd)
    pool = r(2, 2, NB, BS, Hkv, hd)
    bt = torch.arange(B * 4, dtype=torch.int32, device=DEV).view(B, 4)
    ks = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    kl = torch.tensor([20, 37], dtype=torch.int32, device=DEV)
    _, kns, vns = _wide([q, kn, vn])  # the qkv projection's row: [q | k | v | pad]
    for causal in (True, False):
        want = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, hd ** -0.5)
        got = torch.ops.dflash.paged_attention(q, kns, vns, pool, 1, bt, ks, kl, causal, hd ** -0.5)
        assert torch.equal(got, want)
