"""Load the engines `dflash-trt build` recorded in a manifest — the base of the TensorRT runtime backend.

`check_engine` refuses, with one message naming what is needed, before anything touches a GPU: an
engine that was never built, whose file is gone or altered, built from an ONNX graph that changed since
(stale), by another TensorRT flavour/version, with a plugin this dflash-trt does not ship, or with
plugin shapes our CUDA kernels cannot run. `check_device` refuses a GPU the engine was not built for
(TensorRT-RTX never runs on CC 9.0 Hopper). `load_engine` then registers the plugin creators,
deserializes, and compares the engine's I/O tensors with the manifest's graph ABI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from dflash_trt.manifest import Manifest, ManifestError, diff_io
from dflash_trt.plugins import trt_compat as C
from dflash_trt.engines.network import cc_str, local_gpu_cc
from dflash_trt.hashing import sha256_files


class EngineError(RuntimeError):
    """An engine cannot be used here (message names what is needed)."""


def _manifest(m) -> Manifest:
    return m if isinstance(m, Manifest) else Manifest.load(m)


def engine_record(man, graph: str) -> dict:
    man = _manifest(man)
    man.require_graph(graph)
    rec = (man.data.get("engines") or {}).get(graph)
    if rec is None:
        raise EngineError(f"no TensorRT engine for graph {graph} in {man.root}: run "
                          f"`dflash-trt build --manifest {man.root}`")
    return rec


def check_engine(man, graph: str, *, allow_unsupported_shapes=False, verify_engine_hash=True) -> dict:
    """The engine's record if it may be loaded by this process; EngineError otherwise (no GPU needed)."""
    from dflash_trt.plugins import trt_plugins

    man = _manifest(man)
    rec = engine_record(man, graph)
    rebuild = f"rebuild with `dflash-trt build --manifest {man.root}`"
    path = os.path.join(man.root, rec["file"])
    if not os.path.isfile(path):
        raise EngineError(f"engine {graph}: file {path} is missing; {rebuild}")
    g = man.require_graph(graph)
    now = sha256_files(man.graph_files(graph))
    if now != rec.get("onnx_sha256"):
        raise EngineError(f"engine {graph} is stale: built from ONNX sha256 {str(rec.get('onnx_sha256'))[:12]}…, but "
                          f"{g['file']} is now {now[:12]}… (re-exported since); {rebuild}")
    if verify_engine_hash and sha256_files([path]) != rec.get("engine_sha256"):
        raise EngineError(f"engine {graph}: {path} differs from the engine that was built (sha256 mismatch); {rebuild}")
    built = rec.get("trt") or {}
    C.require()
    if (built.get("flavour"), built.get("version")) != (C.FLAVOUR, C.VERSION):
        raise EngineError(f"engine {graph} was built with {built.get('flavour')} {built.get('version')}, this process "
                          f"has {C.FLAVOUR} {C.VERSION} (engines are tied to the exact TensorRT); {rebuild} or "
                          f"install {built.get('flavour')}=={built.get('version')}")
    for op, p in (rec.get("plugins") or {}).items():
        if op not in trt_plugins.PLUGINS or p.get("namespace") != trt_plugins.NAMESPACE:
            raise EngineError(f"engine {graph} needs plugin {p.get('namespace')}::{op} which this dflash-trt does not "
                              f"provide (it has {sorted(trt_plugins.PLUGINS)})")
        if p.get("version") != trt_plugins.PLUGIN_VERSIONS[op]:
            raise EngineError(f"engine {graph} needs plugin {op} version {p.get('version')}, this dflash-trt has "
                              f"version {trt_plugins.PLUGIN_VERSIONS[op]}; {rebuild}")
    if rec.get("kernel_warnings") and not allow_unsupported_shapes:
        raise EngineError(f"engine {graph}: the dflash CUDA kernels cannot run its plugin shapes ("
                          + "; ".join(rec["kernel_warnings"]) + "); export a model the kernels support, or "
                          "rebuild with `--no-plugins` for a reference engine")
    return rec


