"""Exported graphs: onnx.checker, custom nodes + function bodies, ORT == torch per graph, lossless
speculative decoding on ORT, the export CLI, and clear errors for manifest/graph mismatches."""
import json
import os
import shutil

import numpy as np
import onnx
import pytest

from dflash_trt.abi import (DRAFTER_BLOCK, DRAFTER_CTX, PREFILL, PoolSizes, drafter_block_graph, drafter_block_lens,
                            target_graph)
from dflash_trt.hashing import sha256_files
from dflash_trt.manifest import Manifest, ManifestError
from test_onnx_common import KS, PROMPT, SIZES, OracleDrafter, exported, tiny_pair, torch_backend  # noqa: F401

pytest.importorskip("onnxruntime")
from dflash_trt.runtime.backends import make_backend  # noqa: E402
from dflash_trt.runtime.runtime import Runtime  # noqa: E402
from dflash_trt.runtime.load import ByteCodec  # noqa: E402

# a drafter block graph per verify width K = γ+1 below the full block (the reference's γ+1-slot blocks)
GRAPHS = [target_graph(k) for k in KS] + [PREFILL, DRAFTER_CTX] + [drafter_block_graph(b, 16) for b in drafter_block_lens(KS, 16)]
NEW = 64


@pytest.fixture(scope="module")
def ort_be(exported):
    return make_backend("ort", manifest=exported)


@pytest.fixture(scope="module")
def torch_be(tiny_pair):
    return torch_backend(tiny_pair)


def _file_io(path):
    """(inputs, outputs) as [(name, shape, dtype)] read from the ONNX file itself (symbolic dims -> 'B')."""
    g = onnx.load(path, load_external_data=False).graph

    def rec(v):
        tt = v.type.tensor_type
        dims = ["B" if d.dim_param else d.dim_value for d in tt.shape.dim]
        return v.name, dims, str(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))

    return [rec(v) for v in g.input], [rec(v) for v in g.output]


def _io_dicts(exported, graph):
    """name -> (shape, dtype) for the inputs and the outputs of one exported graph file."""
    return tuple({n: (sh, dt) for n, sh, dt in x} for x in _file_io(os.path.join(exported, graph + ".onnx")))


def test_manifest_describes_graphs(exported):
    m = Manifest.load(exported)
    assert m.ks == list(KS) and m.sizes == SIZES and m.batch == "B" and m.want_logits
    assert sorted(m.graphs) == sorted(GRAPHS)
    assert m.data["block_size"] == 16 and m.data["mask_token_id"] == 258 and m.data["vocab_size"] == 259
    assert m.data["tap_ids"] == m.drafter_config.target_layer_ids and len(m.data["target"]["hash"]) == 16
    for g in GRAPHS:  # what the manifest records is what the file holds
        ins, outs = _file_io(m.graph_path(g))
        assert [(i["name"], i["shape"], i["dtype"]) for i in m.io(g)[0]] == ins, g
        assert [(o["name"], o["shape"], o["dtype"]) for o in m.io(g)[1]] == outs, g


