"""GPU: the GDN kernels (plugins/gdn/kernel.cu through the dflash:: torch ops) vs the float64 reference and
fla-core; the layer-batched gdn_fold kernel vs HostDevice; CUDA-graph capture. Max errors are printed at
the end of the session (conftest.py)."""
import numpy as np
import pytest
import torch

from dflash_trt.plugins.gdn import reference as ref_gdn
from dflash_trt.plugins.opspec import KernelError
from dflash_trt.runtime.devices.host import HostDevice

from op_helpers import fold_case, gdn_inputs, record_err

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _ops():
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)


def _inputs(B, T, Hk, Hv, dk, dv, dtype, seed, slots=None):
    return gdn_inputs(B, T, Hk, Hv, dk, dv, dtype, seed, slots, device=DEV)


def _d(*ts):
    return [x.double() for x in ts]


def _fold(pool, slot, fold, n):
    """dflash::gdn_fold on one layer's pool [slots, ...] (the op commits [L, ...]); fold = (k_hat, v, g, beta)."""
    torch.ops.dflash.gdn_fold(pool[None], slot, *(x[None] for x in fold), n)


def _check_fold_data(tag, fold, ref):
    """The op's fold data == the reference's row inputs (k_hat to rounding; v, g, beta exactly as read)."""
    record_err(f"gdn_wy16 k_hat{tag}", fold[0], ref.k_hat, 1e-5)
    for name, x, y in zip(("v", "g", "beta"), fold[1:], (ref.v, ref.g, ref.beta)):
        assert torch.equal(x.double(), y), name


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("K", range(1, 17))
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gdn_verify_and_fold(B, K, ratio):
    dtype = torch.float32 if K in (1, 16) and B == 8 else torch.bfloat16
    Hk, dk, dv = 2, 128, 128
    Hv = Hk * ratio
    S = B + 3
    q, k, v, g, beta, pool = _inputs(B, K, Hk, Hv, dk, dv, dtype, seed=B * 100 + K * 3 + ratio, slots=S)
    slot = torch.randperm(S, device=DEV)[:B].int()
    o, *fold, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, None, False)
    assert fs.numel() == 0 and o.dtype == dtype
    ref = ref_gdn.gdn_chunk_wy16(*_d(q, k, v, g, beta), pool[slot.long()].double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    tag = "bf16" if dtype == torch.bfloat16 else "fp32"
    record_err(f"gdn_wy16 o ({tag})", o, ref.o, tol)
    _check_fold_data("", fold, ref)
    # commit: fold the first n rows (n = 0 allowed) into the pool slots in place
    n = torch.randint(0, K + 1, (B,), device=DEV, dtype=torch.int32)
    n[0] = 0 if B > 1 else n[0]
    pool2 = pool.clone()
    _fold(pool2, slot, fold, n)
    want = ref_gdn.gdn_fold(pool[slot.long()].double(), *ref[2:], n)
    record_err("gdn_fold state", pool2[slot.long()], want, 1e-4)
    mask = torch.ones(S, dtype=torch.bool, device=DEV)
    mask[slot.long()] = False
    assert torch.equal(pool2[mask], pool[mask])
    if B > 1:
        assert torch.equal(pool2[slot[0].long()], pool[slot[0].long()])  # n = 0: untouched
    # the folded state equals running the recurrence over the accepted rows
    b = int(torch.argmax(n))
    nb = int(n[b])
    if nb:
        _, st = ref_gdn.gdn_recurrent(*_d(q[b:b + 1, :nb], k[b:b + 1, :nb], v[b:b + 1, :nb], g[b:b + 1, :nb],
                                          beta[b:b + 1, :nb]), pool[slot[b].long()][None].double())
        record_err("gdn verify+fold vs recurrence", pool2[slot[b].long()], st[0], 1e-4)


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("T", [17, 64, 128, 200])
@pytest.mark.parametrize("B", [1, 8])
def test_gdn_prefill_final_state(B, T, ratio):
    Hk, dk, dv = 2, 128, 128
    q, k, v, g, beta, st = _inputs(B, T, Hk, Hk * ratio, dk, dv, torch.bfloat16, seed=T + B + ratio)
    o, *fold, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st, None, None, True)
    ro, rs = ref_gdn.gdn_recurrent(*_d(q, k, v, g, beta, st))
    record_err("gdn prefill o (bf16)", o, ro, 1e-2)
    record_err("gdn prefill final state", fs, rs, 2e-4)
    # fold data stays valid past the first chunk: folding all T rows == final state
    st2 = st.clone()
    _fold(st2, None, fold, torch.full((B,), T, device=DEV, dtype=torch.int32))
    record_err("gdn fold over T>16 rows", st2, rs, 2e-4)


