"""A cache hit whose recorded checkpoint folder is gone (the entry was exported from another copy of the same
weights) records the caller's folder, so `compare` and rebuilds find the checkpoints."""
import os
import shutil
import time

import pytest

from dflash_trt.export.onnx_export import ensure_export
from dflash_trt.manifest import Manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")


def test_a_hit_from_a_vanished_copy_records_the_callers_dirs(tmp_path):
    from dflash_trt.tools.tiny import make_tiny_pair

    kept = tmp_path / "kept"
    target, drafter = make_tiny_pair(str(kept), seed=0)
    copy = tmp_path / "copy"
    shutil.copytree(kept, copy)
    ct, cd = (str(copy / os.path.relpath(d, kept)) for d in (target, drafter))
    cache = str(tmp_path / "cache")
    first = ensure_export(ct, cd, ks=[1], cache_dir=cache, progress=None)
    assert Manifest.load(first).data["target"]["dir"] == ct
    shutil.rmtree(copy)
    again = ensure_export(target, drafter, ks=[1], cache_dir=cache, progress=None)
    assert again == first
    data = Manifest.load(again).data
    assert data["target"]["dir"] == target and data["drafter"]["dir"] == drafter
    assert ensure_export(target, drafter, ks=[1], cache_dir=cache, progress=None) == first  # still a valid hit


def test_one_entry_per_checkpoint_grows_by_the_widths_asked(tmp_path):
    """Callers asking for other verify widths share one cache entry: a missing width re-stages it with the graphs
    it had taken over as they are (same files, same records) and only the new ones traced; a subset is a hit."""
    from dflash_trt.tools.tiny import make_tiny_pair

    pair = make_tiny_pair(str(tmp_path / "tiny"), seed=0)[0], None  # the target's graphs are enough here
    cache = str(tmp_path / "cache")
    said = []
    first = ensure_export(*pair, ks=[1], cache_dir=cache, progress=said.append)
    m1 = Manifest.load(first)
    ino = os.stat(m1.graph_path("target_k1")).st_ino
    said.clear()
    grown = ensure_export(*pair, ks=[1, 4], cache_dir=cache, progress=said.append)
    m2 = Manifest.load(grown)
    assert grown == first and m2.ks == [1, 4]
    assert os.stat(m2.graph_path("target_k1")).st_ino == ino  # taken over, not traced again
    assert m2.data["graphs"]["target_k1"] == m1.data["graphs"]["target_k1"]
    traced = [line for line in said if line.startswith("[")]
    assert any("target_k4" in line for line in traced) and not any("target_k1 " in line for line in traced)
    assert any("lacks verify widths [4]" in line for line in said)
    for g in m2.graphs:
        m2.verify_graph(g)
    said.clear()
    assert ensure_export(*pair, ks=[4], cache_dir=cache, progress=said.append) == first and said == []
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(first), os.path.basename(first) + ".lock"])


@pytest.mark.slow  # six verify widths of the shipped pair exported on ORT: ~6 min on 2 cores; the tiny-pair test
# above checks that callers share and grow one entry
def test_demo_generate_and_bench_share_one_export(tmp_path, monkeypatch, capsys):
    """The commands a new user runs first (demo, generate plain / DFlash / --gamma 7, bench generate on ORT) export
    the shipped pair once between them: one cache entry, grown by the widths they ask for."""
    from dflash_trt.cli import main

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    pair = ["--model", os.path.join(MODELS, "target"), "--drafter", os.path.join(MODELS, "drafter")]
    gen = ["generate", *pair, "--prompt", "def f(x):", "--max-new-tokens", "4", "--backend", "ort"]
    assert main(["demo", "--max-new-tokens", "4"]) == 0
    assert main(gen) == 0 and main([*gen, "--no-spec"]) == 0 and main([*gen, "--gamma", "7"]) == 0
    assert main(["bench", "generate", *pair, "--backend", "ort", "--max-new-tokens", "4"]) == 0
    entries = [n for n in os.listdir(tmp_path / "cache") if n.startswith("onnx-") and not n.endswith(".lock")]
    assert len(entries) == 1, entries
    assert Manifest.load(str(tmp_path / "cache" / entries[0])).ks == [1, 2, 3, 4, 8, 16]


def test_a_users_export_dir_runs_instead_of_the_cache(tmp_path, monkeypatch, capsys):
    """`generate --engines DIR` / `LLM(engines=DIR)` run a `dflash-trt export --out DIR` directory (nothing goes to
    the cache); one of other checkpoints or without the widths asked is refused in one line."""
    from dflash_trt.api.llm import LLM
    from dflash_trt.api.params import SamplingParams
    from dflash_trt.cli import main
    from dflash_trt.tools.tiny import make_tiny_pair

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    t, d = make_tiny_pair(str(tmp_path / "tiny"), seed=0)
    out = str(tmp_path / "exp")
    assert main(["export", "--model", t, "--drafter", d, "--k", "1,16", "--out", out]) == 0
    gen = ["generate", "--model", t, "--drafter", d, "--prompt", "def f(x):", "--max-new-tokens", "8"]
    assert main([*gen, "--backend", "torch"]) == 0
    ref = capsys.readouterr().out
    assert main([*gen, "--backend", "ort", "--engines", out]) == 0
    assert capsys.readouterr().out == ref
    assert not os.path.exists(tmp_path / "cache") or not any(n.startswith("onnx-") for n in os.listdir(tmp_path / "cache"))
    llm = LLM(t, d, backend="ort", engines=out)
    assert llm.generate("def f(x):", SamplingParams(max_tokens=8))[0].outputs[0].text.strip() == ref.strip()
    assert main([*gen, "--backend", "ort", "--engines", out, "--gamma", "7"]) == 2
    assert "K [8] not exported" in capsys.readouterr().err
    assert main([*gen, "--backend", "torch", "--engines", out]) == 2
    assert "runs on the ort or trt backend" in capsys.readouterr().err
    _serve_engines(out, t, d, ref, capsys)


def _serve_engines(out, t, d, ref, capsys):
    """`serve --engines DIR` loads that directory as generate does (its engine loop answers, refused alike)."""
    import argparse

    from dflash_trt.api.params import SamplingParams
    from dflash_trt.cli import main
    from dflash_trt.serve.command import add_args, build_state

    pytest.importorskip("fastapi")
    p = argparse.ArgumentParser()
    add_args(p)
    state = build_state(p.parse_args(["--model", t, "--drafter", d, "--backend", "ort", "--engines", out]))
    try:
        assert state.loop.engine.rt.backend.manifest.root == os.path.abspath(out)
        tracks = state.loop.submit([state.codec.encode("def f(x):")], SamplingParams(max_tokens=8), None).result(60)
        deadline = time.time() + 60
        while not tracks[0].finished and time.time() < deadline:
            time.sleep(0.05)
        assert tracks[0].text.strip() == ref.strip()
    finally:
        state.loop.close()
    assert main(["serve", "--model", t, "--drafter", d, "--backend", "ort", "--engines", out, "--gamma", "7"]) == 2
    assert "K [8] not exported" in capsys.readouterr().err