def test_graph_io_shapes_from_the_configs(exported):
    """The files' I/O against shapes written out by hand from the tiny pair's configs (tools/tiny.py:
    4 layers = 3 GDN + 1 attention, 2 KV heads of 16, GDN Hk 2 / Hv 4, dk 16 / dv 8, conv W 4, hidden 64,
    vocab 259; drafter 1 layer, 2 KV heads of 16, block 16, taps [1, 2])."""
    s = SIZES
    conv_dim = 2 * 2 * 16 + 4 * 8
    for K in KS:
        ins, outs = _io_dicts(exported, target_graph(K))
        assert ins["input_ids"] == (["B", K], "int64") and ins["block_table"] == (["B", s.max_blocks], "int64")
        assert ins["kv_pool"] == ([1, 2, s.kv_blocks, s.page_size, 2, 16], "float32")
        assert ins["gdn_pool"] == ([3, s.max_seqs, 4, 16, 8], "float32")
        assert ins["conv_pool"] == ([3, s.max_seqs, conv_dim, 3], "float32")
        assert outs["argmax"] == (["B", K], "int64") and outs["logits"] == (["B", K, 259], "float32")
        assert outs["kv_rows"] == ([1, 2, "B", K, 2, 16], "float32")
        assert outs["gdn_k"] == ([3, "B", K, 2, 16], "float32") and outs["gdn_v"] == ([3, "B", K, 4, 8], "float32")
        assert outs["gdn_g"] == outs["gdn_beta"] == ([3, "B", K, 4], "float32")
        assert outs["conv_cols"] == ([3, "B", K, conv_dim], "float32")
        assert outs["ctx_hidden"] == (["B", K, 2 * 64], "float32") and "gdn_state" not in outs
    ins, outs = _io_dicts(exported, PREFILL)
    assert ins["valid_len"] == (["B"], "int64") and ins["input_ids"] == (["B", s.prefill_chunk], "int64")
    assert outs["gdn_state"] == ([3, "B", 4, 16, 8], "float32") and "gdn_k" not in outs
    ins, outs = _io_dicts(exported, DRAFTER_BLOCK)
    assert ins["block_ids"] == (["B", 16], "int64") and ins["block_table"] == (["B", s.max_ctx_blocks], "int64")
    assert ins["dkv_pool"] == ([1, 2, s.dkv_blocks, s.page_size, 2, 16], "float32")
    assert outs["drafts"] == (["B", 15], "int64")
    ins, outs = _io_dicts(exported, DRAFTER_CTX)
    assert ins["ctx_hidden"] == (["B", s.max_append, 2 * 64], "float32")
    assert outs["dkv_rows"] == ([1, 2, "B", s.max_append, 2, 16], "float32")


@pytest.mark.parametrize("graph", GRAPHS)
def test_graph_checker_nodes_and_functions(exported, graph):
    path = os.path.join(exported, graph + ".onnx")
    onnx.checker.check_model(path, full_check=True)
    model = onnx.load(path)
    custom = [n for n in model.graph.node if n.domain == "dflash"]
    for n in custom:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        assert a["plugin_namespace"] == b"dflash" and a["plugin_version"] == b"1"
    assert {f.name for f in model.functions if f.domain == "dflash"} == {n.op_type for n in custom}
    want = {"PagedAttention"} if graph.startswith("drafter_block") else set()
    if graph.startswith("target"):
        want = {"GdnChunkWY16", "CausalConvVerify", "PagedAttention"}
    assert {n.op_type for n in custom} == want


def random_feeds(m, graph, B=2, seed=0):
    """Valid random inputs for one graph: scattered pages, non-zero pools, different seq_len per sequence."""
    rng = np.random.default_rng(seed)
    s, t = m.sizes, m.target_config
    ins, _ = m.io(graph)
    T = {i["name"]: i for i in ins}["positions"]["shape"][1]
    seq_len = np.array([0, 32] if graph == PREFILL else [37, 5], dtype=np.int64)
    feeds = {}
    for spec in ins:
        name, shape = spec["name"], [B if d == "B" else d for d in spec["shape"]]
        if name in ("input_ids", "block_ids"):
            v = rng.integers(0, t.vocab_size, shape)
        elif name == "positions":
            start = np.array([40, 60]) if graph == DRAFTER_BLOCK else seq_len
            v = start[:, None] + np.arange(T)
        elif name == "slot":
            v = np.array([1, 3])
        elif name == "seq_len":
            v = seq_len
        elif name == "block_table":
            pool = s.kv_blocks if graph.startswith("target") else s.dkv_blocks
            v = np.stack([rng.permutation(pool)[:shape[1]] for _ in range(B)])
        elif name == "valid_len":
            v = np.array([T, 7])
        elif name == "kv_start":
            v = np.array([0, 9])
        elif name == "kv_len":
            v = np.array([40, 50])
        else:  # pools, ctx_hidden
            v = rng.standard_normal(shape) * (0.2 if name == "gdn_pool" else 1.0)
        feeds[name] = np.asarray(v).astype(spec["dtype"])
    return feeds


@pytest.mark.parametrize("graph", GRAPHS)
def test_graph_ort_equals_torch(exported, ort_be, torch_be, graph):
    m = ort_be.manifest
    for seed, B in ((0, 2), (1, 1)):  # dynamic batch dim
        feeds = random_feeds(m, graph, B=2, seed=seed)
        if B == 1:
            feeds = {k: (v[:1] if k not in m.data["pools"] else v) for k, v in feeds.items()}
        got, ref = ort_be.run(graph, feeds), torch_be.run(graph, feeds)
        assert sorted(got) == sorted(ref)
        for name, r in ref.items():
            assert got[name].dtype == r.dtype and got[name].shape == r.shape, name
            if np.issubdtype(r.dtype, np.integer):
                np.testing.assert_array_equal(got[name], r, err_msg=f"{graph}/{name}")
            else:
                np.testing.assert_allclose(got[name], r, atol=1e-4, rtol=1e-4, err_msg=f"{graph}/{name}")


