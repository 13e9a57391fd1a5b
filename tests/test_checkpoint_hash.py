"""checkpoint_hash is computed once per file state: remembered by (path, size, mtime) in-process and in the
cache dir, and recomputed when a file changes."""
import os

import pytest

pytest.importorskip("torch")
from dflash_trt import hashing  # noqa: E402
from dflash_trt.export import checkpoint  # noqa: E402
from dflash_trt.tools.tiny import make_tiny_pair  # noqa: E402


def test_hash_cached_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    tdir, _ = make_tiny_pair(str(tmp_path / "pair"), seed=1)
    w = os.path.join(tdir, "model.safetensors")
    h0 = checkpoint.checkpoint_hash(tdir)
    assert os.path.isfile(tmp_path / "cache" / "file_hashes.json")
    st = os.stat(w)
    data = bytearray(open(w, "rb").read())
    data[-1] ^= 0xFF  # same size, other bytes; restore the mtime: the remembered hash is returned unread
    open(w, "wb").write(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert checkpoint.checkpoint_hash(tdir) == h0
    hashing._MEMO.clear()  # a new process: the cache file answers
    assert checkpoint.checkpoint_hash(tdir) == h0
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: hashed again, new bytes seen
    assert checkpoint.checkpoint_hash(tdir) != h0
