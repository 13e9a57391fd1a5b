"""`dflash-trt build` on the demo-sized tiny pair, no GPU (TensorRT-RTX from pip): engines for K in {1, 16},
target_prefill and both drafter graphs with a PLUGIN_V3 layer for every dflash node; the same graphs
with the plugins unregistered (function bodies inlined); the engine records and the load-time refusals
(stale ONNX, missing plugin, wrong GPU, no TensorRT)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dflash_trt.plugins import trt_compat as C

pytestmark = pytest.mark.skipif(not C.HAVE_TRT, reason=f"no TensorRT: {C.IMPORT_ERROR}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAPHS = ["target_k1", "target_k16", "target_prefill", "drafter_ctx", "drafter_block"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from dflash_trt.export.onnx_export import ensure_export
    from dflash_trt.tools.tiny import make_tiny_pair

    root = tmp_path_factory.mktemp("trt")
    t, d = make_tiny_pair(str(root / "pair"), seed=0)
    return ensure_export(t, d, ks=[1, 16], progress=None)  # cached by checkpoint hashes + exporter source; read-only here


def _copy(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("engines"))
    return str(dst)


@pytest.fixture(scope="module")
def built(exported, tmp_path_factory):
    from dflash_trt.engines.build import main

    d = _copy(exported, tmp_path_factory.mktemp("with_plugins") / "m")
    assert main(["--manifest", d, "--k", "1,16", "--timing-cache", os.path.join(d, "timing.cache")]) == 0
    return d


def _manifest(d):
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)


def test_every_dflash_node_is_a_plugin_layer(built, capsys):
    from dflash_trt.engines.network import dflash_nodes

    m = _manifest(built)
    assert sorted(m["engines"]) == sorted(GRAPHS)
    for g in GRAPHS:
        rec = m["engines"][g]
        nodes = dict(dflash_nodes(os.path.join(built, m["graphs"][g]["file"])))
        assert {op: p["layers"] for op, p in rec["plugins"].items()} == nodes, g
        assert rec["inlined_ops"] == {}
        assert all(p["namespace"] == "dflash" and p["version"] == "1" for p in rec["plugins"].values())
        assert os.path.getsize(os.path.join(built, rec["file"])) == rec["bytes"] > 0
        assert rec["trt"] == {"flavour": C.FLAVOUR, "version": C.VERSION}
        assert rec["k"] == {"target_k1": 1, "target_k16": 16}.get(g)
        assert len(rec["onnx_sha256"]) == 64 and rec["compute_capabilities"]
        assert rec["io"]["inputs"] == m["graphs"][g]["inputs"] and rec["io"]["outputs"] == m["graphs"][g]["outputs"]
    nodes_k1 = m["engines"]["target_k1"]["plugins"]
    assert set(nodes_k1) == {"GdnChunkWY16", "CausalConvVerify", "PagedAttention"}
    assert "PagedAttention" in m["engines"]["drafter_block"]["plugins"]
    print({g: (m["engines"][g]["bytes"], m["engines"][g]["build_seconds"]) for g in GRAPHS})


def test_unregistered_plugins_inline_function_bodies(exported, built, tmp_path):
    from dflash_trt.engines.build import build_engines
    from dflash_trt.engines.network import dflash_nodes
    from dflash_trt.plugins import trt_plugins

    d = _copy(exported, tmp_path / "m")
    lines = []
    man = build_engines(d, ks=[1, 16], plugins=False, progress=lines.append)
    assert trt_plugins.registered_names() == set()
    with_plugins = _manifest(built)["engines"]
    for g in GRAPHS:
        rec = man.data["engines"][g]
        nodes = dict(dflash_nodes(man.graph_path(g)))
        assert rec["plugins"] == {} and rec["inlined_ops"] == nodes
        if nodes:
            assert rec["layers"] > with_plugins[g]["layers"]  # the bodies' ops replaced each plugin layer
    assert any("inlined" in line for line in lines) and len([x for x in lines if x.startswith("[")]) == len(GRAPHS)
    trt_plugins.register()


def test_inlined_body_while_plugins_expected_fails_loudly(tmp_path):
    import numpy as np

    from dflash_trt.engines.network import BuildError, parse_graph
    from dflash_trt.plugins.onnx_functions import single_op_model

    r = np.random.default_rng(0).standard_normal
    ins = {"x": r((1, 2, 8)).astype(np.float32), "conv_state": r((1, 8, 3)).astype(np.float32),
           "weight": r((8, 4)).astype(np.float32)}
    m = single_op_model("CausalConvVerify", ins)
    node = m.graph.node[0]
    keep = [a for a in node.attribute if a.name not in ("plugin_namespace", "plugin_version")]
    del node.attribute[:]
    node.attribute.extend(keep)  # without plugin_namespace TensorRT inlines the function body
    path = str(tmp_path / "conv.onnx")
    import onnx

    onnx.save(m, path)
    trt = C.require()
    with pytest.raises(BuildError, match="inlined the ONNX function bodies of CausalConvVerifyx1"):
        parse_graph(trt.Builder(trt.Logger(trt.Logger.ERROR)), path, plugins=True)


def test_stale_or_tampered_engines_refused(built, tmp_path):
    from dflash_trt.engines.load import EngineError, check_device, check_engine, check_io

    d = _copy(built, tmp_path / "m")
    shutil.copytree(os.path.join(built, "engines"), os.path.join(d, "engines"))
    rec = check_engine(d, "target_k1", allow_unsupported_shapes=True)
    with pytest.raises(EngineError, match="kernels cannot run"):  # tiny dims: dk=16, head_dim=16
        check_engine(d, "target_k1")
    m = _manifest(d)
    m["engines"]["target_k1"]["onnx_sha256"] = "0" * 64
    m["engines"]["drafter_block"]["plugins"]["Foo"] = {"namespace": "dflash", "version": "1", "layers": 1}
    m["engines"]["drafter_ctx"]["trt"]["version"] = "0.0.1"
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(m, f)
    with pytest.raises(EngineError, match="stale"):
        check_engine(d, "target_k1", allow_unsupported_shapes=True)
    with pytest.raises(EngineError, match="plugin dflash::Foo"):
        check_engine(d, "drafter_block", allow_unsupported_shapes=True)
    with pytest.raises(EngineError, match="built with .* 0.0.1"):
        check_engine(d, "drafter_ctx")
    import onnx  # re-exported graph: same manifest, different ONNX bytes

    path = os.path.join(d, "target_k16.onnx")
    model = onnx.load(path)
    model.doc_string = "changed"
    onnx.save(model, path)
    with pytest.raises(EngineError, match="stale"):
        check_engine(d, "target_k16", allow_unsupported_shapes=True)
    os.remove(os.path.join(d, m["engines"]["target_prefill"]["file"]))
    with pytest.raises(EngineError, match="missing"):
        check_engine(d, "target_prefill", allow_unsupported_shapes=True)
    io = m["engines"]["drafter_ctx"]["io"]  # what load_engine compares a deserialized engine's tensors with
    check_io(d, "drafter_ctx", io)
    bad = json.loads(json.dumps(io))
    bad["outputs"][0]["dtype"] = "float16"
    with pytest.raises(EngineError, match="dkv_rows dtype float16 in engine"):
        check_io(d, "drafter_ctx", bad)
    if C.IS_RTX:
        with pytest.raises(EngineError, match="Hopper"):
            check_device(rec, (9, 0))
    with pytest.raises(EngineError, match="built for CC"):
        check_device({**rec, "compute_capabilities": ["8.6"]}, (8, 9))
    assert check_device(rec, (8, 6)) == (8, 6)


def test_load_without_gpu_names_what_is_needed(built):
    from dflash_trt.engines.load import EngineError, load_engine
    from dflash_trt.engines.network import local_gpu_cc

    if local_gpu_cc() is not None:
        pytest.skip("a GPU is present")
    with pytest.raises(EngineError, match="no CUDA GPU found"):
        load_engine(built, "drafter_ctx")


def test_cc_rules():
    from dflash_trt.engines.network import BuildError, parse_cc, resolve_ccs

    assert parse_cc("80,8.6,sm_89,120") == [(8, 0), (8, 6), (8, 9), (12, 0)]
    with pytest.raises(BuildError):
        parse_cc("eighty")
    if C.IS_RTX:
        assert resolve_ccs(None, None) == [(8, 0), (8, 6), (8, 9), (12, 0), (12, 1)]
        assert resolve_ccs(None, (8, 9)) == [(8, 9)]
        with pytest.raises(BuildError, match="Hopper"):
            resolve_ccs(None, (9, 0))
        with pytest.raises(BuildError, match="8.0"):
            resolve_ccs([(7, 5)], None)
        fp8 = "g holds 1 FP8 weights (first 'w')"
        assert resolve_ccs(None, None, fp8=fp8) == [(8, 9), (12, 0), (12, 1)]
        with pytest.raises(BuildError, match=r"first 'w'\); TensorRT builds float8_e4m3fn only .* drop 8\.6 from"):
            resolve_ccs(None, (8, 6), fp8=fp8)


def _cli(args, env=None):
    return subprocess.run([sys.executable, "-m", "dflash_trt.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, timeout=300)


def test_cli_errors(exported, tmp_path):
    r = _cli(["build", "--manifest", str(tmp_path / "nothing")])
    assert r.returncode == 2 and "no manifest" in r.stderr and "Traceback" not in r.stderr
    r = _cli(["build", "--manifest", exported, "--k", "3"])
    assert r.returncode == 2 and "K [3] not exported" in r.stderr
    r = _cli(["build", "--manifest", exported], env={"DFLASH_TRT_FLAVOUR": "none_such"})
    assert r.returncode == 2 and "tensorrt-rtx" in r.stderr and "Traceback" not in r.stderr
    if C.IS_RTX:
        r = _cli(["build", "--manifest", exported, "--target-cc", "90"])
        assert r.returncode == 2 and "full TensorRT" in r.stderr