@pytest.fixture(scope="module")
def greedy(ort_be, torch_be):
    """Plain greedy continuation (prompt + NEW+16 tokens) on ORT, checked against the torch backend."""
    ids = ByteCodec().encode(PROMPT)
    m = ort_be.manifest
    plain = Runtime(ort_be, m.target_config, m.drafter_config, m.sizes).generate(ids, NEW + 16, spec=False)[0]
    plain_t = Runtime(torch_be, m.target_config, m.drafter_config, m.sizes).generate(ids, NEW + 16, spec=False)[0]
    assert plain == plain_t
    return ids, plain


@pytest.mark.parametrize("gamma", [1, 3, 15])
@pytest.mark.parametrize("drafter", ["oracle", "random"])
def test_lossless_on_ort(ort_be, torch_be, greedy, gamma, drafter):
    ids, plain = greedy
    m = ort_be.manifest
    outs = {}
    for name, be in (("ort", ort_be), ("torch", torch_be)):
        if drafter == "oracle":
            be = OracleDrafter(be, ids + plain)
        rt = Runtime(be, m.target_config, m.drafter_config, m.sizes)
        outs[name], st = rt.generate(ids, NEW, gamma=gamma)
        assert st.spec_steps > 0
        if drafter == "oracle":  # every draft accepted: τ = γ+1 on all full steps
            assert all(a == gamma for a in st.accepted[:-1]), st.accepted
    assert outs["ort"] == plain[:NEW] == outs["torch"]


def test_export_cli_target_only_external_data(tiny_pair, tmp_path, capsys, monkeypatch):
    from dflash_trt.cli import main
    from dflash_trt.export import onnx_export

    monkeypatch.setattr(onnx_export, "TWO_GB", 0)  # force the >2 GB path: weights as external data
    out = str(tmp_path / "exp")
    sizes = ["--max-seq-len", "64", "--kv-blocks", "8", "--prefill-chunk", "16"]
    assert main(["export", "--model", tiny_pair[0], "--k", "1", "--out", out, *sizes]) == 0
    log = capsys.readouterr().err  # progress goes to stderr
    assert "[1/2] target_k1" in log and "[2/2] target_prefill" in log and "exported 2 graphs" in log and " MB" in log
    m = Manifest.load(out)
    assert m.drafter_config is None and m.graphs == ["target_k1", "target_prefill"]
    assert m.data["graphs"]["target_k1"]["external_data"] == "target_k1.onnx.data"
    g = onnx.load(os.path.join(out, "target_k1.onnx"), load_external_data=False)
    inline = [i.name for i in g.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL and len(i.raw_data) > 4096]
    assert not inline, f"weights left inline: {inline}"
    be = make_backend("ort", manifest=out)
    rt = Runtime(be, be.tcfg, None, be.sizes)
    toks = rt.generate([1, 2, 3], 5, spec=False)[0]
    assert len(toks) == 5


def test_export_cli_bad_args(tiny_pair, tmp_path, capsys):
    from dflash_trt.export.onnx_export import main

    with pytest.raises(SystemExit):
        main(["--model", tiny_pair[0], "--k", "0,17", "--out", str(tmp_path)])
    assert "1..16" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err


# ---- bad input: manifest / graph mismatch -> ManifestError naming what differs ----------------------
def test_k_not_exported(ort_be):
    with pytest.raises(ManifestError, match=r"K=8 not exported.*\[1, 2, 4, 16\]"):
        ort_be.run("target_k8", {})
    with pytest.raises(ManifestError, match=r"K \[3, 8\] not exported"):
        ort_be.manifest.check(ks=[1, 3, 8])


