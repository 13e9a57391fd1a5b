"""GPU: every plugin kernel vs the float64 reference (export/*_ref.py), and GDN vs fla-core.
Max errors (relative to the reference's max |value|) are printed at the end of the module."""
import json
import os

import pytest
import torch

from dflash_trt.export import attention_ref, gdn_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
ERRS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)
    yield
    print("\nKERNEL MAX ERRORS (max|got-ref| / max|ref|):")
    for k in sorted(ERRS):
        print(f"  {k:40s} {ERRS[k]:.3e}")
    path = os.environ.get("DFLASH_KERNEL_ERRS")
    if path:
        with open(path, "w") as f:
            json.dump(ERRS, f, indent=1, sort_keys=True)


def _err(name, got, ref, tol):
    ref = ref.double()
    e = ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item() if ref.numel() else 0.0
    ERRS[name] = max(ERRS.get(name, 0.0), e)
    assert e <= tol, f"{name}: rel err {e:.3e} > {tol}"


def _gdn_inputs(B, T, Hk, Hv, dk, dv, dtype, seed, slots=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    g, beta = gdn_ref.gdn_gates(r(B, T, Hv), r(B, T, Hv), r(Hv) * 0.5, r(Hv))
    S = slots or B
    t = lambda x: x.to(DEV)
    return (t(r(B, T, Hk, dk).to(dtype)), t(r(B, T, Hk, dk).to(dtype)), t(r(B, T, Hv, dv).to(dtype)), t(g), t(beta),
            t(r(S, Hv, dk, dv) * 0.3))


def _d(*ts):
    return [x.double() for x in ts]


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("K", range(1, 17))
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gdn_verify_and_fold(B, K, ratio):
    dtype = torch.float32 if K in (1, 16) and B == 8 else torch.bfloat16
    Hk, dk, dv = 2, 128, 128
    Hv = Hk * ratio
    S = B + 3
    q, k, v, g, beta, pool = _gdn_inputs(B, K, Hk, Hv, dk, dv, dtype, seed=B * 100 + K * 3 + ratio, slots=S)
    slot = torch.randperm(S, device=DEV)[:B].int()
    o, kh, vn, gam, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, None, False)
    assert fs.numel() == 0 and o.dtype == dtype
    ref = gdn_ref.gdn_chunk_wy16(*_d(q, k, v, g, beta), pool[slot.long()].double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    tag = "bf16" if dtype == torch.bfloat16 else "fp32"
    _err(f"gdn_wy16 o ({tag})", o, ref.o, tol)
    _err("gdn_wy16 k_hat", kh, ref.k_hat, 1e-5)
    _err("gdn_wy16 v_new", vn, ref.v_new, 1e-4)
    _err("gdn_wy16 gamma", gam, ref.gamma, 1e-5)
    # commit: fold the first n rows (n = 0 allowed) into the pool slots in place
    n = torch.randint(0, K + 1, (B,), device=DEV, dtype=torch.int32)
    n[0] = 0 if B > 1 else n[0]
    pool2 = pool.clone()
    torch.ops.dflash.gdn_fold(pool2, slot, kh, vn, gam, n)
    want = gdn_ref.gdn_fold(pool[slot.long()].double(), ref.k_hat, ref.v_new, ref.gamma, n)
    _err("gdn_fold state", pool2[slot.long()], want, 1e-4)
    mask = torch.ones(S, dtype=torch.bool, device=DEV)
    mask[slot.long()] = False
    assert torch.equal(pool2[mask], pool[mask])
    if B > 1:
        assert torch.equal(pool2[slot[0].long()], pool[slot[0].long()])  # n = 0: untouched
    # the folded state equals running the recurrence over the accepted rows
    b = int(torch.argmax(n))
    nb = int(n[b])
    if nb:
        _, st = gdn_ref.gdn_recurrent(*_d(q[b:b + 1, :nb], k[b:b + 1, :nb], v[b:b + 1, :nb], g[b:b + 1, :nb],
                                         beta[b:b + 1, :nb]), pool[slot[b].long()][None].double())
        _err("gdn verify+fold vs recurrence", pool2[slot[b].long()], st[0], 1e-4)


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("T", [17, 64, 128, 200])
@pytest.mark.parametrize("B", [1, 8])
def test_gdn_prefill_final_state(B, T, ratio):
    Hk, dk, dv = 2, 128, 128
    q, k, v, g, beta, st = _gdn_inputs(B, T, Hk, Hk * ratio, dk, dv, torch.bfloat16, seed=T + B + ratio)
    o, kh, vn, gam, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st, None, None, True)
    ro, rs = gdn_ref.gdn_recurrent(*_d(q, k, v, g, beta, st))
    _err("gdn prefill o (bf16)", o, ro, 1e-2)
    _err("gdn prefill final state", fs, rs, 2e-4)
    # fold data stays valid past the first chunk: folding all T rows == final state
    st2 = st.clone()
    torch.ops.dflash.gdn_fold(st2, None, kh, vn, gam, torch.full((B,), T, device=DEV, dtype=torch.int32))
    _err("gdn fold over T>16 rows", st2, rs, 2e-4)