@pytest.mark.parametrize("cg", ["1", "2", "4"])
def test_gdn_column_groups_and_zero_slot(monkeypatch, cg):
    monkeypatch.setenv("DFLASH_GDN_CG", cg)
    dk = 64 if cg == "2" else 128
    q, k, v, g, beta, pool = _inputs(3, 9, 1, 2, dk, 128, torch.float32, seed=7, slots=4)
    slot = torch.tensor([2, -1, 0], device=DEV, dtype=torch.int32)
    o, *fold, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, 0.2, True)
    st0 = pool[slot.long().clamp(min=0)].double()
    st0[1] = 0
    ref = ref_gdn.gdn_chunk_wy16(*_d(q, k, v, g, beta), st0, scale=0.2)
    record_err(f"gdn_wy16 o (fp32, dk{dk} cg{cg})", o, ref.o, 1e-4)
    record_err(f"gdn_wy16 final state (dk{dk} cg{cg})", fs, ref.state, 1e-4)
    pool2 = pool.clone()
    n = torch.tensor([9, 5, 0], device=DEV, dtype=torch.int32)
    _fold(pool2, slot, fold, n)
    want = ref_gdn.gdn_fold(st0, *ref[2:], n)
    record_err(f"gdn_fold (dk{dk} cg{cg})", pool2[2], want[0], 1e-4)
    assert torch.equal(pool2[[1, 3]], pool[[1, 3]])


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype,T", [(torch.float32, 16), (torch.bfloat16, 1), (torch.bfloat16, 7)])
def test_gdn_gates_in_kernel(dtype, T, pdtype):
    """A_log and dt_bias given: the kernel reads the raw gate columns a, b in place (strided slices of one projection
    row, as the model hands them) and computes g, beta itself == reference.gdn_gates before the kernel, and == the
    float64 recurrence. a spans softplus's threshold (20) on both sides."""
    B, Hk, Hv, dk, dv = 2, 2, 4, 128, 128
    q, k, v, _, _, pool = _inputs(B, T, Hk, Hv, dk, dv, dtype, seed=T, slots=B + 1)
    gen = torch.Generator().manual_seed(T + 1)
    proj = (torch.randn(B, T, 3 * Hv + 5, generator=gen) * 8).to(dtype).to(DEV)  # [b | a | other columns]
    b, a = proj[..., :Hv], proj[..., Hv:2 * Hv]
    a[0, 0, 0] = 30.0  # over the threshold: softplus(x) = x
    A_log = (torch.randn(Hv, generator=gen) * 0.5).to(pdtype).to(DEV)
    dt_bias = torch.randn(Hv, generator=gen).to(pdtype).to(DEV)
    slot = torch.tensor([2, 0], device=DEV, dtype=torch.int32)
    got = torch.ops.dflash.gdn_wy16(q, k, v, a, b, pool, slot, None, False, A_log, dt_bias)
    g, beta = ref_gdn.gdn_gates(a, b, A_log, dt_bias)
    want = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, None, False)
    tag = f"{str(dtype)[6:]} T{T} params {str(pdtype)[6:]}"
    for name, x, y in zip(("o", "k_hat", "v", "g", "beta"), got[:5], want[:5]):
        tol = 1e-2 if name == "o" and dtype == torch.bfloat16 else 1e-5  # bf16 o: one rounding flip at most
        record_err(f"gdn gates in kernel vs before, {name} ({tag})", x, y, tol)
    ro, _ = ref_gdn.gdn_recurrent(*_d(q, k, v, g, beta), pool[slot.long()].double())
    record_err(f"gdn gates in kernel o vs recurrence ({tag})", got[0], ro, 1e-2 if dtype == torch.bfloat16 else 1e-4)
    with pytest.raises(KernelError, match="together"):
        torch.ops.dflash.gdn_wy16(q, k, v, a, b, pool, slot, None, False, A_log, None)
    with pytest.raises(KernelError, match=r"\[Hv\]"):
        torch.ops.dflash.gdn_wy16(q, k, v, a, b, pool, slot, None, False, A_log[:2], dt_bias[:2])


