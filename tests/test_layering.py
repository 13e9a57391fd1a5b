"""Import-time layering: the runtime core and the op registry load without torch or tensorrt, plugins/ depends only
on the contract modules, and the runtime package and its backends do not import each other at module level."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("dflash_trt.runtime.pools", "dflash_trt.runtime.scheduler", "dflash_trt.runtime.commit",
        "dflash_trt.runtime.sequence", "dflash_trt.runtime.snapshot", "dflash_trt.runtime.batching",
        "dflash_trt.plugins.registry", "dflash_trt.runtime.devices.host")
PLUGINS_MAY_IMPORT = ("dflash_trt.abi", "dflash_trt.config", "dflash_trt.plugins")

_BLOCKED = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "tensorrt", "tensorrt_rtx"):
            raise ImportError(f"layering: {name} imported at import time")
        return None

sys.meta_path.insert(0, Block())
import importlib
for m in sys.argv[1:]:
    importlib.import_module(m)
from dflash_trt.plugins.registry import bundles
from dflash_trt.runtime.devices.host import HostDevice
assert [b.spec.name for b in bundles()] and hasattr(HostDevice, "kv_write")
print("ok")
"""


def test_core_imports_without_torch_or_tensorrt():
    r = subprocess.run([sys.executable, "-c", _BLOCKED, *CORE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def _module_name(path: str) -> str:
    """plugins/gdn/spec.py -> dflash_trt.plugins.gdn.spec (top folders are mapped into dflash_trt)."""
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel if rel[0] == "dflash_trt" else ["dflash_trt", *rel])


def _imports(path: str, module_level: bool) -> set:
    """Absolute names of the dflash_trt modules (or packages) `path` imports; module_level: not those inside defs."""
    tree = ast.parse(open(path).read(), path)
    me = _module_name(path)
    pkg = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    out, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and module_level:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
        todo.extend(ast.iter_child_nodes(node))
    return {m for m in out if m.startswith("dflash_trt")}


def _py_files(folder: str, recurse: bool = True):
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = [d for d in dirs if d != "__pycache__"] if recurse else []
        yield from (os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py"))


def test_plugins_import_only_contract_modules():
    bad = []
    for path in _py_files("plugins"):
        for m in _imports(path, module_level=False):
            if not any(m == ok or m.startswith(ok + ".") for ok in PLUGINS_MAY_IMPORT):
                bad.append(f"{os.path.relpath(path, ROOT)} imports {m}")
    assert not bad, bad


def test_no_module_level_cycle_between_runtime_and_backends():
    backends = "dflash_trt.runtime.backends"
    up = {os.path.relpath(p, ROOT): sorted(m for m in _imports(p, True) if m.startswith(backends))
          for p in _py_files("runtime", recurse=False)}
    down = {os.path.relpath(p, ROOT): sorted(m for m in _imports(p, True) if m.startswith("dflash_trt.runtime.")
                                             and not m.startswith(backends))
            for p in _py_files("runtime/backends")}
    up, down = {k: v for k, v in up.items() if v}, {k: v for k, v in down.items() if v}
    assert down, "the walk found no backend importing the runtime"
    assert not up, f"runtime modules import the backends at module level (a cycle with {sorted(down)}): {up}"