def test_wrong_pool_dims(ort_be):
    m = ort_be.manifest
    other = PoolSizes(**{**m.data["sizes"], "kv_blocks": 64})
    with pytest.raises(ManifestError, match="kv_blocks: wanted 64, manifest 32"):
        m.check(sizes=other)
    rt = Runtime(ort_be, m.target_config, m.drafter_config, other)
    with pytest.raises(ManifestError, match=r"input kv_pool has shape \[1, 2, 64, .*expects \[1, 2, 32"):
        rt.generate([1, 2, 3], 4, spec=False)


def test_checkpoint_hash_differs(ort_be, tmp_path):
    from dflash_trt.export.checkpoint import checkpoint_hash
    from dflash_trt.tools.tiny import make_tiny_pair

    t1, _ = make_tiny_pair(str(tmp_path), seed=1)
    with pytest.raises(ManifestError, match="target checkpoint hash differs"):
        ort_be.manifest.check(target_hash=checkpoint_hash(t1))


def _copy(exported, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(exported, dst)
    return dst


def test_tampered_manifest(exported, tmp_path):
    d = _copy(exported, tmp_path)
    p = os.path.join(d, "manifest.json")
    data = json.load(open(p))
    data["graphs"]["target_k4"]["outputs"][1]["shape"][3] = 5
    json.dump(data, open(p, "w"))
    with pytest.raises(ManifestError, match=r"graph target_k4: output kv_rows dims .*5.* in manifest"):
        Manifest.load(d)
    os.remove(os.path.join(d, "target_k2.onnx"))
    data["graphs"]["target_k4"]["outputs"][1]["shape"][3] = 4
    json.dump(data, open(p, "w"))
    with pytest.raises(ManifestError, match="target_k2.onnx does not exist"):
        Manifest.load(d)
    with pytest.raises(ManifestError, match="no manifest"):
        Manifest.load(str(tmp_path))


def test_graph_file_does_not_match_manifest(exported, tmp_path):
    d = _copy(exported, tmp_path)
    shutil.copy(os.path.join(d, "target_k2.onnx"), os.path.join(d, "target_k1.onnx"))
    be = make_backend("ort", manifest=d)
    with pytest.raises(ManifestError, match=r"graph target_k1: .*target_k1.onnx is not the file this manifest's export "
                                            r"wrote .*re-run `dflash-trt export"):
        be.session("target_k1")
    man = json.load(open(os.path.join(d, "manifest.json")))  # even when re-recorded, its I/O gives it away
    man["graphs"]["target_k1"]["sha256"] = sha256_files([os.path.join(d, "target_k1.onnx")])
    json.dump(man, open(os.path.join(d, "manifest.json"), "w"))
    with pytest.raises(ManifestError, match=r"input input_ids dims \['B', 2\] in onnx graph, \['B', 1\] in manifest"):
        make_backend("ort", manifest=d).session("target_k1")


def test_half_precision_graphs(tiny_pair, exported, torch_be, tmp_path):
    """fp16/bf16 exports (what engines are built from): the op bodies compute in fp32 and cast back.
    fp16 on ORT vs the fp32 torch reference: max |err| <= 2e-2 * max |ref| per output, argmax agreement >= 90%.
    bf16: exported and checked (onnx.checker full_check inside export_graph); ORT cannot take bf16 numpy feeds."""
    import onnxruntime as ort
    import torch

    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.export.onnx_export import export_graph

    m32 = Manifest.load(exported)
    for dt in ("float16", "bfloat16"):
        target = load_target(tiny_pair[0], getattr(torch, dt))
        drafter = load_drafter(tiny_pair[1], target, getattr(torch, dt))
        path = str(tmp_path / f"target_k4_{dt}.onnx")
        export_graph("target_k4", target, drafter, SIZES, path, kv_dtype=dt)
        if dt == "bfloat16":
            ins = {i.name: i.type.tensor_type.elem_type for i in onnx.load(path).graph.input}
            assert ins["kv_pool"] == onnx.TensorProto.BFLOAT16
            continue
        feeds = random_feeds(m32, "target_k4")
        ref = torch_be.run("target_k4", feeds)
        f16 = {k: (v.astype(np.float16) if v.dtype == np.float32 and k != "gdn_pool" else v) for k, v in feeds.items()}
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, f16)))
        for name, r in ref.items():
            if np.issubdtype(r.dtype, np.integer):
                assert (got[name] == r).mean() >= 0.9, name
            else:
                err = np.abs(got[name].astype(np.float32) - r).max() / np.abs(r).max()
                assert err <= 2e-2, (name, err)