@pytest.mark.parametrize("rpt", ["32", "16", "8"])
@pytest.mark.parametrize("dk,T", [(128, 1), (128, 16), (128, 37), (64, 5), (64, 16)])
def test_gdn_rows_per_thread_forms(monkeypatch, rpt, dk, T):
    """Each state-rows-per-thread form (DFLASH_GDN_RPT) == the float64 chunk reference: o, fold data, final state
    (several chunks at T=37), with zero-state (slot -1) rows."""
    monkeypatch.setenv("DFLASH_GDN_RPT", rpt)
    B, Hk, Hv, dv = 3, 2, 4, 64
    q, k, v, g, beta, pool = _inputs(B, T, Hk, Hv, dk, dv, torch.float32, seed=int(rpt) + T + dk, slots=B + 1)
    slot = torch.tensor([3, -1, 1], device=DEV, dtype=torch.int32)
    o, *fold, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, None, True)
    st0 = pool[slot.long().clamp(min=0)].double()
    st0[1] = 0
    ref = ref_gdn.gdn_chunk_wy16(*_d(q, k, v, g, beta), st0)
    for name, x, y in zip(("o", "state"), (o, fs), (ref.o, ref.state)):
        record_err(f"gdn_wy16 p{rpt} {name} (fp32)", x, y, 1e-4)
    _check_fold_data(f" p{rpt}", fold, ref)


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
    q, k, v, g, beta, st = _inputs(B, K, Hk, Hv, dk, dv, torch.bfloat16, seed=K)
    o, *_, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st, None, None, True)
    fn = fla.fused_recurrent_gated_delta_rule if K == 1 else fla.chunk_gated_delta_rule
    fo, fst = fn(q, k, v, g=g, beta=beta, scale=dk ** -0.5, initial_state=st.clone(), output_final_state=True,
                 use_qk_l2norm_in_kernel=True)
    ro, rs = ref_gdn.gdn_recurrent(*_d(q, k, v, g, beta, st))
    record_err(f"fla K={K} o vs ref", fo, ro, 1e-1)
    record_err(f"fla K={K} state vs ref", fst, rs, 1e-1)
    record_err(f"ours K={K} o vs ref (Qwen3-Next)", o, ro, 1e-2)
    record_err(f"ours K={K} state vs ref (Qwen3-Next)", fs, rs, 1e-4)
    record_err(f"ours K={K} o vs fla", o, fo, 1e-1)
    record_err(f"ours K={K} state vs fla", fs, fst, 1e-1)


def test_bad_inputs_raise_before_launch():
    q, k, v, g, beta, st = _inputs(1, 2, 1, 1, 96, 128, torch.bfloat16, seed=0)
    with pytest.raises(KernelError, match="dk=96"):
        torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st, None, None, False)
    q, k, v, g, beta, st = _inputs(1, 2, 1, 1, 128, 128, torch.bfloat16, seed=0)
    with pytest.raises(KernelError, match="state"):
        torch.ops.dflash.gdn_wy16(q, k, v, g, beta, st.bfloat16(), None, None, False)


@pytest.mark.parametrize("dk,dv", [(128, 128), (64, 32)])
@pytest.mark.parametrize("L,B,T", [(1, 1, 1), (4, 8, 16), (3, 64, 5)])
def test_gdn_fold_all_layers_kernel_equals_host_device(L, B, T, dk, dv):
    """One gdn_fold launch over all L layers == HostDevice.gdn_fold (float64 numpy), other slots untouched."""
    pool, *fold, slot, n = fold_case(L, B, T, 2, 4, dk, dv, slots=B + 3, seed=L + B + T + dk)
    want = pool.copy()
    HostDevice().gdn_fold(want, slot, *fold, n)
    got = torch.from_numpy(pool).to(DEV)
    t = lambda a: torch.from_numpy(a).to(DEV)  # noqa: E731
    torch.ops.dflash.gdn_fold(got, t(slot), *map(t, fold), t(n))
    record_err(f"gdn_fold all layers vs HostDevice (dk{dk})", got.cpu(), torch.from_numpy(want), 1e-5)
    untouched = np.setdiff1d(np.arange(B + 3), slot[n > 0])
    assert np.array_equal(got.cpu().numpy()[:, untouched], pool[:, untouched])


