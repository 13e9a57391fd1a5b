"""Helpers shared by the op tests (tests/ops/): random inputs, error bookkeeping, one-op ONNX runs."""
import numpy as np
import torch

from dflash_trt.plugins.gdn.reference import gdn_gates

ERRS: dict = {}  # GPU kernel max errors, printed at the end of the session (conftest.py)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def record_err(name, got, ref, tol):
    """max|got-ref| / max|ref| <= tol, recorded under `name` (the worst seen)."""
    ref = ref.double()
    e = ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item() if ref.numel() else 0.0
    ERRS[name] = max(ERRS.get(name, 0.0), e)
    assert e <= tol, f"{name}: rel err {e:.3e} > {tol}"


def gdn_inputs(B, T, Hk, Hv, dk, dv, dtype=torch.float32, seed=0, slots=None, device="cpu"):
    """q, k, v (dtype), g, beta (gates of random a, b), a state pool of `slots` rows (default B)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g, beta = gdn_gates(r(B, T, Hv), r(B, T, Hv), r(Hv) * 0.5, r(Hv))
    S = slots or B
    t = lambda x: x.to(device)  # noqa: E731
    return (t(r(B, T, Hk, dk).to(dtype)), t(r(B, T, Hk, dk).to(dtype)), t(r(B, T, Hv, dv).to(dtype)), t(g), t(beta),
            t(r(S, Hv, dk, dv) * 0.3))


def run_op(op, feeds, attrs=None):
    """ORT (CPU) on a one-node model of `op` with its function body; output name -> array."""
    import onnx
    import onnxruntime as ort

    from dflash_trt.plugins.onnx_functions import SPECS, single_op_model
    from dflash_trt.plugins.opspec import DOMAIN

    m = single_op_model(op, feeds, attrs)
    onnx.checker.check_model(m, full_check=True)
    node = m.graph.node[0]
    assert (node.domain, node.op_type) == (DOMAIN, op)
    a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
    assert a["plugin_namespace"] == b"dflash" and a["plugin_version"] == b"1"
    assert [f.name for f in m.functions] == [op]
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(SPECS[op].output_names, sess.run(None, feeds)))


def close(got, ref, tol=1e-4):
    ref = ref.detach().numpy() if torch.is_tensor(ref) else ref
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)


def commit_case(B, T, slots, seed):
    """Random numpy slots (distinct, shuffled) and n in [0, T] (one 0, one T) for a commit test."""
    rng = np.random.default_rng(seed)
    slot = rng.permutation(slots)[:B].astype(np.int64)
    n = rng.integers(0, T + 1, B).astype(np.int64)
    n[0] = 0
    if B > 1:
        n[1] = T
    return rng, slot, n


def fold_case(L, B, T, Hk, Hv, dk, dv, slots, seed):
    """numpy pool [L,slots,...] + fold data [L,B,T,...] (as a verify graph emits) + slot, n."""
    rng, slot, n = commit_case(B, T, slots, seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    k_hat = f(L, B, T, Hk, dk)
    k_hat /= np.linalg.norm(k_hat, axis=-1, keepdims=True)
    g = -rng.uniform(0, 0.5, (L, B, T, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (L, B, T, Hv)).astype(np.float32)
    return f(L, slots, Hv, dk, dv) * 0.3, k_hat, f(L, B, T, Hv, dv), g, beta, slot, n


def roll_case(L, B, T, C, W, slots, seed):
    """numpy conv pool [L,slots,C,W-1] + pre-conv columns [L,B,T,C] + slot, n."""
    rng, slot, n = commit_case(B, T, slots, seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f(L, slots, C, W - 1), f(L, B, T, C), slot, n


def kv_case(L, B, T, Hkv, hd, bs, max_blocks, seed):
    """numpy kv pool [L,2,blocks,bs,Hkv,hd] + rows [L,2,B,T,Hkv,hd] + block_table (distinct pages per
    sequence) + start rows + n: rows land in pages already allocated for start + T."""
    rng, _, n = commit_case(B, T, B, seed)
    nb = B * max_blocks + 2
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    bt = rng.permutation(nb)[: B * max_blocks].reshape(B, max_blocks).astype(np.int64)
    start = rng.integers(0, max_blocks * bs - T + 1, B).astype(np.int64)
    return f(L, 2, nb, bs, Hkv, hd), f(L, 2, B, T, Hkv, hd), bt, start, n


def assert_bulk_stream_is_register_stream(calls, K, monkeypatch):
    """Each call of `calls` (x -> y) gives the same bits through the shared-memory weight stream (gemv/bulk.cuh,
    DFLASH_TRT_BULK_STREAM=1) as through the register stream, at 1, 9 and 16 rows of x (skipped below sm_90)."""
    import pytest
    import torch

    from dflash_trt.plugins.gemv import spec as gemv_spec

    monkeypatch.setenv("DFLASH_TRT_BULK_STREAM", "1")
    if not gemv_spec.bulk(torch.cuda.get_device_capability()):
        pytest.skip("the shared-memory stream runs on compute capability 9.0 and 10.x")
    with torch.no_grad():
        for M in (1, 9, 16):
            x = torch.randn(M, K, device="cuda").bfloat16()
            bulk = [f(x) for f in calls]
            monkeypatch.setenv("DFLASH_TRT_BULK_STREAM", "0")
            regs = [f(x) for f in calls]
            monkeypatch.setenv("DFLASH_TRT_BULK_STREAM", "1")
            for a, b in zip(bulk, regs):
                assert torch.equal(a, b), (M, (a.float() - b.float()).abs().max().item())
