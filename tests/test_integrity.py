"""Integrity checks a hostile user cannot talk past.

Files: a graph, engine or checkpoint rewritten in place with its size and mtime put back (touch -r, cp -p,
rsync -t, tar x) is hashed again and refused, even where the hash memo of an earlier process holds the
old state (a new process is simulated by clearing the in-process memo; the cache file still answers).
Snapshots: one from other weights is refused whatever backend saved or restores it (the identity holds the
checkpoint hashes, which torch runtimes from load_runtime and exports both know); an edited meta.json field
is refused naming the field. Every refusal leaves the allocators as they were.
"""
import json
import os
import shutil
import time

import numpy as np
import onnx
import pytest
from test_onnx_common import SIZES, exported, tiny_pair  # noqa: F401

from dflash_trt import hashing
from dflash_trt.hashing import sha256_files
from dflash_trt.manifest import Manifest, ManifestError
from dflash_trt.runtime.backends import make_backend
from dflash_trt.runtime.load import load_runtime
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.runtime.snapshot import SnapshotError, SnapshotMismatch
from dflash_trt.tools.tiny import make_tiny_pair

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 250, 21)]


@pytest.fixture(autouse=True)
def memo(tmp_path, monkeypatch):
    """Private hash cache; files count as settled at once, as they would for a later process."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hashing, "_SETTLE_NS", 0)
    monkeypatch.setattr(hashing, "_MEMO", {})


def restore_mtime_after(path, edit):
    """edit(bytearray) in place, same size, mtime put back as `touch -r` does (past one timestamp tick)."""
    st = os.stat(path)
    time.sleep(0.05)
    data = bytearray(open(path, "rb").read())
    edit(data)
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_graph_weights_rewritten_with_restored_mtime_refused(exported, tmp_path):  # noqa: F811
    d = shutil.copytree(exported, str(tmp_path / "export"))
    be = make_backend("ort", manifest=d)
    be.session("target_prefill")  # verified, and remembered
    path = os.path.join(d, "target_prefill.onnx")
    model = onnx.load(path, load_external_data=False)
    raw = max((t.raw_data for t in model.graph.initializer), key=len)
    assert len(raw) >= 64

    def scale_a_weight(data):
        at = bytes(data).find(raw)
        assert at > 0
        data[at + 3] ^= 0x01  # one float32 weight's exponent: the graph still parses and runs

    restore_mtime_after(path, scale_a_weight)
    hashing._MEMO.clear()  # a new process
    with pytest.raises(ManifestError, match=r"graph target_prefill: .*target_prefill.onnx is not the file this "
                                            r"manifest's export wrote"):
        make_backend("ort", manifest=d).session("target_prefill")


def test_engine_byte_flipped_with_restored_mtime_refused(exported, tmp_path):  # noqa: F811
    from dflash_trt.engines.load import EngineError, check_engine

    d = shutil.copytree(exported, str(tmp_path / "export"))
    man = Manifest.load(d)
    os.makedirs(os.path.join(d, "engines"))
    path = os.path.join(d, "engines", "target_k1.engine")
    open(path, "wb").write(np.random.default_rng(0).bytes(4096))
    man.data["engines"] = {"target_k1": {"file": "engines/target_k1.engine", "graph": "target_k1",
                                         "onnx_sha256": man.verify_graph("target_k1"),
                                         "engine_sha256": sha256_files([path]), "trt": {}}}
    man.save(d)

    def check():
        with pytest.raises((EngineError, ImportError)) as e:  # no TensorRT here: refused after the hash checks
            check_engine(d, "target_k1")
        return str(e.value)

    assert "differs" not in check()
    restore_mtime_after(path, lambda data: data.__setitem__(100, data[100] ^ 0xFF))
    hashing._MEMO.clear()
    assert "differs from the engine that was built (sha256 mismatch)" in check()


# ---- snapshots ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_pair(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("other")), seed=4)  # same config, other weights


def torch_rt(dirs):
    return load_runtime(*dirs, backend="torch", sizes=SIZES)[0]


def ort_rt(manifest_dir):
    be = make_backend("ort", manifest=manifest_dir)
    return Runtime(be, be.tcfg, be.dcfg, be.sizes)


def free(rt):
    return rt.kv_alloc.num_free, rt.dkv_alloc.num_free, rt.slots.num_free


def save_after(rt, path, steps=4):
    """Prefill + steps greedy decode steps, save; returns (live sequence, tokens so far)."""
    seq = rt.add_sequence(PROMPT)
    new = [rt.prefill(seq)]
    for _ in range(steps):
        new += rt.decode_step([seq])[0]
    rt.save_sequence(seq, path, extra={"new": new})
    return seq, new


def continue_for(rt, seq, n=6):
    out = []
    for _ in range(n):
        out += rt.decode_step([seq])[0]
    rt.release(seq)
    return out


def refuse(rt, path, exc, *words):
    before = free(rt)
    with pytest.raises(exc) as e:
        rt.restore_sequence(path)
    assert free(rt) == before and "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_snapshot_of_other_weights_refused_on_torch_and_ort(tiny_pair, other_pair, exported, tmp_path):  # noqa: F811
    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    foreign = str(tmp_path / "foreign")
    save_after(torch_rt(other_pair), foreign, steps=1)
    for rt in (torch_rt(tiny_pair), ort_rt(exported)):
        refuse(rt, foreign, SnapshotMismatch, "weights.target: file 'checkpoint:", "weights.drafter")
    from_ort = str(tmp_path / "from_ort")
    save_after(ort_rt(exported), from_ort, steps=1)
    refuse(torch_rt(other_pair), from_ort, SnapshotMismatch, "weights.target", "weights.drafter")
    # modules not loaded through load_runtime know only their parameters: never taken for an export's weights
    t = load_target(other_pair[0])
    mods = (t, load_drafter(other_pair[1], t))
    built = str(tmp_path / "built")
    save_after(Runtime(TorchBackend(*mods), t.cfg, mods[1].cfg, SIZES), built, steps=1)
    refuse(ort_rt(exported), built, SnapshotMismatch, "weights.target: file 'params:", "cannot be shown")


def test_snapshot_moves_between_backends_of_one_checkpoint(tiny_pair, exported, tmp_path):  # noqa: F811
    rt = torch_rt(tiny_pair)
    seq, _ = save_after(rt, str(tmp_path / "s"))
    want = continue_for(rt, seq)
    ort = ort_rt(exported)
    assert continue_for(ort, ort.restore_sequence(str(tmp_path / "s"))) == want
    assert free(ort) == (ort.kv_alloc.num_total, ort.dkv_alloc.num_total, ort.slots.num_total)


def edited(src, dst, fn):
    shutil.copytree(src, dst)
    p = os.path.join(dst, "meta.json")
    meta = json.load(open(p))
    fn(meta)
    json.dump(meta, open(p, "w"), indent=1)
    return str(dst)


def test_edited_meta_fields_refused_naming_the_field(tiny_pair, other_pair, tmp_path):  # noqa: F811
    rt = torch_rt(tiny_pair)
    seq, new = save_after(rt, str(tmp_path / "s"))
    want = continue_for(rt, seq)
    snap = str(tmp_path / "s")
    other_weights = torch_rt(other_pair)
    ident = {"weights.target": other_weights.backend.weights_id("target")}
    edits = {
        "seq.bonus": lambda m: m["seq"].update(bonus=(m["seq"]["bonus"] + 1) % 250),
        "seq.tokens": lambda m: m["seq"]["tokens"].__setitem__(3, (m["seq"]["tokens"][3] + 1) % 250),
        "seq.seq_len": lambda m: m["seq"].update(seq_len=m["seq"]["seq_len"] - 1),
        "ctx.total": lambda m: m["ctx"].update(total=m["ctx"]["total"] + 1),
        "extra": lambda m: m["extra"]["new"].append(5),
        "identity.weights.target": lambda m: m["identity"].update(ident),
        "field_sha256": lambda m: m.pop("field_sha256"),
    }
    rt = torch_rt(tiny_pair)
    for i, (field, fn) in enumerate(edits.items()):
        refuse(rt, edited(snap, tmp_path / f"e{i}", fn), SnapshotError, "meta.json", f"{field}")
    # the saved file itself still restores and continues as the undisturbed run
    assert continue_for(rt, rt.restore_sequence(snap)) == want
    assert free(rt) == (rt.kv_alloc.num_total, rt.dkv_alloc.num_total, rt.slots.num_total)
