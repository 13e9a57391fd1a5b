"""GdnChunkWY16 + gdn_fold (plugins/gdn/) on CPU: the reference math against independent, more naive
formulations (token recurrence, per-prefix recurrence); the ONNX body in ORT == the reference (fp32 <= 1e-4);
the CPU torch ops == the reference; the launchers reject bad input before touching a GPU; the layer-batched
gdn_fold torch op == HostDevice (the runtime's numpy commit). GPU kernels: test_gdn_gpu.py."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_trt.plugins.gdn import launch, spec
from dflash_trt.plugins.gdn.reference import (
    expand_heads,
    gdn_chunk_wy16,
    gdn_fold,
    gdn_gates,
    gdn_recurrent,
    l2norm,
)
from dflash_trt.plugins.opspec import KernelError, ShapeError
from dflash_trt.runtime.devices.host import HostDevice

from op_helpers import close, fold_case, gdn_inputs, rel, run_op


def make_gdn(B, T, Hk, r, dk, dv, dtype, seed=0):
    """Random GDN inputs with realistic gates (g from gdn_gates) and a nonzero initial state."""
    gen = torch.Generator().manual_seed(seed)
    Hv = Hk * r
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rn(B, T, Hk, dk), rn(B, T, Hk, dk), rn(B, T, Hv, dv)
    a, b = rn(B, T, Hv), rn(B, T, Hv)
    A_log = torch.log(torch.rand(Hv, generator=gen, dtype=torch.float64) * 15 + 1)  # A in [1,16]
    dt_bias = rn(Hv)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    S0 = rn(B, Hv, dk, dv) * 0.5
    return [x.to(dtype) for x in (q, k, v, g, beta, S0)]


# ----------------------------------------------------------------------------------- reference
def test_l2norm_and_gates():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    y = l2norm(x)
    ref = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.allclose(y, ref, rtol=1e-12, atol=0)
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    g, beta = gdn_gates(a.half(), b.half(), torch.zeros(4), torch.zeros(4))
    assert g.dtype == torch.float32 and beta.dtype == torch.float32
    assert (g <= 0).all()
    g64, _ = gdn_gates(a.double(), b.double(), torch.zeros(4).double(), torch.zeros(4).double())
    assert g64.dtype == torch.float64
    assert torch.allclose(g64, -F.softplus(a.double()))


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("T", list(range(1, 17)) + [17, 40])
def test_chunk_matches_recurrence(T, r):
    B, Hk, dk, dv = 2, 2, 8, 12
    for dtype, tol in ((torch.float64, 1e-11), (torch.float32, 1e-5)):
        q, k, v, g, beta, S0 = make_gdn(B, T, Hk, r, dk, dv, dtype, seed=T * 10 + r)
        S0_copy = S0.clone()
        o_ref, S_ref = gdn_recurrent(q, k, v, g, beta, S0)
        out = gdn_chunk_wy16(q, k, v, g, beta, S0)
        assert torch.equal(S0, S0_copy), "initial state must be read-only"
        assert out.o.shape == (B, T, Hk * r, dv) and out.state.shape == (B, Hk * r, dk, dv)
        assert out.k_hat.shape == (B, T, Hk, dk) and out.g.shape == out.beta.shape == (B, T, Hk * r)
        assert rel(out.o, o_ref) <= tol, (dtype, rel(out.o, o_ref))
        assert rel(out.state, S_ref) <= tol, (dtype, rel(out.state, S_ref))
        # the fold data are the row inputs as the recurrence reads them
        for got, want in ((out.k_hat, l2norm(k)), (out.v, v), (out.g, g), (out.beta, beta)):
            assert torch.equal(got, want)


def test_chunk_smaller_chunks_and_scale():
    q, k, v, g, beta, S0 = make_gdn(1, 23, 1, 2, 4, 6, torch.float64, seed=7)
    o_ref, S_ref = gdn_recurrent(q, k, v, g, beta, S0, scale=0.3)
    for chunk in (1, 3, 8, 16):
        out = gdn_chunk_wy16(q, k, v, g, beta, S0, scale=0.3, chunk=chunk)
        assert rel(out.o, o_ref) < 1e-11 and rel(out.state, S_ref) < 1e-11


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 5, 8, 15, 16, 40])
def test_fold_matches_prefix_recurrence(T, r):
    B, Hk, dk, dv = 3, 2, 8, 6
    q, k, v, g, beta, S0 = make_gdn(B, T, Hk, r, dk, dv, torch.float64, seed=100 + T + r)
    out = gdn_chunk_wy16(q, k, v, g, beta, S0)
    # Recurrence state after each prefix length m (m = 0 -> S0).
    prefix = [S0] + [gdn_recurrent(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], S0)[1]
                     for m in range(1, T + 1)]
    for n0 in range(T + 1):
        n = torch.tensor([(n0 + 3 * b) % (T + 1) for b in range(B)])  # different n per sequence
        S0_copy = S0.clone()
        Sn = gdn_fold(S0, *out[2:], n)
        assert torch.equal(S0, S0_copy)
        ref = torch.stack([prefix[int(n[b])][b] for b in range(B)])
        assert rel(Sn, ref) < 1e-11, (n, rel(Sn, ref))
    # n = 0 everywhere: unchanged state.
    Sz = gdn_fold(S0, *out[2:], torch.zeros(B, dtype=torch.int32))
    assert torch.allclose(Sz, S0, rtol=0, atol=0)


def test_fold_float32():
    B, T = 2, 16
    q, k, v, g, beta, S0 = make_gdn(B, T, 1, 2, 8, 8, torch.float32, seed=5)
    out = gdn_chunk_wy16(q, k, v, g, beta, S0)
    for m in (0, 1, 9, 16):
        Sn = gdn_fold(S0, *out[2:], torch.full((B,), m))
        ref = S0 if m == 0 else gdn_recurrent(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], S0)[1]
        assert rel(Sn, ref) <= 1e-5


@pytest.mark.parametrize("T", [3, 16])
def test_fold_of_n_rows_is_n_one_row_folds_bit_for_bit(T):
    """The commit's contract (what keeps the bf16 KL between verify and decode small): a speculative step that
    accepts n rows leaves exactly the fp32 state n plain decode steps would -- fold(n rows) == n folds of one row,
    bit for bit -- while the multi-row closed form S_n = e^(γ_n) S0 + Σ e^(γ_n-γ_i) k̂_i v'_i^T (what the fold
    computed before) does not."""
    B = 4
    q, k, v, g, beta, S0 = make_gdn(B, T, 2, 2, 16, 8, torch.float32, seed=40 + T)
    out = gdn_chunk_wy16(q, k, v, g, beta, S0)
    n = torch.tensor([T, T - 1, 1, 0])
    at_once = gdn_fold(S0, *out[2:], n)
    S = S0
    for i in range(T):  # one row a step, each from the step's own fold data (a T=1 verify of that row)
        one = gdn_chunk_wy16(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1], S)
        S = gdn_fold(S, *one[2:], (i < n).long())
    assert torch.equal(at_once, S)
    # the closed form over the recurrence's u_i rows agrees only to rounding (why the fold replays the rows)
    gam = torch.cumsum(out.g, 1)                                                   # γ [B,T,Hv]
    closed = torch.exp(gam[:, -1])[..., None, None] * S0 + torch.einsum(
        "bthk,bth,bthv->bhkv", expand_heads(out.k_hat, 4), torch.exp(gam[:, -1:] - gam), _v_prime(q, k, v, g, beta, S0))
    assert rel(closed[0], at_once[0]) < 1e-5 and not torch.equal(closed[0], at_once[0])


def _v_prime(q, k, v, g, beta, S0):
    """The recurrence's u_i rows (the chunk form's V')."""
    kh = expand_heads(l2norm(k), v.shape[2])
    S, us = S0, []
    for t in range(v.shape[1]):
        S = S * torch.exp(g[:, t])[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kh[:, t]))
        S = S + kh[:, t, :, :, None] * u[:, :, None, :]
        us.append(u)
    return torch.stack(us, 1)


