"""Exports are atomic and self-describing: an interrupted export never leaves a directory any
consumer accepts, a graph the export did not write is refused by name, and the export cache is process-safe
(one export for concurrent cold starts, damaged entries rebuilt, dead leftovers removed)."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("onnxruntime")
from dflash_trt.abi import PoolSizes  # noqa: E402
from dflash_trt.export import onnx_export  # noqa: E402
from dflash_trt.manifest import Manifest, ManifestError  # noqa: E402
from dflash_trt.tools.tiny import make_tiny_pair  # noqa: E402

SIZES = PoolSizes(kv_blocks=16, max_seq_len=128, max_seqs=2, dkv_blocks=16, ctx_window=32, prefill_chunk=16)
KS = (1,)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Two different targets, no drafter: two graphs an export (target_k1, target_prefill) keeps this fast."""
    d = tmp_path_factory.mktemp("pairs")
    return (make_tiny_pair(str(d / "a"), seed=0)[0], None), (make_tiny_pair(str(d / "b"), seed=1)[0], None)


@pytest.fixture(scope="module")
def old_export(pairs, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("old") / "exp")
    onnx_export.export_graphs(*pairs[0], out, KS, SIZES, check=False, progress=None)
    return out


def _all_graphs_verify(out):
    m = Manifest.load(out)
    for g in m.graphs:
        m.verify_graph(g)
    return m


def _fail_after(monkeypatch, n):
    real, calls = onnx_export.export_graph, []

    def flaky(*a, **k):
        if len(calls) == n:
            raise KeyboardInterrupt("killed")  # what an interrupted export leaves behind is what is tested
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(onnx_export, "export_graph", flaky)