def check_device(rec: dict, cc=None) -> tuple:
    """The GPU's compute capability if it can run the engine; EngineError naming what is needed."""
    cc = cc if cc is not None else local_gpu_cc()
    flavour = (rec.get("trt") or {}).get("flavour")
    if cc is None:
        raise EngineError(f"no CUDA GPU found: running a {flavour} engine needs an NVIDIA GPU with its driver and "
                          "cuda-python (`pip install cuda-python`); " + C.INSTALL_HINT)
    cc = tuple(cc)
    if cc < C.MIN_KERNEL_CC:
        raise EngineError(f"this GPU is CC {cc_str(cc)}; the dflash CUDA kernels need compute capability >= 8.0")
    if flavour == "tensorrt_rtx" and cc not in C.RTX_CCS:
        hint = " (Hopper H100/H200)" if cc == (9, 0) else ""
        raise EngineError(f"TensorRT-RTX does not run on compute capability {cc_str(cc)}{hint}: install full TensorRT "
                          "(`pip install tensorrt`) and rebuild the engines with it")
    ccs = rec.get("compute_capabilities") or []
    if "ampere+" in ccs:
        return cc
    if cc_str(cc) not in ccs:
        raise EngineError(f"engine {rec.get('graph')} was built for CC {', '.join(ccs)}, this GPU is CC {cc_str(cc)}: "
                          f"rebuild with `dflash-trt build --manifest DIR --target-cc {cc[0]}{cc[1]}`")
    return cc


RUNS_ON = ("The engines run with TensorRT-RTX on GPUs of compute capability 8.0/8.6/8.9/12.x (incl. GB10), or with full "
           "TensorRT >= 10 (`pip install tensorrt`) on Hopper H100/H200; `pytest -m trt_gpu` tests them there")


def check_can_execute(cc=None) -> tuple:
    """This process can execute TensorRT engines (a TensorRT flavour imports and accepts this GPU): the GPU's
    compute capability; else EngineError in one line naming why and what would run them. Before any export,
    build or weight load (the trt backend's front doors call it first)."""
    if not C.HAVE_TRT:
        raise EngineError(f"the trt backend cannot run here: TensorRT is not importable ({C.IMPORT_ERROR}); {RUNS_ON}")
    cc = cc if cc is not None else local_gpu_cc()
    if cc is None:
        raise EngineError(f"the trt backend cannot run here: no CUDA GPU found. {RUNS_ON}")
    try:
        return check_device({"trt": C.describe(), "compute_capabilities": ["ampere+"]}, cc)
    except EngineError as e:
        raise EngineError(f"the trt backend cannot run here ({C.FLAVOUR} {C.VERSION}): {e}. {RUNS_ON}") from None


def engine_io(engine) -> dict:
    """{"inputs": [...], "outputs": [...]} of a deserialized engine ({name, shape, dtype}; -1 -> "B")."""
    trt = C.require()
    out = {"inputs": [], "outputs": []}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        kind = "inputs" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "outputs"
        shape = ["B" if d == -1 else int(d) for d in tuple(engine.get_tensor_shape(name))]
        out[kind].append({"name": name, "shape": shape, "dtype": C.dtype_name(engine.get_tensor_dtype(name))})
    return out


def check_io(man, graph: str, io: dict) -> None:
    """EngineError when the engine's I/O differs from the manifest's graph ABI."""
    man = _manifest(man)
    ins, outs = man.io(graph)
    try:
        diff_io(f"engine {graph}", "input", io["inputs"], ins, "engine", "manifest")
        diff_io(f"engine {graph}", "output", io["outputs"], outs, "engine", "manifest")
    except ManifestError as e:
        raise EngineError(str(e)) from None


@dataclass
class LoadedEngine:
    graph: str
    engine: object
    record: dict
    io: dict = field(default_factory=dict)

    def create_context(self):
        ctx = self.engine.create_execution_context()
        if ctx is None:
            raise EngineError(f"engine {self.graph}: TensorRT could not create an execution context (GPU memory?)")
        return ctx


_runtimes: dict = {}


def load_engine(man, graph: str, *, allow_unsupported_shapes=False, cc=None, logger=None) -> LoadedEngine:
    """Check, register the plugin creators, deserialize, and compare I/O with the manifest."""
    from dflash_trt.plugins import trt_plugins

    man = _manifest(man)
    rec = check_engine(man, graph, allow_unsupported_shapes=allow_unsupported_shapes)
    check_device(rec, cc)
    trt = C.require()
    if rec.get("plugins"):
        trt_plugins.register()
        missing = set(rec["plugins"]) - trt_plugins.registered_names()
        if missing:
            raise EngineError(f"engine {graph}: plugin creator(s) {sorted(missing)} are not registered with TensorRT")
    runtime = _runtimes.get(id(logger))
    if runtime is None:
        runtime = _runtimes[id(logger)] = trt.Runtime(logger or trt.Logger(trt.Logger.WARNING))
    with open(os.path.join(man.root, rec["file"]), "rb") as f:
        engine = runtime.deserialize_cuda_engine(f.read())
    if engine is None:
        raise EngineError(f"engine {graph}: TensorRT could not deserialize {rec['file']} (see its errors above)")
    io = engine_io(engine)
    check_io(man, graph, io)
    return LoadedEngine(graph, engine, rec, io)
