"""sha256 of files, computed once per file state.

Checkpoints, exported graphs and engines are identified by the sha256 of their bytes (manifests record them;
every consumer checks them). Hashing gigabytes on every run would dominate start-up, so a result is remembered:
in this process, and across processes in <cache>/file_hashes.json (best effort: an unwritable cache only costs
a re-hash). The key is every file's (path, device, inode, size, mtime, ctime). mtime alone can be put back
(`touch -r`, `cp -p`, `rsync -t`, `tar x`), ctime cannot: the kernel sets it to now on every write, and a copy
is a new inode with a new ctime. A state younger than _SETTLE_NS is not remembered: a second write within one
timestamp tick would leave every field of the key unchanged.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import time

from dflash_trt.config import cache_root
from dflash_trt.files import write_json

_MEMO: dict = {}
_KEEP = 1024  # file states remembered on disk (oldest dropped first)
_SETTLE_NS = 2_000_000_000  # above any filesystem's timestamp granularity (FAT: 2 s)


def _state(path: str) -> list:
    st = os.stat(path)
    return [path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _digest(paths, with_names: bool) -> str:
    h = hashlib.sha256()
    for p in paths:
        if with_names:
            h.update(os.path.basename(p).encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def sha256_files(paths, with_names: bool = False) -> str:
    """Hex sha256 over the files' bytes in order (each preceded by its base name when with_names)."""
    paths = [os.path.abspath(p) for p in paths]
    now = time.time_ns()
    states = [_state(p) for p in paths]
    key = hashlib.sha256(json.dumps([with_names] + states).encode()).hexdigest()
    if key in _MEMO:
        return _MEMO[key]
    disk_path = os.path.join(cache_root(), "file_hashes.json")
    got = _read(disk_path).get(key)
    if isinstance(got, str):
        _MEMO[key] = got
        return got
    got = _digest(paths, with_names)
    settled = all(now - max(s[4], s[5]) >= _SETTLE_NS for s in states)
    if not settled or [_state(p) for p in paths] != states:
        return got  # written just now or while being read: the key may not describe these bytes
    disk = _read(disk_path)  # re-read: another process may have added entries meanwhile
    disk[key] = got
    _write(disk_path, dict(list(disk.items())[-_KEEP:]))  # the newest entries: the file stays small
    _MEMO[key] = got
    return got


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, data: dict) -> None:
    try:
        write_json(path, data, indent=None)
    except OSError:
        pass


def source_hash(packages=(), modules=()) -> str:
    """sha256 (16 hex) over the source files (.py, .cu, .cuh) of these packages and modules: what a cached artifact
    built from this code (an export, a compiled step) is keyed by, so an edit rebuilds it."""
    files = [importlib.import_module(m).__file__ for m in modules]
    for pkg in packages:
        top = os.path.dirname(importlib.import_module(pkg).__file__)
        files += sorted(os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith((".py", ".cu", ".cuh")))
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]