# ------------------------------------------------------------------------------ ONNX function body
@pytest.mark.parametrize("T", [1, 5, 16, 40])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (1, 4)])
def test_onnx_body_gdn_chunk_wy16(T, Hk, Hv):
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(T * 10 + Hv)
    B, dk, dv = 2, 16, 8
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    feeds = dict(q=f(B, T, Hk, dk), k=f(B, T, Hk, dk), v=f(B, T, Hv, dv),
                 g=-rng.uniform(0, 2, (B, T, Hv)).astype(np.float32),
                 beta=rng.uniform(0, 1, (B, T, Hv)).astype(np.float32), state=f(B, Hv, dk, dv))
    got = run_op("GdnChunkWY16", feeds, {"scale": dk ** -0.5})
    ref = gdn_chunk_wy16(*(torch.from_numpy(x) for x in feeds.values()))
    for name, r in zip(("o", "state_out", "k_hat", "v_f32", "g_f32", "beta_f32"), ref):
        close(got[name], r)
    # and the chunked form is the recurrence
    close(got["state_out"], gdn_recurrent(*(torch.from_numpy(x) for x in feeds.values()))[1])


def test_onnx_body_gdn_default_scale():
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    feeds = dict(q=f(1, 3, 2, 16), k=f(1, 3, 2, 16), v=f(1, 3, 2, 8), g=-np.abs(f(1, 3, 2)),
                 beta=np.abs(f(1, 3, 2)) / 3, state=f(1, 2, 16, 8))
    close(run_op("GdnChunkWY16", feeds)["o"], gdn_chunk_wy16(*map(torch.from_numpy, feeds.values())).o)


