"""Files written atomically (a reader sees the old file or the new one, never a part: tmp + os.replace), and the
advisory lock that serialises the processes filling one cache entry."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading

_held = threading.local()  # lock files this thread holds: a nested entry_lock of one entry passes through

from dflash_trt import log


def _write_atomic(path: str, mode: str, write) -> str:
    """write(f) into a unique temp file beside `path`, then os.replace: concurrent writers never share a temp."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.{os.urandom(4).hex()}"
    try:
        with open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def write_json(path: str, data, indent: int | None = 1) -> str:
    """json.dump `data` to `path` atomically."""
    return _write_atomic(path, "w", lambda f: json.dump(data, f, indent=indent))


def write_bytes(path: str, data) -> str:
    """`data` (bytes or a buffer) to `path` atomically."""
    return _write_atomic(path, "wb", lambda f: f.write(memoryview(data)))


@contextlib.contextmanager
def entry_lock(entry: str, progress=log.progress, doing: str = "filling"):
    """Exclusive advisory lock on `entry` (a cache entry directory; the lock file is `entry`.lock) for the body.
    Another holder: says so once through `progress`, then waits. The lock dies with its process (flock).
    Re-entrant within a thread (an export under the cache's lock replaces its entry under the same lock);
    other threads and processes wait."""
    name = os.path.abspath(entry.rstrip(os.sep)) + ".lock"
    held = _held.__dict__.setdefault("names", set())
    if name in held:
        yield
        return
    with open(name, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process {doing} {entry} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        held.add(name)
        try:
            yield
        finally:
            held.discard(name)
