"""Outputs dflash-trt owns (snapshots, exports, engines) are recognised by a marker file it writes into them,
never by file names: the marker names the writer (kind, product, version, host, pid, time) and every entry it
wrote. A directory is only ever replaced or deleted when it is empty, missing, or carries a marker of the same
kind that lists everything in it; anything else is refused with one line naming a few foreign entries.

Replacing an output is atomic (a reader sees the old complete output or the new one): the new output is staged
in `<out>.tmp<pid>.<hex>` beside it (the marker is its first file), the old one is renamed to
`<out>.old<pid>.<hex>` and deleted once the new one is in place. Temporaries of writers that were killed are
removed on the next write of the same output, only when their process is gone and they carry our marker.
numpy-free and torch-free: the runtime core imports this.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time

from dflash_trt import __version__
from dflash_trt.files import entry_lock, write_json

MARKER = ".dflash-trt-output.json"
PRODUCT = "dflash-trt"
# a file being written atomically (dflash_trt.files) or a staged/retired directory: ours by its naming
_TEMP = re.compile(r"\.(?:tmp|old)(\d+)\.[0-9a-f]+$")


def read_marker(d: str) -> dict | None:
    """The marker of directory `d`, or None when it has none (or one that is not ours)."""
    try:
        with open(os.path.join(d, MARKER), "rb") as f:
            m = json.loads(f.read().decode())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(m, dict) and m.get("product") == PRODUCT and isinstance(m.get("entries"), list)
    return m if ok else None


def listing(d: str) -> list[str]:
    """Every file and directory under `d` (relative, '/'-separated, sorted), the marker left out."""
    out = []
    for root, dirs, files in os.walk(d):
        rel = os.path.relpath(root, d)
        for n in dirs + files:
            p = n if rel == "." else f"{rel}/{n}".replace(os.sep, "/")
            if p != MARKER:
                out.append(p)
    return sorted(out)


def write_marker(d: str, kind: str, entries) -> str:
    """Write (atomically) the marker claiming `entries` of directory `d` for a `kind` output."""
    return write_json(os.path.join(d, MARKER), {
        "product": PRODUCT, "version": __version__, "kind": kind, "host": socket.gethostname(),
        "pid": os.getpid(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "entries": sorted(set(entries))})


def add_entries(d: str, kind: str, entries) -> None:
    """Claim more entries of our output `d` (e.g. engines built into an export); the caller holds its lock."""
    m = read_marker(d)
    write_marker(d, kind, list((m or {}).get("entries", [])) + list(entries))


def foreign_entries(d: str, kind: str, trust_unmarked: bool = False) -> list[str]:
    """Entries of directory `d` that a `kind` output of ours did not write ([] for a missing or empty one).
    Files being written atomically by us (`*.tmp<pid>.<hex>`) are ours by their naming.
    trust_unmarked: `d` is ours by construction (the export cache); an unmarked one may be replaced."""
    if not os.path.isdir(d):
        return []
    m = read_marker(d)
    if m is None and not os.path.exists(os.path.join(d, MARKER)) and trust_unmarked:
        return []
    mine = set(m["entries"]) if m is not None and m.get("kind") == kind else set()
    return [p for p in listing(d) if p not in mine and not _TEMP.search(p)
            and not any(q.startswith(p + "/") for q in mine)]  # a directory holding our files is ours


def check_replaceable(path: str, kind: str, error, trust_unmarked: bool = False) -> None:
    """Raise `error` (one line) unless `path` is missing, an empty directory, or our own `kind` output."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise error(f"{path}: exists and is not a directory; refusing to overwrite it")
    other = foreign_entries(path, kind, trust_unmarked)
    if other:
        more = f" and {len(other) - 3} more" if len(other) > 3 else ""
        raise error(f"{path}: holds files that are not a dflash-trt {kind}'s ({', '.join(other[:3])}{more}); "
                    "refusing to replace it: choose an empty or new directory")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_leftovers(path: str, trust_unmarked: bool = False) -> list[str]:
    """Remove `path`.tmp<pid>.* / .old<pid>.* directories whose process is gone and which carry our marker
    (a staged one: written by that very process on this host). Returns what was removed."""
    d, base = os.path.split(os.path.abspath(path))
    gone = []
    try:
        names = os.listdir(d)
    except OSError:
        return gone
    host = socket.gethostname()
    for f in names:
        m = re.fullmatch(re.escape(base) + r"\.(tmp|old)(\d+)\.[0-9a-f]+", f)
        p = os.path.join(d, f)
        if not m or not os.path.isdir(p) or os.path.islink(p) or _alive(int(m.group(2))):
            continue
        mk = read_marker(p)
        if mk is None:
            ours = trust_unmarked
        elif m.group(1) == "tmp":
            ours = mk.get("pid") == int(m.group(2)) and mk.get("host") == host
        else:
            ours = True  # a former output of ours, retired by a replace that did not finish
        if ours:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def replace_dir(new: str, dst: str, kind: str, error, trust_unmarked: bool = False) -> None:
    """Put staged directory `new` at `dst`; an existing `dst` (ours: re-checked here) is renamed aside first and
    deleted after, so a reader sees the old complete output, no directory, or the new one, never a mix."""
    check_replaceable(dst, kind, error, trust_unmarked)
    old = None
    if os.path.exists(dst):
        old = f"{dst}.old{os.getpid()}.{os.urandom(4).hex()}"
        os.replace(dst, old)
    try:
        os.replace(new, dst)
    except BaseException:
        if old is not None:
            os.replace(old, dst)  # put the previous output back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(dst: str, kind: str, error, *, trust_unmarked: bool = False, lock: bool = False, progress=None):
    """Yield a fresh directory beside `dst` (marked ours from its first moment) to write the output into; on a
    normal exit the marker lists what is there and the directory replaces `dst` atomically. `dst` is checked
    first (a foreign directory is refused before anything is written). lock: hold entry_lock(dst) while
    replacing, so writers that update an output in place (the engine builder) never lose work to it."""
    dst = os.path.abspath(dst)
    check_replaceable(dst, kind, error, trust_unmarked)
    parent = os.path.dirname(dst)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise error(f"{dst}: cannot create its parent directory: {e.strerror}") from None
    remove_dead_leftovers(dst, trust_unmarked)
    tmp = f"{dst}.tmp{os.getpid()}.{os.urandom(4).hex()}"
    try:
        os.makedirs(tmp)
        write_marker(tmp, kind, [])
        yield tmp
        write_marker(tmp, kind, listing(tmp))
        with entry_lock(dst, progress or (lambda *_: None), "writing") if lock else contextlib.nullcontext():
            replace_dir(tmp, dst, kind, error, trust_unmarked)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def claim(d: str, kind: str, rels, error) -> None:
    """Add `rels` (paths relative to `d`) to our `kind` output `d` before writing them there; the caller holds
    entry_lock(d). Refused (one line) when `d` is not ours or a path already holds something we did not write."""
    m = read_marker(d)
    if m is None or m.get("kind") != kind:
        raise error(f"{d}: has no dflash-trt {kind} marker ({MARKER}), so dflash-trt did not write it; refusing "
                    f"to write {', '.join(rels)} there (re-create it with dflash-trt into a new directory)")
    taken = [r for r in rels if os.path.lexists(os.path.join(d, r)) and r not in m["entries"]]
    if taken:
        raise error(f"{d}: {', '.join(taken[:3])} exists and was not written by dflash-trt; refusing to overwrite it")
    if set(rels) - set(m["entries"]):
        write_marker(d, kind, list(m["entries"]) + list(rels))
