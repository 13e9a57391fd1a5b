"""The package's shape: every module imports under exactly one name (dflash_trt.*), no code edits the import
path, and pyproject lists every subpackage and kernel source (a non-editable install ships them all)."""
import fnmatch
import importlib
import os
import pkgutil
import re
import sys
import tomllib

import dflash_trt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("dflash_trt", "export", "plugins", "engines", "runtime", "tools")


def _all_modules():
    names = ["dflash_trt"]
    for info in pkgutil.walk_packages(dflash_trt.__path__, "dflash_trt."):
        names.append(info.name)
    for sub in TOP[1:]:
        pkg = importlib.import_module(f"dflash_trt.{sub}")
        names += [i.name for i in pkgutil.walk_packages(pkg.__path__, f"dflash_trt.{sub}.")]
    return sorted(set(names))


def test_every_module_has_one_name():
    names = _all_modules()
    assert len(names) > 40, names  # the walk found the subpackages, not just dflash_trt/
    for n in names:
        if n.endswith("__main__"):
            continue
        importlib.import_module(n)
    by_file = {}
    env = os.path.realpath(sys.prefix) + os.sep  # a virtual environment inside the checkout (.venv) is not ours
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        real = os.path.realpath(f) if f and os.path.isabs(f) else ""
        if real.startswith(ROOT + os.sep) and not real.startswith(env) and "/tests/" not in f:
            by_file.setdefault(real, set()).add(name)
    twice = {f: sorted(n) for f, n in by_file.items() if len(n) > 1}
    assert not twice, f"source files loaded under two module names: {twice}"
    outside = sorted(n for ns in by_file.values() for n in ns if not n.startswith("dflash_trt"))
    assert not outside, f"package files imported outside dflash_trt.*: {outside}"


def test_no_import_path_edits():
    pat = re.compile(r"sys\.path\.(insert|append|extend)|__path__\s*(\.append|\.extend|\+=|=)")
    bad = []
    for top in TOP + ("tests",):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py") and f != os.path.basename(__file__):
                    p = os.path.join(dirpath, f)
                    bad += [f"{os.path.relpath(p, ROOT)}:{i}" for i, line in enumerate(open(p), 1) if pat.search(line)]
    assert not bad, bad


def _setuptools_table() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_pyproject_lists_every_subpackage():
    tool = _setuptools_table()
    listed, dirs = set(tool["packages"]), tool["package-dir"]
    found = set()
    for pkg, d in dirs.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, d)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, d))
                found.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    assert found == listed, f"missing from pyproject packages: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_pyproject_ships_every_kernel_source():
    """Every .cu / .cuh under plugins/ matches its package's package-data globs: NVRTC compiles them at run time, and
    a wheel without, say, gemv/mma.cuh fails on the first GEMV launch (it did: only *.cu was listed)."""
    data = _setuptools_table()["package-data"]
    missing, seen = [], 0
    for dirpath, _, files in os.walk(os.path.join(ROOT, "plugins")):
        rel = os.path.relpath(dirpath, os.path.join(ROOT, "plugins"))
        pkg = "dflash_trt.plugins" if rel == "." else "dflash_trt.plugins." + rel.replace(os.sep, ".")
        for f in files:
            if f.endswith((".cu", ".cuh")):
                seen += 1
                if not any(fnmatch.fnmatch(f, g) for g in data.get(pkg, ())):
                    missing.append(os.path.join(rel, f))
    assert seen > 5, seen  # the walk found the op folders' sources
    assert not missing, f"kernel sources a wheel would leave out (pyproject package-data): {missing}"