# ---------------------------------------------------------------------- launcher checks, torch ops
def test_launchers_validate_before_launch():
    kw = dict(B=1, T=4, Hk=1, Hv=2, dv=128)
    with pytest.raises(KernelError, match="dk=96"):
        launch.gdn_wy16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, dk=96, **kw)
    with pytest.raises(KernelError, match="int8"):
        launch.gdn_wy16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, dk=128, in_dtype="int8", **kw)
    with pytest.raises(KernelError, match="all or none"):
        launch.gdn_wy16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 0, dk=128, **kw)
    with pytest.raises(KernelError, match="state"):
        launch.gdn_fold(0, 0, 0, 0, 0, 0, 0, dk=128, state_dtype="bfloat16", **kw)
    with pytest.raises(KernelError, match="Hv=3"):
        launch.gdn_fold(0, 0, 0, 0, 0, 0, 0, B=1, T=1, Hk=2, Hv=3, dk=128, dv=128)
    with pytest.raises(KernelError, match="num_slots"):
        launch.gdn_fold(0, 0, 0, 0, 0, 0, 0, dk=128, L=3, **kw)  # a layer stride is needed past one layer


def test_spec_chunk_rows_and_cg():
    assert [spec.chunk_rows(T) for T in (1, 4, 5, 8, 9, 16, 40)] == [4, 4, 8, 8, 16, 16, 16]
    assert launch._gdn_cg(64, 32, 128, 128, 0, (1, 2, 4)) == 4   # many CTAs even at cg 4
    assert launch._gdn_cg(1, 32, 128, 128, 0, (1, 2, 4)) == 1    # B = 1: widest grid
    assert launch._gdn_cg(8, 32, 64, 128, 4, (1, 2, 4)) == 2     # no cg 4 kernel at dk 64
    assert launch._gdn_cg(64, 32, 128, 128, 4, (1, 2, 4), spec.FOLD_CG) == 2
    # rows per thread follow the grid and dk (never T): 32 on a wide grid, 8 warps a column tile between (p16 at
    # dk 128, p8 at dk 64), 8 on a narrow one
    assert [spec.auto_rpt(c) for c in (8, 31, 32, 128, 511, 512, 4096)] == [8, 8, 16, 16, 16, 32, 32]
    assert [spec.auto_rpt(c, 64) for c in (8, 32, 128, 511, 512)] == [8, 8, 8, 8, 32]
    assert launch._gdn_rpt(8, 2) == 32  # only the 32-row form exists at cg > 1
    assert spec.wy16_name(128, 1, 16, 5) == "gdn_wy16_dk128_cg1_p16_r8"


def test_gdn_rpt_override(monkeypatch):
    monkeypatch.setenv("DFLASH_GDN_RPT", "16")
    assert launch._gdn_rpt(4096, 1) == 16
    monkeypatch.setenv("DFLASH_GDN_RPT", "12")
    with pytest.raises(KernelError, match="DFLASH_GDN_RPT=12"):
        launch._gdn_rpt(8, 1)


@pytest.mark.parametrize("T", [1, 5, 16, 37])
def test_cpu_gdn_ops_equal_reference(T):
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)
    B, Hk, Hv, dk, dv = 3, 1, 2, 32, 16
    q, k, v, g, beta, pool = gdn_inputs(B, T, Hk, Hv, dk, dv, slots=B + 2)
    slot = torch.tensor([4, 0, 2])
    o, *fold, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, None, True)
    ref = gdn_chunk_wy16(q, k, v, g, beta, pool[slot.long()])
    for a, b in zip([o, *fold, fs], (ref.o, ref.k_hat, ref.v, ref.g, ref.beta, ref.state)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    n = torch.tensor([T, 0, min(2, T)])
    pool2 = pool.clone()
    torch.ops.dflash.gdn_fold(pool2[None], slot, *(x[None] for x in fold), n)  # one layer
    want = gdn_fold(pool[slot.long()], *fold, n)
    torch.testing.assert_close(pool2[slot.long()], want, rtol=0, atol=0)
    untouched = [i for i in range(B + 2) if i not in (4, 2)]
    assert torch.equal(pool2[untouched], pool[untouched])


def test_cpu_gdn_op_gates_equal_gates_before():
    """dflash::gdn_wy16 handed A_log and dt_bias computes the gates of the raw columns a, b (the CPU kernel: the
    reference gdn_gates, then the op): the same outputs as the gates computed before the op."""
    import dflash_trt.plugins.torch_ops  # noqa: F401
    B, T, Hk, Hv, dk, dv = 2, 5, 1, 2, 32, 16
    q, k, v, _, _, pool = gdn_inputs(B, T, Hk, Hv, dk, dv)
    a, b, A_log, dt_bias = torch.randn(B, T, Hv) * 8, torch.randn(B, T, Hv), torch.randn(Hv), torch.randn(Hv)
    got = torch.ops.dflash.gdn_wy16(q, k, v, a, b, pool, None, None, True, A_log, dt_bias)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    want = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, None, None, True)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert (g <= 0).all() and ((beta > 0) & (beta < 1)).all()