# 2 graphs: killed before each, and after the last (before the manifest); between the two: slow (the same path)
@pytest.mark.parametrize("n", [0, pytest.param(1, marks=pytest.mark.slow), 2])
def test_interrupted_export_into_fresh_dir_leaves_nothing(pairs, tmp_path, monkeypatch, n):
    out = str(tmp_path / "exp")
    _fail_after(monkeypatch, n)
    if n == 2:  # all graphs written: interrupt the manifest write instead
        monkeypatch.setattr(Manifest, "save", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        onnx_export.export_graphs(*pairs[1], out, KS, SIZES, check=False, progress=None)
    assert not os.path.exists(out) and os.listdir(tmp_path) == []


# before each graph, and after the last one (before the manifest); between the two: slow (the same path)
@pytest.mark.parametrize("n", [0, pytest.param(1, marks=pytest.mark.slow), 2])
def test_interrupted_export_over_an_older_one_keeps_the_older(pairs, old_export, tmp_path, monkeypatch, n):
    import shutil

    out = str(tmp_path / "exp")
    shutil.copytree(old_export, out)
    before = Manifest.load(out).data["target"]["hash"]
    _fail_after(monkeypatch, n)
    if n == 2:
        monkeypatch.setattr(Manifest, "save", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        onnx_export.export_graphs(*pairs[1], out, KS, SIZES, check=False, progress=None)
    m = _all_graphs_verify(out)  # the older export, complete and consistent
    assert m.data["target"]["hash"] == before
    monkeypatch.undo()
    onnx_export.export_graphs(*pairs[1], out, KS, SIZES, check=False, progress=None)  # the next run recovers
    assert _all_graphs_verify(out).data["target"]["hash"] != before


def test_foreign_graph_refused_by_every_consumer(pairs, old_export, tmp_path):
    import shutil

    from dflash_trt.runtime.backends.ort_backend import OrtBackend

    out = str(tmp_path / "exp")
    shutil.copytree(old_export, out)
    other = str(tmp_path / "other")
    onnx_export.export_graphs(*pairs[1], other, KS, SIZES, check=False, progress=None)
    # a graph of another export mixed in
    shutil.copy(os.path.join(other, "target_k1.onnx"), os.path.join(out, "target_k1.onnx"))
    with pytest.raises(ManifestError, match=r"graph target_k1: .*target_k1.onnx is not the file this manifest's "
                                            r"export wrote .*re-run `dflash-trt export"):
        OrtBackend(out).session("target_k1")
    OrtBackend(out).session("target_prefill")  # an untouched graph still loads
    with open(os.path.join(out, "target_prefill.onnx"), "r+b") as f:  # truncated
        f.truncate(100)
    with pytest.raises(ManifestError, match="graph target_prefill"):
        Manifest.load(out).verify_graph("target_prefill")


def test_export_refuses_a_directory_of_other_files(pairs, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(onnx_export.ExportError, match=r"holds files that are not a dflash-trt export's \(notes.txt\)"):
        onnx_export.export_graphs(*pairs[0], str(tmp_path), KS, SIZES, check=False, progress=None)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_cache_damaged_entry_rebuilt_and_dead_leftovers_removed(pairs, tmp_path):
    msgs = []
    out = onnx_export.ensure_export(*pairs[0], KS, SIZES, cache_dir=str(tmp_path), progress=msgs.append)
    assert any("exported 2 graphs" in m for m in msgs)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = f"{out}.tmp{dead.pid}.abcd"
    os.makedirs(leftover)
    with open(os.path.join(out, "target_prefill.onnx"), "r+b") as f:
        f.truncate(1000)
    msgs.clear()
    assert onnx_export.ensure_export(*pairs[0], KS, SIZES, cache_dir=str(tmp_path), progress=msgs.append) == out
    assert any("is damaged" in m and "target_prefill" in m for m in msgs), msgs
    assert any("exported 2 graphs" in m for m in msgs)
    assert not os.path.exists(leftover)
    _all_graphs_verify(out)
    msgs.clear()  # a hit: nothing written, nothing said
    onnx_export.ensure_export(*pairs[0], KS, SIZES, cache_dir=str(tmp_path), progress=msgs.append)
    assert msgs == []
    from dflash_trt.owned import MARKER, read_marker

    os.remove(os.path.join(out, MARKER))  # an entry of an older dflash-trt: the cache is ours, it is exported again
    assert onnx_export.ensure_export(*pairs[0], KS, SIZES, cache_dir=str(tmp_path), progress=msgs.append) == out
    assert any("has no dflash-trt ownership marker" in m for m in msgs), msgs
    assert read_marker(out)["kind"] == "export"


RACE = """
import sys
from dflash_trt.abi import PoolSizes
from dflash_trt.export.onnx_export import ensure_export
s = PoolSizes(kv_blocks=16, max_seq_len=128, max_seqs=2, dkv_blocks=16, ctx_window=32, prefill_chunk=16)
print("OUT", ensure_export(sys.argv[1], None, (1,), s, cache_dir=sys.argv[2]), flush=True)
"""


def test_concurrent_cold_starts_export_once(pairs, tmp_path):
    cache = str(tmp_path / "cache")
    procs = [subprocess.Popen([sys.executable, "-c", RACE, pairs[0][0], cache], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("exported 2 graphs") for o in outs) == 1, outs
    assert sum("waiting for another process" in o for o in outs) >= 1, outs
    dirs = {line.split()[1] for o in outs for line in o.splitlines() if line.startswith("OUT ")}
    assert len(dirs) == 1
    out = dirs.pop()
    _all_graphs_verify(out)
    assert [f for f in os.listdir(cache) if not f.endswith(".lock")] == [os.path.basename(out)]  # no leftovers


def test_killed_export_process_leaves_old_export_usable(pairs, old_export, tmp_path):
    import shutil

    out = str(tmp_path / "exp")
    shutil.copytree(old_export, out)
    sizes = ["--kv-blocks", "16", "--max-seq-len", "128", "--max-seqs", "2", "--dkv-blocks", "16", "--ctx-window", "32",
             "--prefill-chunk", "16"]
    p = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "export", "--model", pairs[1][0], "--k", "1", "--out", out,
                          "--no-check", *sizes],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:  # SIGKILL right after the first graph is written
        if line.startswith("[1/"):
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(0.1)
    assert _all_graphs_verify(out).data["target"]["hash"] == Manifest.load(old_export).data["target"]["hash"]


def test_read_only_cache_hit_works_and_miss_is_one_line(pairs, tmp_path, monkeypatch):
    """A cache the process may not write (simulated: as root chmod does not stop writes) serves a hit without
    writing anything and refuses a miss with one line naming the cache and DFLASH_TRT_CACHE."""
    import builtins

    cache = str(tmp_path / "ro")
    out = onnx_export.ensure_export(*pairs[0], KS, SIZES, cache_dir=cache, progress=None)
    real_open, real_replace, real_makedirs = builtins.open, os.replace, os.makedirs
    writes = []

    def guard(path, *a):
        if str(path).startswith(cache):
            writes.append(str(path))
            raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(builtins, "open", lambda p, mode="r", *a, **k: (
        guard(p) if any(c in mode for c in "wax+") else None) or real_open(p, mode, *a, **k))
    monkeypatch.setattr(os, "replace", lambda s, d, *a, **k: guard(d) or real_replace(s, d, *a, **k))
    monkeypatch.setattr(os, "makedirs", lambda p, *a, **k: guard(os.path.join(p, "x")) or real_makedirs(p, *a, **k))
    assert onnx_export.ensure_export(*pairs[0], KS, SIZES, cache_dir=cache, progress=None) == out
    assert writes == []  # a hit wrote nothing
    other = PoolSizes(**{**SIZES.__dict__, "kv_blocks": 17})
    with pytest.raises(onnx_export.ExportError, match=rf"cannot write the export cache {cache} \(set DFLASH_TRT_CACHE "
                                                      r"to use another directory\): Permission denied"):
        onnx_export.ensure_export(*pairs[0], KS, other, cache_dir=cache, progress=None)


HAMMER = """
import sys, time
from dflash_trt.abi import PoolSizes
from dflash_trt.export.onnx_export import ensure_export
from dflash_trt.manifest import Manifest
warm, cold, cache, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
s = PoolSizes(kv_blocks=16, max_seq_len=128, max_seqs=2, dkv_blocks=16, ctx_window=32, prefill_chunk=16)
outs, t_end, n = set(), time.time() + seconds, 0
outs.add(ensure_export(cold, None, (1,), s, cache_dir=cache))
while time.time() < t_end or n < 3:
    m = Manifest.load(ensure_export(warm, None, (1,), s, cache_dir=cache))  # a hit, verified, read only
    [m.verify_graph(g) for g in m.graphs]
    n += 1
print("HITS", n, "OUT", sorted(outs), flush=True)
"""


@pytest.mark.slow  # 20 s of four processes; test_concurrent_cold_starts_export_once races a cold cache in the suite
def test_processes_racing_on_a_warm_and_a_cold_cache(pairs, tmp_path):
    """Four processes for RACE_SECONDS (default 20; a minute with DFLASH_TRT_RACE_SECONDS=60): each
    exports the cold entry once (one of them does, the others wait) and then hits the warm one in a loop."""
    cache = str(tmp_path / "cache")
    onnx_export.ensure_export(pairs[0][0], None, KS, SIZES, cache_dir=cache, progress=None)  # warm
    seconds = os.environ.get("DFLASH_TRT_RACE_SECONDS", "20")
    procs = [subprocess.Popen([sys.executable, "-c", HAMMER, pairs[0][0], pairs[1][0], cache, seconds],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("exported 2 graphs") for o in outs) == 1, outs  # the cold entry, once
    hits = [int(o.split("HITS ")[1].split()[0]) for o in outs]
    assert min(hits) >= 3, hits
    entries = [f for f in os.listdir(cache) if not f.endswith(".lock")]
    assert len(entries) == 2, entries  # warm + cold, no leftovers
    for e in entries:
        _all_graphs_verify(os.path.join(cache, e))


@pytest.mark.parametrize("sub", ["build", "compare"])
def test_garbage_graph_is_one_line_on_the_cli(old_export, tmp_path, capsys, sub):
    import shutil

    from dflash_trt.cli import main

    d = str(tmp_path / "exp")
    shutil.copytree(old_export, d)
    with open(os.path.join(d, "target_k1.onnx"), "wb") as f:
        f.write(b"not an onnx file")
    args = ["--manifest", d] + (["--backends", "torch,ort"] if sub == "compare" else [])
    assert main([sub, *args]) == 2
    err = capsys.readouterr().err.strip()
    errors = [ln for ln in err.splitlines() if "error" in ln]  # progress lines share stderr
    assert "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"dflash-trt {sub}: error:") and "target_k1" in errors[0], err