@pytest.mark.parametrize("cg", ["1", "2", "4"])
def test_gdn_column_groups_and_zero_slot(monkeypatch, cg):
    monkeypatch.setenv("DFLASH_GDN_CG", cg)
    dk = 64 if cg == "2" else 128
    q, k, v, g, beta, pool = _gdn_inputs(3, 9, 1, 2, dk, 128, torch.float32, seed=7, slots=4)
    slot = torch.tensor([2, -1, 0], device=DEV, dtype=torch.int32)
    o, kh, vn, gam, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, 0.2, True)
    st0 = pool[slot.long().clamp(min=0)].double()
    st0[1] = 0
    ref = gdn_ref.gdn_chunk_wy16(*_d(q, k, v, g, beta), st0, scale=0.2)
    _err(f"gdn_wy16 o (fp32, dk{dk} cg{cg})", o, ref.o, 1e-4)
    _err(f"gdn_wy16 final state (dk{dk} cg{cg})", fs, ref.state, 1e-4)
    pool2 = pool.clone()
    n = torch.tensor([9, 5, 0], device=DEV, dtype=torch.int32)
    torch.ops.dflash.gdn_fold(pool2, slot, kh, vn, gam, n)
    want = gdn_ref.gdn_fold(st0, ref.k_hat, ref.v_new, ref.gamma, n)
    _err(f"gdn_fold (dk{dk} cg{cg})", pool2[2], want[0], 1e-4)
    assert torch.equal(pool2[[1, 3]], pool[[1, 3]])


def _fla():
    try:
        import fla.ops.gated_delta_rule as m
        return m
    except Exception as e:  # pragma: no cover
        pytest.skip(f"fla not importable: {e}")


@pytest.mark.parametrize("K", [1, 16])
def test_gdn_vs_fla_qwen3_next(K):
    fla = _fla()
    B, Hk, Hv, dk, dv = 8, 16, 32, 128, 128
    q, k, v, g, beta, st = _gdn_inputs(B, K, Hk, Hv, dk, dv, torch.bfloat16, seed=K)
    o, kh, vn, gam, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st, None, None, True)
    fn = fla.fused_recurrent_gated_delta_rule if K == 1 else fla.chunk_gated_delta_rule
    fo, fst = fn(q, k, v, g=g, beta=beta, scale=dk ** -0.5, initial_state=st.clone(), output_final_state=True,
                 use_qk_l2norm_in_kernel=True)
    ro, rs = gdn_ref.gdn_recurrent(*_d(q, k, v, g, beta, st))
    _err(f"fla K={K} o vs ref", fo, ro, 1e-1)
    _err(f"fla K={K} state vs ref", fst, rs, 1e-1)
    _err(f"ours K={K} o vs ref (Qwen3-Next)", o, ro, 1e-2)
    _err(f"ours K={K} state vs ref (Qwen3-Next)", fs, rs, 1e-4)
    _err(f"ours K={K} o vs fla", o, fo, 1e-1)
    _err(f"ours K={K} state vs fla", fs, fst, 1e-1)


@pytest.mark.parametrize("T", [1, 4, 16, 128])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_conv_verify_and_roll(B, T):
    C, W = 320, 4
    gen = torch.Generator().manual_seed(B * 7 + T)
    x = torch.randn(B, T, C, generator=gen).bfloat16().to(DEV)
    pool = torch.randn(B + 2, C, W - 1, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(C, W, generator=gen) * 0.5).bfloat16().to(DEV)
    slot = torch.randperm(B + 2, device=DEV)[:B].int()
    y = torch.ops.dflash.conv_verify(x, pool, w, slot)
    _err("conv_verify (bf16)", y, gdn_ref.conv_verify(*_d(x, pool[slot.long()], w)), 1e-2)
    xs = x.float()
    ps = pool.float()
    y32 = torch.ops.dflash.conv_verify(xs, ps, w.float(), slot)
    _err("conv_verify (fp32)", y32, gdn_ref.conv_verify(*_d(xs, ps[slot.long()], w)), 1e-5)
    n = torch.randint(0, T + 1, (B,), device=DEV, dtype=torch.int32)
    p2 = pool.clone()
    torch.ops.dflash.conv_roll(p2, slot, x, n)
    want = gdn_ref.conv_roll(pool[slot.long()], x, n)
    assert torch.equal(p2[slot.long()], want)
    mask = torch.ones(B + 2, dtype=torch.bool, device=DEV)
    mask[slot.long()] = False
    assert torch.equal(p2[mask], pool[mask])