def test_cuda_graph_capture_matches_eager():
    B, K, Hk, Hv = 8, 16, 16, 32
    q, k, v, g, beta, pool = _inputs(B, K, Hk, Hv, 128, 128, torch.bfloat16, seed=3)
    n = torch.randint(0, K + 1, (B,), device=DEV, dtype=torch.int32)
    slot = torch.arange(B, device=DEV, dtype=torch.int32)
    eager = pool.clone()
    r = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, eager, slot, None, False)
    _fold(eager, slot, r[1:5], n)
    work = pool.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (module load) outside capture
        torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool.clone(), slot, None, False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r2 = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, work, slot, None, False)
        _fold(work, slot, r2[1:5], n)
    work.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work, eager)
    assert torch.equal(r2[0], r[0])


def test_cuda_graph_replays_layer_batched_fold_with_new_n():
    """n and slot are read on the device: one captured all-layer fold replays for new values."""
    L, B, T = 3, 4, 8
    pool, *fold, slot, n = fold_case(L, B, T, 2, 4, 128, 128, slots=B + 1, seed=11)
    t = lambda a: torch.from_numpy(a).to(DEV)  # noqa: E731
    work, dslot, dn, fd = t(pool), t(slot).int(), t(n).int(), [t(x) for x in fold]
    torch.ops.dflash.gdn_fold(work.clone(), dslot, *fd, dn)  # warm-up: module load outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.dflash.gdn_fold(work, dslot, *fd, dn)
    for new_n in (n, np.array([T, 1, 0, 3]), np.zeros(B, np.int64)):
        want = pool.copy()
        HostDevice().gdn_fold(want, slot, *fold, new_n)
        work.copy_(t(pool))
        dn.copy_(t(new_n).int())
        graph.replay()
        torch.cuda.synchronize()
        record_err("gdn_fold graph replay vs HostDevice", work.cpu(), torch.from_numpy(want), 1e-5)


