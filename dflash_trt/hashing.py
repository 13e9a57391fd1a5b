"""sha256 of files, computed once per file state.

Checkpoints and exported graphs are identified by the sha256 of their bytes (manifests record them; every
consumer checks them). Hashing gigabytes on every run would dominate start-up, so a result is remembered
under the files' (path, size, mtime): in this process, and across processes in
<cache>/file_hashes.json (best effort: an unwritable cache only costs a re-hash). Any rewrite of a file
changes its mtime or size, and so the key.
"""
from __future__ import annotations

import hashlib
import json
import os

from dflash_trt.config import cache_root
from dflash_trt.files import write_json

_MEMO: dict = {}
_KEEP = 1024  # file states remembered on disk (oldest dropped first)


def sha256_files(paths, with_names: bool = False) -> str:
    """Hex sha256 over the files' bytes in order (each preceded by its base name when with_names)."""
    paths = [os.path.abspath(p) for p in paths]
    key = json.dumps([with_names] + [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths])
    key = hashlib.sha256(key.encode()).hexdigest()
    if key in _MEMO:
        return _MEMO[key]
    disk_path = os.path.join(cache_root(), "file_hashes.json")
    disk = _read(disk_path)
    if not isinstance(disk.get(key), str):
        h = hashlib.sha256()
        for p in paths:
            if with_names:
                h.update(os.path.basename(p).encode())
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        disk = _read(disk_path)  # re-read: another process may have added entries meanwhile
        disk[key] = h.hexdigest()
        _write(disk_path, dict(list(disk.items())[-_KEEP:]))  # the newest entries: the file stays small
    _MEMO[key] = disk[key]
    return disk[key]


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