def _pages(B, T, Hkv, hd, L, BS, max_ctx, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    kv_len = torch.randint(0, max_ctx + 1, (B,), generator=gen)
    kv_start = (torch.rand(B, generator=gen) * kv_len * 0.3).long()
    max_blocks = (max_ctx + T + BS - 1) // BS
    NB = B * max_blocks + 5
    bt = torch.randperm(NB, generator=gen)[: B * max_blocks].view(B, max_blocks).int()
    pool = torch.randn(L, 2, NB, BS, Hkv, hd, generator=gen).to(dtype)
    return pool.to(DEV), bt.to(DEV), kv_start.to(DEV), kv_len.to(DEV)


@pytest.mark.parametrize("hd,G", [(64, 1), (128, 2), (256, 4)])
@pytest.mark.parametrize("T", [1, 5, 16, 128])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_paged_attention(B, T, hd, G):
    if B == 64 and T == 128 and hd == 256:
        pytest.skip("size")
    Hkv, L, BS = 2, 2, 16
    pool, bt, ks, kl = _pages(B, T, Hkv, hd, L, BS, max_ctx=300 if T < 128 else 200, seed=B + T + hd)
    gen = torch.Generator().manual_seed(hd * T + B)
    q = torch.randn(B, T, Hkv * G, hd, generator=gen).bfloat16().to(DEV)
    kn = torch.randn(B, T, Hkv, hd, generator=gen).bfloat16().to(DEV)
    vn = torch.randn(B, T, Hkv, hd, generator=gen).bfloat16().to(DEV)
    for causal in (True, False):
        o = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, hd ** -0.5)
        want = attention_ref.paged_attention_ref(*_d(q, kn, vn, pool), 1, bt, ks, kl, causal, hd ** -0.5)
        _err(f"paged_attention hd{hd} {'causal' if causal else 'block'}", o, want, 1.5e-2)


@pytest.mark.parametrize("B,T", [(1, 1), (8, 16), (64, 5)])
def test_kv_write(B, T):
    Hkv, hd, L, BS = 2, 128, 3, 16
    pool, bt, ks, kl = _pages(B, T, Hkv, hd, L, BS, max_ctx=100, seed=B * T)
    kn = torch.randn(B, T, Hkv, hd).bfloat16().to(DEV)
    vn = torch.randn(B, T, Hkv, hd).bfloat16().to(DEV)
    n = torch.randint(0, T + 1, (B,), dtype=torch.int32, device=DEV)
    got, want = pool.clone(), pool.clone().cpu()
    torch.ops.dflash.kv_write(got, 2, kn, vn, bt, kl, n)
    torch.ops.dflash.kv_write(want, 2, kn.cpu(), vn.cpu(), bt.cpu(), kl.cpu(), n.cpu())
    assert torch.equal(got.cpu(), want)


def test_bad_inputs_raise_before_launch():
    from dflash_trt.plugins.launch import KernelError
    q, k, v, g, beta, st = _gdn_inputs(1, 2, 1, 1, 96, 128, torch.bfloat16, seed=0)
    with pytest.raises(KernelError, match="dk=96"):
        torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st, None, None, False)
    q, k, v, g, beta, st = _gdn_inputs(1, 2, 1, 1, 128, 128, torch.bfloat16, seed=0)
    with pytest.raises(KernelError, match="state"):
        torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st.bfloat16(), None, None, False)


def test_cuda_graph_capture_matches_eager():
    B, K, Hk, Hv = 8, 16, 16, 32
    q, k, v, g, beta, pool = _gdn_inputs(B, K, Hk, Hv, 128, 128, torch.bfloat16, seed=3)
    n = torch.randint(0, K + 1, (B,), device=DEV, dtype=torch.int32)
    slot = torch.arange(B, device=DEV, dtype=torch.int32)
    eager = pool.clone()
    r = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, eager, slot, None, False)
    torch.ops.dflash.gdn_fold(eager, slot, r[1], r[2], r[3], n)
    work = pool.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (module load) outside capture
        torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool.clone(), slot, None, False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r2 = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, work, slot, None, False)
        torch.ops.dflash.gdn_fold(work, slot, r2[1], r2[2], r2[3], n)
    work.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work, eager)
    assert torch.equal(r2[0], r[0])
