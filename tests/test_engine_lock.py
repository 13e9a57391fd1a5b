"""ensure_engines under the cache entry's lock (dflash_trt.files.entry_lock): a second front door that finds
engines missing while another process builds them waits, then re-checks and builds nothing twice; a directory
it cannot write gives one BuildError line. TensorRT is stubbed out: this is the locking, not the build."""
import fcntl
import os
import threading
import time

import pytest

from dflash_trt.engines import build
from dflash_trt.engines.load import EngineError
from dflash_trt.engines.network import BuildError


class _Man:
    def __init__(self, root):
        self.root, self.graphs = root, ["target_k1", "target_k4"]


@pytest.fixture
def entry(tmp_path, monkeypatch):
    root = str(tmp_path / "onnx-entry")
    os.makedirs(root)
    state = {"built": set(), "calls": []}

    def check(man, g, allow_unsupported_shapes=False):
        if g not in state["built"]:
            raise EngineError(f"{g}: no engine")

    def build_engines(manifest_dir, graphs=None, progress=None):
        state["calls"].append(list(graphs))
        state["built"].update(graphs)

    monkeypatch.setattr(build.Manifest, "load", classmethod(lambda cls, root_: _Man(root)))
    monkeypatch.setattr("dflash_trt.engines.load.check_engine", check)
    monkeypatch.setattr(build, "build_engines", build_engines)
    return root, state


def test_waits_for_the_other_builder_and_builds_nothing_twice(entry):
    root, state = entry
    said = []
    with open(root + ".lock", "a") as other:  # another process is building: it holds the entry's lock
        fcntl.flock(other, fcntl.LOCK_EX)
        t = threading.Thread(target=build.ensure_engines, args=(root,), kwargs={"progress": said.append})
        t.start()
        for _ in range(100):
            if said:
                break
            time.sleep(0.02)
        assert said == [f"waiting for another process building engines in {root} ..."]
        assert t.is_alive() and state["calls"] == []
        state["built"].update(["target_k1", "target_k4"])  # ... which finishes both engines, then unlocks
    t.join(5)
    assert not t.is_alive() and state["calls"] == []


def test_builds_only_what_is_missing_once(entry):
    root, state = entry
    state["built"].add("target_k1")
    build.ensure_engines(root, progress=lambda *_: None)
    build.ensure_engines(root, progress=lambda *_: None)
    assert state["calls"] == [["target_k4"]]


def test_unwritable_entry_is_one_build_error(entry, monkeypatch):
    root, _ = entry
    monkeypatch.setattr(build, "entry_lock", lambda *a: open("/proc/no/such.lock", "a"))
    with pytest.raises(BuildError, match=f"cannot write engines into {root}: No such file or directory"):
        build.ensure_engines(root, progress=lambda *_: None)
