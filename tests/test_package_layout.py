"""The package's shape: every module imports under exactly one name (dflash_trt.*), no code edits the import
path, and setup.py's discovery finds every subpackage and kernel source (a non-editable install ships them all)."""
import fnmatch
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
import tomllib

import dflash_trt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("dflash_trt", "export", "modeling", "plugins", "engines", "runtime", "tools")


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


def _setup():
    """setup.py's discovery, loaded without running setup()."""
    spec = importlib.util.spec_from_file_location("dflash_setup", os.path.join(ROOT, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _folders_with_init(root: str, setup) -> set:
    found = set()
    for pkg, d in setup.PACKAGE_DIR.items():
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(root, d))
                found.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    return found


def test_setup_ships_every_subpackage():
    setup = _setup()
    listed = set(setup.packages())
    assert {"dflash_trt.plugins.gdn", "dflash_trt.runtime.backends", "dflash_trt.tools.train"} <= listed
    found = _folders_with_init(ROOT, setup)
    assert found == listed, f"packages not shipped: {sorted(found - listed)}; stale: {sorted(listed - found)}"
    assert set(setup.PACKAGE_DIR.values()) == {"dflash_trt", *TOP[1:]}


def test_setup_ships_every_kernel_source():
    """Every .cu / .cuh under plugins/ matches its package's package-data globs: NVRTC compiles them at run time, and
    a wheel without, say, gemv/mma.cuh fails on the first GEMV launch (it did: only *.cu was listed)."""
    data = _setup().package_data()
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
    assert not missing, f"kernel sources a wheel would leave out (setup.py package_data): {missing}"


def test_new_op_folder_ships_without_packaging_edits(tmp_path):
    """A folder added under plugins/ is a package of the wheel, with its kernel sources, and pyproject.toml names
    no package: discovery alone decides."""
    setup = _setup()
    for d in setup.PACKAGE_DIR.values():
        os.makedirs(tmp_path / d)
        (tmp_path / d / "__init__.py").write_text("")
    op = tmp_path / "plugins" / "newop"
    os.makedirs(op)
    (op / "__init__.py").write_text("")
    (op / "kernel.cu").write_text("")
    assert "dflash_trt.plugins.newop" in setup.packages(str(tmp_path))
    assert any(fnmatch.fnmatch("kernel.cu", g) for g in setup.package_data(str(tmp_path))["dflash_trt.plugins.newop"])
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f).get("tool", {}).get("setuptools", {})
    assert "packages" not in tool and "package-data" not in tool, tool
