"""Nothing a user owns is ever deleted, and concurrent writers lose nothing: snapshots, exports and engines are
written only into empty/new directories or outputs dflash-trt marked as its own (dflash_trt.owned); temporaries
of killed writers are removed on the next write; concurrent manifest updates are merged under the entry lock."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from dflash_trt.abi import PoolSizes
from dflash_trt.export import onnx_export
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.manifest import Manifest
from dflash_trt.owned import MARKER, read_marker
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.host import HostDevice
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.runtime.snapshot import SnapshotError, read_meta
from dflash_trt.tools.tiny import make_tiny_pair

SIZES = PoolSizes(kv_blocks=16, max_seq_len=128, max_seqs=2, dkv_blocks=16, ctx_window=32, prefill_chunk=16)
SIZE_ARGS = ["--kv-blocks", "16", "--max-seq-len", "128", "--max-seqs", "2", "--dkv-blocks", "16",
             "--ctx-window", "32", "--prefill-chunk", "16"]
USER_FILES = {"meta.json": b'{"mine": 1}', "thesis.tex": b"\\section{Intro}", "sub/data.csv": b"a,b\n1,2\n"}


def _user_dir(d, files=USER_FILES):
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(data)
    return str(d)


def _unchanged(d, files=USER_FILES):
    for rel, data in files.items():
        with open(os.path.join(d, rel), "rb") as f:
            assert f.read() == data, rel


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3)


@pytest.fixture
def live(dirs):
    """(runtime, prefilled sequence) of the tiny pair on host pools."""
    import torch

    t = load_target(dirs[0], torch.float32)
    d = load_drafter(dirs[1], t, torch.float32)
    rt = Runtime(TorchBackend(t, d), t.cfg, d.cfg, SIZES, device=HostDevice())
    seq = rt.add_sequence([int(x) for x in np.random.default_rng(0).integers(0, 250, 9)])
    rt.prefill(seq)
    return rt, seq


def _free(rt):
    return rt.kv_alloc.num_free, rt.dkv_alloc.num_free, rt.slots.num_free


def test_snapshot_into_a_user_directory_is_refused(live, tmp_path):
    rt, seq = live
    u = _user_dir(tmp_path / "U")
    with pytest.raises(SnapshotError) as e:
        rt.save_sequence(seq, u)
    assert str(e.value) == (f"{u}: holds files that are not a dflash-trt snapshot's (meta.json, sub, sub/data.csv "
                            "and 1 more); refusing to replace it: choose an empty or new directory")
    _unchanged(u)
    assert sorted(os.listdir(tmp_path)) == ["U"]  # no temporary left beside it
    own = str(tmp_path / "snap")
    rt.save_sequence(seq, own)
    rt.save_sequence(seq, own)  # our own snapshot is replaced
    assert sorted(os.listdir(own)) == sorted([MARKER, "meta.json", "state.safetensors"])
    with open(os.path.join(own, "notes.txt"), "w") as f:  # ... until a user puts a file into it
        f.write("mine")
    with pytest.raises(SnapshotError, match=r"snap: holds files that are not a dflash-trt snapshot's \(notes.txt\)"):
        rt.save_sequence(seq, own)
    assert open(os.path.join(own, "notes.txt")).read() == "mine"
    assert read_meta(own)["seq"]["seq_len"] == seq.seq_len


def test_snapshot_bad_paths_and_extra_are_one_line(live, tmp_path):
    rt, seq = live
    (tmp_path / "somefile").write_text("mine")
    with pytest.raises(SnapshotError, match=r"somefile/x: cannot create its parent directory: "):
        rt.save_sequence(seq, str(tmp_path / "somefile" / "x"))
    assert (tmp_path / "somefile").read_text() == "mine"
    with pytest.raises(SnapshotError, match=r"extra is not JSON-serialisable .*nothing written"):
        rt.save_sequence(seq, str(tmp_path / "s"), extra={"t": object()})
    assert sorted(os.listdir(tmp_path)) == ["somefile"]  # refused before anything was written
    snap = str(tmp_path / "s")
    rt.save_sequence(seq, snap)
    os.remove(os.path.join(snap, "meta.json"))
    os.mkdir(os.path.join(snap, "meta.json"))
    with pytest.raises(SnapshotError, match=r"meta.json: cannot read \(Is a directory\)"):
        read_meta(snap)
    before = _free(rt)
    with pytest.raises(SnapshotError, match=r"meta.json: cannot read"):
        rt.restore_sequence(snap)
    assert _free(rt) == before
    snap2 = str(tmp_path / "s2")
    rt.save_sequence(seq, snap2)
    os.remove(os.path.join(snap2, "state.safetensors"))
    os.mkdir(os.path.join(snap2, "state.safetensors"))
    with pytest.raises(SnapshotError, match=r"state.safetensors: cannot be read \(Is a directory\)"):
        rt.restore_sequence(snap2)
    assert _free(rt) == before


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("exp")), seed=0)[0]


def _export_cli(target, out):
    return [sys.executable, "-m", "dflash_trt.cli", "export", "--model", target, "--k", "1", "--out", out,
            "--no-check", *SIZE_ARGS]


def test_export_into_a_user_directory_is_refused(target, tmp_path):
    files = {"my_resnet.onnx": b"x\n", "engines/prod.engine": b"y\n"}
    u = _user_dir(tmp_path / "U", files)
    p = subprocess.run(_export_cli(target, u), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip() == (f"dflash-trt export: error: {u}: holds files that are not a dflash-trt export's "
                                "(engines, engines/prod.engine, my_resnet.onnx); refusing to replace it: "
                                "choose an empty or new directory"), p.stderr
    _unchanged(u, files)
    assert sorted(os.listdir(tmp_path)) == ["U"]


def test_killed_export_leftover_removed_live_and_foreign_kept(target, tmp_path):
    out = str(tmp_path / "exp")
    p = subprocess.Popen(_export_cli(target, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:  # SIGKILL right after the first graph is written
        if line.startswith("[1/"):
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed = [f for f in os.listdir(tmp_path) if f.startswith(f"exp.tmp{p.pid}.")]
    assert len(killed) == 1 and not os.path.exists(out)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = os.path.join(tmp_path, f"exp.tmp{sleeper.pid}.0123abcd")  # a live export's staging dir
        os.makedirs(busy)
        with open(os.path.join(busy, MARKER), "w") as f:
            json.dump({"product": "dflash-trt", "kind": "export", "pid": sleeper.pid, "host": socket.gethostname(),
                       "entries": []}, f)
        foreign = os.path.join(tmp_path, f"exp.tmp{p.pid}.89abcdef")  # our naming, but no marker: not ours
        os.makedirs(foreign)
        onnx_export.export_graphs(target, None, out, (1,), SIZES, check=False, progress=None)
        assert sorted(os.listdir(tmp_path)) == sorted(["exp", "exp.lock", os.path.basename(busy),
                                                       os.path.basename(foreign)])
    finally:
        sleeper.kill()
        sleeper.wait()
    m = Manifest.load(out)
    for g in m.graphs:
        m.verify_graph(g)
    assert read_marker(out)["entries"] == ["manifest.json", "target_k1.onnx", "target_prefill.onnx"]


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("exported") / "exp")
    onnx_export.export_graphs(target, None, out, (1,), SIZES, check=False, progress=None)
    return out


def _copy(src, tmp_path):
    import shutil

    return shutil.copytree(src, str(tmp_path / "exp"))


@pytest.fixture
def fake_trt(monkeypatch):
    """build_one's TensorRT calls stubbed: the 'engine' is the graph path's bytes, built once both builders hold
    their (then identical) manifest, so without the lock + re-read one record would overwrite the other."""
    from dflash_trt.engines import build

    class Builder:
        def __init__(self, barrier=None):
            self.barrier = barrier

        def build_serialized_network(self, network, cfg):
            if self.barrier is not None:
                self.barrier.wait(30)
            return network.encode()

    def network_io(network):
        man = Manifest.load(os.path.dirname(network))
        ins, outs = man.io(os.path.basename(network)[:-len(".onnx")])
        return {"inputs": ins, "outputs": outs}

    monkeypatch.setattr(build, "parse_graph", lambda builder, path, plugins: (
        path, None, {"plugin_layers": {}, "inlined": {}, "layers": 1}))
    monkeypatch.setattr(build, "network_io", network_io)
    monkeypatch.setattr(build, "builder_config", lambda *a, **k: None)
    return build, Builder


def test_concurrent_builders_of_one_manifest_lose_nothing(exported, tmp_path, fake_trt):
    from dflash_trt.hashing import sha256_files
    from dflash_trt.owned import check_replaceable

    build, Builder = fake_trt
    out = _copy(exported, tmp_path)
    errors, barrier = [], threading.Barrier(2)

    def run(name):
        try:
            build.build_one(Manifest.load(out), name, builder=Builder(barrier), ccs=[(8, 9)], batch=(1, 1, 2))
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(g,)) for g in ("target_k1", "target_prefill")]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert errors == []
    engines = Manifest.load(out).data["engines"]
    assert sorted(engines) == ["target_k1", "target_prefill"]
    for g, rec in engines.items():
        assert rec["engine_sha256"] == sha256_files([os.path.join(out, rec["file"])])
    assert {"engines/target_k1.engine", "engines/target_prefill.engine"} <= set(read_marker(out)["entries"])
    check_replaceable(out, "export", onnx_export.ExportError)  # the engines are ours: a re-export may replace it


def test_builder_refuses_an_export_it_did_not_write(exported, tmp_path, fake_trt):
    from dflash_trt.engines.network import BuildError

    build, Builder = fake_trt
    out = _copy(exported, tmp_path)
    _user_dir(out, {"engines/target_k1.engine": b"mine"})  # a file of the user's where the engine would go
    with pytest.raises(BuildError, match=r"engines/target_k1.engine exists and was not written by dflash-trt"):
        build.build_one(Manifest.load(out), "target_k1", builder=Builder(), ccs=[(8, 9)], batch=(1, 1, 2))
    _unchanged(out, {"engines/target_k1.engine": b"mine"})
    os.remove(os.path.join(out, MARKER))
    with pytest.raises(BuildError, match=rf"{out}: has no dflash-trt export marker"):
        build.build_one(Manifest.load(out), "target_k1", builder=Builder(), ccs=[(8, 9)], batch=(1, 1, 2))
