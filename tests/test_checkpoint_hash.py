"""checkpoint_hash is computed once per file state, and a state is what no copy or timestamp restore can fake:
remembered by (path, device, inode, size, mtime, ctime) in-process and in the cache dir; a file whose mtime
was put back after a rewrite (touch -r, cp -p, rsync -t, tar x) is hashed again."""
import os
import shutil
import time

import pytest

pytest.importorskip("torch")
from dflash_trt import hashing  # noqa: E402
from dflash_trt.export import checkpoint  # noqa: E402
from dflash_trt.tools.tiny import make_tiny_pair  # noqa: E402


@pytest.fixture
def digests(tmp_path, monkeypatch):
    """Private cache; files count as settled at once (they were written this instant); counts real reads."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hashing, "_SETTLE_NS", 0)
    monkeypatch.setattr(hashing, "_MEMO", {})
    calls = []
    real = hashing._digest
    monkeypatch.setattr(hashing, "_digest", lambda paths, names: calls.append(paths) or real(paths, names))
    return calls


def rewrite_keeping_mtime(path, edit):
    """Other bytes of the same size, mtime put back as `touch -r` does; past one timestamp tick."""
    st = os.stat(path)
    time.sleep(0.05)
    data = bytearray(open(path, "rb").read())
    edit(data)
    open(path, "wb").write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_unchanged_files_hashed_once_across_processes(tmp_path, digests):
    tdir, _ = make_tiny_pair(str(tmp_path / "pair"), seed=1)
    h0 = checkpoint.checkpoint_hash(tdir)
    assert os.path.isfile(tmp_path / "cache" / "file_hashes.json")
    assert checkpoint.checkpoint_hash(tdir) == h0
    hashing._MEMO.clear()  # a new process: the cache file answers
    assert checkpoint.checkpoint_hash(tdir) == h0
    assert len(digests) == 1


def test_rewrite_with_restored_mtime_is_hashed_again(tmp_path, digests):
    tdir, _ = make_tiny_pair(str(tmp_path / "pair"), seed=1)
    w = os.path.join(tdir, "model.safetensors")
    h0 = checkpoint.checkpoint_hash(tdir)

    def flip(d):
        d[-1] ^= 0xFF

    rewrite_keeping_mtime(w, flip)
    h1 = checkpoint.checkpoint_hash(tdir)
    assert h1 != h0  # in this process
    hashing._MEMO.clear()
    assert checkpoint.checkpoint_hash(tdir) == h1  # and in a new one, from the cache file
    rewrite_keeping_mtime(w, flip)  # back to the first bytes
    hashing._MEMO.clear()
    assert checkpoint.checkpoint_hash(tdir) == h0


def test_copy_with_preserved_mtime_of_other_weights(tmp_path, digests):
    tdir, _ = make_tiny_pair(str(tmp_path / "pair"), seed=1)
    other, _ = make_tiny_pair(str(tmp_path / "other"), seed=2)  # same config, same sizes, other weights
    w, src = os.path.join(tdir, "model.safetensors"), os.path.join(other, "model.safetensors")
    h0 = checkpoint.checkpoint_hash(tdir)
    os.utime(src, ns=(os.stat(w).st_atime_ns, os.stat(w).st_mtime_ns))
    assert os.path.getsize(src) == os.path.getsize(w)
    shutil.copy2(src, w)  # cp -p: the old name, size and mtime, a new inode
    assert os.stat(w).st_mtime_ns == os.stat(src).st_mtime_ns
    hashing._MEMO.clear()
    h1 = checkpoint.checkpoint_hash(tdir)
    assert h1 != h0 and h1 == checkpoint.checkpoint_hash(other)


def test_fresh_files_are_not_remembered(tmp_path, monkeypatch):
    """A state younger than a timestamp tick may be rewritten with every key field equal: hashed every time."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hashing, "_MEMO", {})
    monkeypatch.setattr(hashing, "_SETTLE_NS", 3600 * 10**9)
    tdir, _ = make_tiny_pair(str(tmp_path / "pair"), seed=1)
    w = os.path.join(tdir, "model.safetensors")
    h0 = checkpoint.checkpoint_hash(tdir)
    data = bytearray(open(w, "rb").read())
    data[-1] ^= 0xFF
    st = os.stat(w)
    open(w, "wb").write(bytes(data))  # possibly within the same tick: ctime may be unchanged too
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert checkpoint.checkpoint_hash(tdir) != h0
    assert not hashing._MEMO and not os.path.exists(tmp_path / "cache" / "file_hashes.json")
