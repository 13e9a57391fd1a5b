"""Each dflash custom op alone: ORT running its FunctionProto body == the torch reference (fp32 <= 1e-4)."""
import numpy as np
import onnx
import pytest
import torch

from dflash_trt.export import attention_ref, gdn_ref
from dflash_trt.export.onnx_functions import DOMAIN, SIGNATURES, single_op_model

ort = pytest.importorskip("onnxruntime")
TOL = 1e-4


def run_op(op, feeds, attrs=None):
    m = single_op_model(op, feeds, attrs)
    onnx.checker.check_model(m, full_check=True)
    node = m.graph.node[0]
    assert (node.domain, node.op_type) == (DOMAIN, op)
    a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
    assert a["plugin_namespace"] == b"dflash" and a["plugin_version"] == b"1"
    assert [f.name for f in m.functions] == [op]
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(SIGNATURES[op][1], sess.run(None, feeds)))


def close(got, ref):
    ref = ref.detach().numpy() if torch.is_tensor(ref) else ref
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("T", [1, 5, 16, 40])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (1, 4)])
def test_gdn_chunk_wy16(T, Hk, Hv):
    rng = np.random.default_rng(T * 10 + Hv)
    B, dk, dv = 2, 16, 8
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    feeds = dict(q=f(B, T, Hk, dk), k=f(B, T, Hk, dk), v=f(B, T, Hv, dv),
                 g=-rng.uniform(0, 2, (B, T, Hv)).astype(np.float32),
                 beta=rng.uniform(0, 1, (B, T, Hv)).astype(np.float32), state=f(B, Hv, dk, dv))
    got = run_op("GdnChunkWY16", feeds, {"scale": dk ** -0.5})
    ref = gdn_ref.gdn_chunk_wy16(*(torch.from_numpy(x) for x in feeds.values()))
    for name, r in zip(("o", "state_out", "k_hat", "v_new", "gamma"), ref):
        close(got[name], r)
    # and the chunked form is the recurrence
    close(got["state_out"], gdn_ref.gdn_recurrent(*(torch.from_numpy(x) for x in feeds.values()))[1])


def test_gdn_default_scale():
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    feeds = dict(q=f(1, 3, 2, 16), k=f(1, 3, 2, 16), v=f(1, 3, 2, 8), g=-np.abs(f(1, 3, 2)),
                 beta=np.abs(f(1, 3, 2)) / 3, state=f(1, 2, 16, 8))
    close(run_op("GdnChunkWY16", feeds)["o"], gdn_ref.gdn_chunk_wy16(*map(torch.from_numpy, feeds.values())).o)


@pytest.mark.parametrize("T", [1, 16, 33])
@pytest.mark.parametrize("W", [2, 4])
def test_causal_conv_verify(T, W):
    rng = np.random.default_rng(T + W)
    B, C = 3, 24
    feeds = dict(x=rng.standard_normal((B, T, C)).astype(np.float32),
                 conv_state=rng.standard_normal((B, C, W - 1)).astype(np.float32),
                 weight=rng.standard_normal((C, W)).astype(np.float32))
    close(run_op("CausalConvVerify", feeds)["y"], gdn_ref.conv_verify(*map(torch.from_numpy, feeds.values())))


# (kv_start, kv_len) per sequence: empty cache, partial first page, page-aligned, offset start (slid window)
LAYOUTS = [([0, 0], [0, 0]), ([0, 0], [3, 16]), ([0, 5], [32, 37]), ([7, 13], [20, 60])]


@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("causal", [1, 0])
def test_paged_attention(T, Hq, Hkv, layout, causal):
    rng = np.random.default_rng(T + 7 * Hq + 11 * Hkv + 13 * layout + causal)
    B, hd, L, NB, bs, MB = 2, 16, 3, 20, 8, 8
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ks, kl = (np.array(x, dtype=np.int64) for x in LAYOUTS[layout])
    bt = np.stack([rng.permutation(NB)[:MB] for _ in range(B)]).astype(np.int64)  # scattered pages
    feeds = dict(q=f(B, T, Hq, hd), k_new=f(B, T, Hkv, hd), v_new=f(B, T, Hkv, hd), kv_pool=f(L, 2, NB, bs, Hkv, hd),
                 block_table=bt, kv_start=ks, kv_len=kl)
    got = run_op("PagedAttention", feeds, {"layer": 2, "causal": causal, "scale": 0.3})["o"]
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ref = attention_ref.paged_attention_ref(t["q"], t["k_new"], t["v_new"], t["kv_pool"], 2, t["block_table"],
                                            t["kv_start"], t["kv_len"], bool(causal), 0.3)
    close(got, ref)


def test_unknown_inputs_rejected():
    with pytest.raises(ValueError, match="takes inputs"):
        single_op_model("CausalConvVerify", {"x": np.zeros((1, 1, 2), np.float32)})
