"""`dflash-trt compare`: torch vs ort on the tiny pair passes (top-k KL < 1e-6, exit 0); a corrupted weight
in one graph fails it (exit 1) naming the graph/output; bad input exits 2 with the reason."""
import json
import os
import shutil

import numpy as np
import onnx
import pytest

from test_onnx_common import exported, tiny_pair  # noqa: F401

pytest.importorskip("onnxruntime")
pytest.importorskip("polygraphy")
from dflash_trt.hashing import sha256_files  # noqa: E402
from dflash_trt.tools.compare import compare, main, topk_kl  # noqa: E402


def test_topk_kl():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 50))
    assert topk_kl(a, a) == 0.0
    assert topk_kl(a, a + 1e-7 * rng.standard_normal(a.shape)) < 1e-10
    b = a.copy()
    b[:, np.argmax(a, -1)] -= 3.0
    assert topk_kl(a, b) > 1e-2


def test_compare_torch_vs_ort_passes(exported, tiny_pair, capsys):
    # the export is a cache entry shared across runs: the checkpoints are named, not taken from its record
    pair = ["--model", tiny_pair[0], "--drafter", tiny_pair[1]]
    assert main(["--manifest", exported, "--backends", "torch,ort", "--steps", "4", *pair]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "target_k16/logits" in out and "drafter_block/drafts" in out
    rep = compare(exported, ["torch", "ort"], prompts=["hello there"], steps=4, model_dir=tiny_pair[0],
                  drafter_dir=tiny_pair[1])
    assert rep.ok and rep.kl and max(k for *_, k in rep.kl) < 1e-6
    graphs = {s.graph for s in rep.stats.values()}
    assert graphs == {"target_prefill", "target_k1", "target_k2", "target_k4", "target_k16", "drafter_ctx",
                      "drafter_block", "drafter_block_b2", "drafter_block_b4"}  # a block of γ+1 slots per K
    assert all(s.max_abs <= 1e-4 for s in rep.stats.values())


def test_compare_names_corrupted_output(exported, tiny_pair, tmp_path, capsys):
    d = str(tmp_path / "bad")
    shutil.copytree(exported, d)
    path = os.path.join(d, "target_k2.onnx")
    m = onnx.load(path)
    w = max(m.graph.initializer, key=lambda i: int(np.prod(i.dims)))  # the largest weight (embedding / lm_head)
    arr = onnx.numpy_helper.to_array(w).copy()
    arr.reshape(-1)[::7] += 0.5
    w.CopyFrom(onnx.numpy_helper.from_array(arr, w.name))
    onnx.save(m, path)
    man = json.load(open(os.path.join(d, "manifest.json")))  # re-record the graph: the numeric check is tested here
    man["graphs"]["target_k2"]["sha256"] = sha256_files([path])
    json.dump(man, open(os.path.join(d, "manifest.json"), "w"))
    pair = ["--model", tiny_pair[0], "--drafter", tiny_pair[1]]
    assert main(["--manifest", d, "--backends", "torch,ort", "--steps", "3", *pair]) == 1
    out = capsys.readouterr().out
    assert "FAIL: target_k2/logits (ort vs torch)" in out
    assert "target_k1/logits" in out and "FAIL: target_k1" not in out  # untouched graphs still pass


def test_compare_bad_input(exported, tmp_path, capsys):
    from dflash_trt.tools.tiny import make_tiny_pair

    t1, d1 = make_tiny_pair(str(tmp_path), seed=1)
    assert main(["--manifest", exported, "--backends", "torch,ort", "--model", t1, "--drafter", d1]) == 2
    assert "target checkpoint hash differs" in capsys.readouterr().err
    assert main(["--manifest", str(tmp_path / "none"), "--backends", "torch,ort"]) == 2
    assert "no manifest" in capsys.readouterr().err
    assert main(["--manifest", exported, "--backends", "ort"]) == 2
    assert "at least two backends" in capsys.readouterr().err