@pytest.mark.parametrize("L,B,T", [(1, 1, 1), (3, 4, 16), (2, 5, 7)])
def test_cpu_gdn_fold_all_layers_equals_host_device(L, B, T):
    """One dflash::gdn_fold over all L layers (CPU: the reference) == HostDevice.gdn_fold (float64 numpy)."""
    import dflash_trt.plugins.torch_ops  # noqa: F401
    pool, *fold, slot, n = fold_case(L, B, T, 2, 4, 16, 8, slots=B + 3, seed=L * 100 + B * 10 + T)
    want = pool.copy()
    HostDevice().gdn_fold(want, slot, *fold, n)
    got = torch.from_numpy(pool.copy())
    torch.ops.dflash.gdn_fold(got, torch.from_numpy(slot), *map(torch.from_numpy, fold), torch.from_numpy(n))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(B + 3), slot[n > 0])
    assert np.array_equal(got.numpy()[:, untouched], pool[:, untouched])  # n = 0 and other slots: bit-identical


def test_cpu_gdn_decode_is_the_one_row_verify_then_its_fold():
    """dflash::gdn_decode on the CPU (a plain decode step that commits its own GDN row): o == the float64 token
    recurrence; pool[layer] rows slot[b] with n[b] > 0 == that recurrence's state after the row; rows with n = 0, the
    other layer, other slots and slot -1 (read as a zero state) untouched. Shapes refused by name."""
    import dflash_trt.plugins.torch_ops  # noqa: F401
    B, Hk, Hv, dk, dv, L, S = 4, 1, 2, 32, 16, 2, 7
    q, k, v, _, _, _ = gdn_inputs(B, 1, Hk, Hv, dk, dv)
    a, b, A_log, dt_bias = torch.randn(B, 1, Hv) * 3, torch.randn(B, 1, Hv), torch.randn(Hv), torch.randn(Hv)
    pool = torch.randn(L, S, Hv, dk, dv) * 0.3
    slot, n = torch.tensor([5, 1, -1, 3]), torch.tensor([1, 0, 1, 1])
    got = pool.clone()
    o = torch.ops.dflash.gdn_decode(q, k, v, a, b, got, 1, slot, n, None, A_log, dt_bias)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    state = pool[1][slot.clamp(min=0)] * (slot >= 0)[:, None, None, None]
    ro, rs = gdn_recurrent(*(x.double() for x in (q, k, v, g, beta, state)))
    torch.testing.assert_close(o.double(), ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1][[5, 3]].double(), rs[[0, 3]], rtol=1e-4, atol=1e-5)
    untouched = pool.clone()
    untouched[1][[5, 3]] = got[1][[5, 3]]
    assert torch.equal(got, untouched)
    with pytest.raises(KernelError, match="T = 1"):
        torch.ops.dflash.gdn_decode(q.expand(B, 2, Hk, dk), k.expand(B, 2, Hk, dk), v.expand(B, 2, Hv, dv),
                                    a.expand(B, 2, Hv), b.expand(B, 2, Hv), got, 0, slot, n, None, A_log, dt_bias)
    with pytest.raises(KernelError, match="layer 2 < L"):
        torch.ops.dflash.gdn_decode(q, k, v, a, b, got, 2, slot, n, None, A_log, dt_bias)
    with pytest.raises(KernelError, match=r"\[B\] = \[4\]"):
        torch.ops.dflash.gdn_decode(q, k, v, a, b, got, 0, slot, n[:3], None, A_log, dt_bias)


def test_cpu_gdn_fold_checks_shapes():
    import dflash_trt.plugins.torch_ops  # noqa: F401
    pool, k_hat, v, g, beta, slot, n = (torch.from_numpy(a) for a in fold_case(2, 3, 4, 1, 2, 8, 8, 5, seed=0))
    with pytest.raises(ShapeError, match="k_hat"):
        torch.ops.dflash.gdn_fold(pool, slot, k_hat[:1], v, g, beta, n)  # fold data of one layer, pool of two
    with pytest.raises(ShapeError, match="beta"):
        torch.ops.dflash.gdn_fold(pool, slot, k_hat, v, g, beta[:, :, :2], n)
    with pytest.raises(ShapeError, match="n"):
        torch.ops.dflash.gdn_fold(pool, slot, k_hat, v, g, beta, n[:2])