@pytest.mark.parametrize("cg", ["1", "2"])
@pytest.mark.parametrize("B,K,Hk,Hv,dk", [(1, 16, 16, 32, 128), (4, 8, 2, 4, 128), (2, 16, 1, 2, 64)])
def test_verify_commit_equals_plain_decode_steps_bit_for_bit(monkeypatch, cg, B, K, Hk, Hv, dk):
    """What the runtime does, both ways, on the kernels: a verify of K rows then the commit of n[b] of them leaves
    exactly (torch.equal) the fp32 state of n[b] plain decode steps, each a T=1 verify from the previous state and
    a one-row commit; the fold data of each row are the same bits either way. Checked at both fold column groups
    (the fold's dk reduction order does not depend on them). This is why speculative and plain bf16 decoding keep
    one GDN state (and their bf16 KL small)."""
    monkeypatch.setenv("DFLASH_GDN_CG", cg)
    q, k, v, _, _, pool = _inputs(B, K, Hk, Hv, dk, 128, torch.bfloat16, seed=B * 7 + K + dk, slots=B + 1)
    gen = torch.Generator().manual_seed(K)
    a, b = ((torch.randn(B, K, Hv, generator=gen) * 2).bfloat16().to(DEV) for _ in range(2))
    A_log, dt_bias = (torch.randn(Hv, generator=gen).to(DEV) for _ in range(2))
    slot = torch.arange(1, B + 1, device=DEV, dtype=torch.int32)
    n = torch.tensor([K, K // 2, 1, 0][:B], device=DEV, dtype=torch.int32)
    spec = pool.clone()
    _, *fold, _ = torch.ops.dflash.gdn_wy16(q, k, v, a, b, spec, slot, None, False, A_log, dt_bias)
    _fold(spec, slot, fold, n)
    plain = pool.clone()
    for i in range(K):
        rows = [x[:, i:i + 1] for x in (q, k, v, a, b)]
        _, *one, _ = torch.ops.dflash.gdn_wy16(*rows[:3], rows[3], rows[4], plain, slot, None, False, A_log, dt_bias)
        live = (i < n).int()
        for x, y in zip(one, fold):
            assert torch.equal(x[live.bool()], y[:, i:i + 1][live.bool()])
        _fold(plain, slot, one, live)
    assert torch.equal(spec, plain)
    assert torch.equal(spec[0], pool[0])  # slot 0 holds no sequence here


@pytest.mark.parametrize("cg", ["0", "1", "2"])
@pytest.mark.parametrize("B,Hk,Hv,dk,dtype", [(1, 16, 48, 128, torch.bfloat16), (5, 2, 4, 128, torch.bfloat16),
                                               (64, 2, 6, 128, torch.bfloat16), (3, 1, 2, 64, torch.bfloat16),
                                               (4, 2, 4, 128, torch.float32)])
def test_decode_commit_equals_verify_then_fold_bit_for_bit(monkeypatch, cg, B, Hk, Hv, dk, dtype):
    """dflash::gdn_decode (one row that commits its own state) leaves exactly (torch.equal) the pool a T=1 gdn_wy16
    and the commit's gdn_fold of the same row leave: the one GDN state of plain and speculative decoding. Rows with
    n = 0 and the other layer and slots stay untouched; slot -1 reads a zero state. q, k, v and the raw gates are
    strided views of wider rows, as the model hands them. o == gdn_wy16's o up to its rounding, and == the float64
    recurrence."""
    monkeypatch.setenv("DFLASH_GDN_CG", cg)
    L, S, dv, layer = 2, B + 3, 128, 1
    gen = torch.Generator().manual_seed(B * 11 + Hv + dk)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    row = rn(B, 1, 2 * Hk * dk + Hv * dv + 8).to(dtype).to(DEV)  # [q | k | v | other]: the conv output's rows
    q = row[..., :Hk * dk].unflatten(-1, (Hk, dk))
    k = row[..., Hk * dk:2 * Hk * dk].unflatten(-1, (Hk, dk))
    v = row[..., 2 * Hk * dk:2 * Hk * dk + Hv * dv].unflatten(-1, (Hv, dv))
    proj = (rn(B, 1, 2 * Hv + 3) * 3).to(dtype).to(DEV)
    b, a = proj[..., :Hv], proj[..., Hv:2 * Hv]
    A_log, dt_bias = (rn(Hv) * 0.5).to(DEV), rn(Hv).to(DEV)
    pool = (rn(L, S, Hv, dk, dv) * 0.3).to(DEV)
    slot = torch.randperm(S, generator=gen)[:B].int().to(DEV)
    n = (torch.arange(B) % 3 != 2).int().to(DEV)  # every third row commits nothing
    if B > 1:
        slot[-1] = -1  # a zero state, never written
    want = pool.clone()
    o_ref, *fold, _ = torch.ops.dflash.gdn_wy16(q, k, v, a, b, want[layer], slot, None, False, A_log, dt_bias)
    _fold(want[layer], slot, fold, n)
    got = pool.clone()
    o = torch.ops.dflash.gdn_decode(q, k, v, a, b, got, layer, slot, n, None, A_log, dt_bias)
    torch.cuda.synchronize()
    assert o.shape == o_ref.shape and o.dtype == dtype
    assert torch.equal(got, want)
    tag = f"B{B} dk{dk} cg{cg} {str(dtype)[6:]}"
    record_err(f"gdn_decode o vs gdn_wy16 ({tag})", o, o_ref, 1e-2 if dtype == torch.bfloat16 else 1e-5)
    g, beta = ref_gdn.gdn_gates(a, b, A_log, dt_bias)
    state = pool[layer][slot.long().clamp(min=0)].double() * (slot >= 0).double()[:, None, None, None]
    ro, _ = ref_gdn.gdn_recurrent(*_d(q, k, v, g, beta), state)
    record_err(f"gdn_decode o vs recurrence ({tag})", o, ro, 1e-2 if dtype == torch.bfloat16 else 1e-4)

