"""`dflash-trt cache list|clear`: what the artifact cache ($DFLASH_TRT_CACHE, else ~/.cache/dflash_trt) holds, and
freeing it. Only what dflash-trt wrote is ever removed: export entries carrying our ownership marker that lists
everything in them (dflash_trt.owned), their lock files, NVRTC modules named as the compiler names them, and the
directories of compiled GPU steps (Inductor's caches, stored steps) that carry our marker. Each export entry is
removed under its lock, so an export or engine build of it in another process finishes first."""
from __future__ import annotations

import argparse
import os
import re
import shutil

from dflash_trt.config import cache_root
from dflash_trt.files import entry_lock
from dflash_trt.log import progress
from dflash_trt.owned import foreign_entries, read_marker

EXPORT_PREFIX = "onnx-"
_NVRTC_FILE = re.compile(r"^[\w.]+-(?:sm|compute)_\d+[af]?-[0-9a-f]{32}\.(?:ptx|cubin)$")  # nvrtc.compile_text's names


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "clear"], help="list: the cached exports and kernels; clear: free them")
    p.add_argument("entries", nargs="*", help="clear: only these export entries (names as `list` prints them)")


def exports(root: str) -> list[str]:
    """Names of the export entries under root (directories onnx-<key> with our export marker)."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if n.startswith(EXPORT_PREFIX) and not n.endswith(".lock")
                  and os.path.isdir(os.path.join(root, n)) and (read_marker(os.path.join(root, n)) or {}).get("kind")
                  == "export")


def nvrtc_files(root: str) -> list[str]:
    d = os.path.join(root, "nvrtc")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if _NVRTC_FILE.match(f)) if os.path.isdir(d) else []


# directories of compiled GPU steps made under the root (runtime/backends/torch_compile.py, step_store.py): name,
# the kind their ownership marker carries, what `list` calls them. Repeated here so that the cache CLI imports no torch.
STEP_DIRS = (("inductor", "inductor-cache", "Inductor's code for the compiled steps"),
             ("steps", "compiled-steps", "compiled steps (loaded without tracing)"))


def step_dirs(root: str) -> list[tuple[str, str]]:
    """(path, description) of the compiled-step directories under root that carry our marker."""
    out = []
    for name, kind, what in STEP_DIRS:
        d = os.path.join(root, name)
        if (read_marker(d) or {}).get("kind") == kind:
            out.append((d, what))
    return out


def _bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if os.path.isfile(os.path.join(d, f)))


def _mb(n: int) -> str:
    return f"{n / 1024**2:.1f} MB"


def describe(entry: str) -> str:
    """One line: verify widths, dtype, engines and the checkpoint folders an export entry was made from."""
    from dflash_trt.manifest import Manifest, ManifestError

    try:
        m = Manifest.load(entry, check_files=False)
    except ManifestError as e:
        return f"unreadable manifest ({e})"
    d = m.data
    src = " + ".join(str((d.get(w) or {}).get("dir")) for w in ("target", "drafter") if d.get(w))
    return f"K {','.join(map(str, m.ks))}, {m.kv_dtype}, {len(d.get('engines') or {})} engines, from {src}"


def list_cache(root: str) -> None:
    names = exports(root)
    total = 0
    print(f"cache: {root}")
    for n in names:
        size = _bytes(os.path.join(root, n))
        total += size
        print(f"  {n}  {_mb(size):>10}  {describe(os.path.join(root, n))}")
    kernels = nvrtc_files(root)
    ksize = sum(map(os.path.getsize, kernels))
    print(f"  nvrtc: {len(kernels)} compiled kernels, {_mb(ksize)}")
    ssize = 0
    for d, what in step_dirs(root):
        size = _bytes(d)
        ssize += size
        print(f"  {os.path.basename(d)}: {what}, {_mb(size)}")
    print(f"{len(names)} exports, {_mb(total + ksize + ssize)} in all")


def clear_cache(root: str, only: list[str]) -> int:
    """Remove the named export entries (all ours, and the NVRTC modules, when none is named). Returns 2 when a
    named entry is not one of ours (nothing else is skipped silently)."""
    names, rc, freed = exports(root), 0, 0
    for n in only:
        if n not in names:
            progress(f"{n}: not an export entry of this cache ({root}); left alone")
            rc = 2
    for n in (only or names):
        path = os.path.join(root, n)
        if n not in names:
            continue
        with entry_lock(path, progress, "clearing"):
            foreign = foreign_entries(path, "export")
            if foreign:  # files someone put there: the entry stays, with them
                progress(f"{n}: holds files dflash-trt did not write ({', '.join(foreign[:3])}); left alone")
                rc = 2
                continue
            freed += _bytes(path)
            shutil.rmtree(path)  # its empty lock file stays: a process waiting on it must lock the same file
    if not only:
        for f in nvrtc_files(root):
            freed += os.path.getsize(f)
            os.remove(f)
        for d, _ in step_dirs(root):  # written where our compiled steps sent them; a process compiling refills them
            freed += _bytes(d)
            shutil.rmtree(d)
    progress(f"freed {_mb(freed)} in {root}")
    return rc


def run(args) -> int:
    root = cache_root()
    if args.action == "list":
        if args.entries:
            progress("`cache list` takes no entry names")
            return 2
        list_cache(root)
        return 0
    return clear_cache(root, args.entries)
