"""`dflash-trt build`: TensorRT engines for an exported graph set (DESIGN §4).

    dflash-trt build --manifest OUT [--k 1,16] [--timing-cache FILE] [--target-cc 86,89,120]

Reads OUT/manifest.json (written by `dflash-trt export`), parses each graph with the dflash plugin
creators registered, checks that every `dflash` node became a PLUGIN_V3 layer, builds one engine per
K plus target_prefill and the drafter graphs (a dynamic batch dim becomes a 1..max_seqs profile),
writes OUT/engines/<graph>.engine and records each engine under "engines" in the manifest: file, K,
TensorRT flavour and version, compute capabilities, plugin versions, the source ONNX sha256, I/O.
`--no-plugins` builds with the ONNX function bodies inlined instead (reference / debugging).
`dflash-trt build --backend torch --model M [--drafter D]` builds the torch backend's compiled steps instead
(tools/prebuild.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

from dflash_trt import log
from dflash_trt.abi import parse_ks, parse_target_graph
from dflash_trt.args import ArgumentParser
from dflash_trt.files import entry_lock, write_bytes
from dflash_trt.hashing import sha256_files
from dflash_trt.manifest import Manifest, ManifestError, diff_io
from dflash_trt.owned import claim
from dflash_trt.plugins import trt_compat as C
from dflash_trt.engines.network import (BuildError, builder_config, cc_str, fp8_weights, local_gpu_cc,
                                        network_io, parse_cc, parse_graph, resolve_ccs)

ENGINE_DIR = "engines"
RECORD_VERSION = 1


def _mib(n: int) -> str:
    return f"{n / 1024**2:.2f} MiB"


def select_graphs(man: Manifest, ks=None, graphs=None) -> list:
    """Graphs to build: explicit names, else target_k{K} for each K (default: all), prefill and drafters."""
    if graphs:
        for g in graphs:
            man.require_graph(g)
        return list(graphs)
    if ks:
        man.check(ks=ks)
    keep = set(ks or man.ks)
    return [g for g in man.graphs if parse_target_graph(g) is None or parse_target_graph(g) in keep]


def _load_timing_cache(cfg_factory, path):
    data = b""
    if path and os.path.isfile(path):
        with open(path, "rb") as f:
            data = f.read()
    return cfg_factory().create_timing_cache(data)


def build_one(man: Manifest, name: str, *, builder, ccs, plugins=True, batch=None, timing_cache=None,
              opt_level=None) -> dict:
    """Build the engine of graph `name`, write it into man.root/engines and record it in the manifest;
    returns its record. The export directory must be ours (dflash_trt.owned marker) and is claimed, written
    and recorded under its lock, so concurrent builders and exports of it lose nothing."""
    from dflash_trt.plugins import trt_plugins

    rec_g = man.require_graph(name)
    onnx_path = man.graph_path(name)
    onnx_sha256 = man.verify_graph(name)  # never build (and vouch for) a graph the export did not write
    t0 = time.perf_counter()
    trt_plugins.KERNEL_WARNINGS.clear()
    trt_plugins.SHAPE_ERRORS.clear()
    network, parser, info = parse_graph(builder, onnx_path, plugins=plugins)
    io = network_io(network)
    ins, outs = man.io(name)
    diff_io(f"graph {name}", "input", io["inputs"], ins, "TensorRT network", "manifest")
    diff_io(f"graph {name}", "output", io["outputs"], outs, "TensorRT network", "manifest")
    dynamic = any(d == "B" for t in io["inputs"] for d in t["shape"])
    cfg = builder_config(builder, network, ccs=ccs, batch=batch if dynamic else None, timing_cache=timing_cache,
                         opt_level=opt_level)
    t1 = time.perf_counter()
    plan = builder.build_serialized_network(network, cfg)
    t2 = time.perf_counter()
    if trt_plugins.SHAPE_ERRORS:
        raise BuildError(f"graph {name}: dflash node inputs do not fit the op signatures: "
                         + "; ".join(sorted({m for _, m in trt_plugins.SHAPE_ERRORS})))
    if plan is None:
        raise BuildError(f"TensorRT failed to build {name} (see the TensorRT errors above)")
    rel = f"{ENGINE_DIR}/{name}.engine"
    path = os.path.join(man.root, ENGINE_DIR, name + ".engine")
    with entry_lock(man.root, lambda *_: None, "building engines in"):
        claim(man.root, "export", [rel], BuildError)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_bytes(path, plan)
        rec = _record(man, name, path, rec_g, onnx_sha256, ccs, info, io, batch if dynamic else None,
                      (round(t1 - t0, 2), round(t2 - t1, 2)))
        man.update(engines={name: rec})
    return rec


def _record(man, name, path, rec_g, onnx_sha256, ccs, info, io, batch, seconds) -> dict:
    """The manifest record of the engine just written at `path`."""
    from dflash_trt.plugins import trt_plugins

    warns = sorted({f"{op}: {msg}" for op, msg in trt_plugins.KERNEL_WARNINGS})
    return {
        "record_version": RECORD_VERSION,
        "file": os.path.relpath(path, man.root), "graph": name, "k": parse_target_graph(name),
        "onnx": rec_g["file"], "onnx_sha256": onnx_sha256,
        "engine_sha256": sha256_files([path]), "bytes": os.path.getsize(path),
        "trt": C.describe(), "compute_capabilities": [cc_str(c) for c in ccs],
        "plugins": {op: {"namespace": trt_plugins.NAMESPACE, "version": trt_plugins.PLUGIN_VERSIONS[op], "layers": n}
                    for op, n in sorted(info["plugin_layers"].items())},
        "inlined_ops": info["inlined"], "layers": info["layers"],
        "batch": dict(zip(("min", "opt", "max"), batch)) if batch else None,
        "io": io, "kernel_warnings": warns,
        "parse_seconds": seconds[0], "build_seconds": seconds[1],
    }


OPT_LEVELS = range(0, 6)  # TensorRT's builder_optimization_level (IBuilderConfig): 0..5


def _first_fp8(man: Manifest, names) -> str | None:
    """Where the first graph to build with FP8 weights holds them ("target_k1 holds 25 FP8 weights (first 'w')"),
    or None."""
    for name in names:
        found = fp8_weights(man.graph_path(name))
        if found:
            return f"{name} holds {len(found)} FP8 weights (first '{found[0]}')"
    return None


def check_build_args(max_batch=None, opt_batch=None, opt_level=None) -> None:
    """Values that cannot be meant, refused in one line (never a silent fall-back to the default)."""
    for flag, v in (("--max-batch", max_batch), ("--opt-batch", opt_batch)):
        if v is not None and v < 1:
            raise BuildError(f"{flag} must be >= 1, got {v}")
    if opt_level is not None and opt_level not in OPT_LEVELS:
        raise BuildError(f"--opt-level {opt_level} outside TensorRT's range "
                         f"{OPT_LEVELS.start}..{OPT_LEVELS.stop - 1}")


def build_engines(manifest_dir: str, *, ks=None, graphs=None, timing_cache_path=None, target_cc=None, plugins=True,
                  max_batch=None, opt_batch=None, opt_level=None, progress=log.progress) -> Manifest:
    """Build the selected graphs of a manifest directory; records them in its manifest.json."""
    check_build_args(max_batch=max_batch, opt_batch=opt_batch, opt_level=opt_level)  # before TensorRT loads
    trt = C.require()
    progress = progress or (lambda *_: None)
    man = Manifest.load(manifest_dir)
    names = select_graphs(man, ks, graphs)
    claim(man.root, "export", [], BuildError)  # an export we did not write: refused before any build
    gpu = local_gpu_cc()
    ccs = resolve_ccs(parse_cc(target_cc) if target_cc else None, gpu, fp8=_first_fp8(man, names))
    maxb = int(max_batch if max_batch is not None else (man.batch if isinstance(man.batch, int) else man.sizes.max_seqs))
    optb = int(opt_batch if opt_batch is not None else 1)
    if not 1 <= optb <= maxb:
        raise BuildError(f"--opt-batch {optb} must be in 1..--max-batch {maxb}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache = None
    if not C.IS_RTX:
        cache = _load_timing_cache(builder.create_builder_config, timing_cache_path)
    progress(f"dflash-trt build: {C.FLAVOUR} {C.VERSION}; CC {', '.join(cc_str(c) for c in ccs)}"
             f"{' (no GPU here)' if gpu is None else f' (GPU CC {cc_str(gpu)})'}; plugins "
             f"{'on' if plugins else 'off (ONNX function bodies inlined)'}; batch 1..{maxb}; {len(names)} engines")
    t_all = time.perf_counter()
    for i, name in enumerate(names, 1):
        rec = build_one(man, name, builder=builder, ccs=ccs, plugins=plugins, batch=(1, optb, maxb),
                        timing_cache=cache, opt_level=opt_level)
        # recorded by build_one after every engine: an interrupted build keeps what it finished
        plug = ", ".join(f"{op}x{r['layers']}" for op, r in rec["plugins"].items()) or (
            f"inlined {sum(rec['inlined_ops'].values())} dflash nodes" if rec["inlined_ops"] else "no dflash nodes")
        progress(f"[{i}/{len(names)}] {name:<16} parse {rec['parse_seconds']:5.1f} s  build {rec['build_seconds']:6.1f} s"
                 f"  {_mib(rec['bytes']):>11}  {rec['layers']:4d} layers  [{plug}]  -> {rec['file']}")
        for w in rec["kernel_warnings"]:
            progress(f"    warning: the dflash CUDA kernels cannot run this engine's plugin shapes: {w}")
    tc_file = None
    if cache is not None and timing_cache_path:
        rel = os.path.relpath(os.path.abspath(timing_cache_path), man.root)
        with entry_lock(man.root, lambda *_: None, "building engines in"):
            if not rel.startswith(".."):  # written into the export: claimed like its engines
                claim(man.root, "export", [rel.replace(os.sep, "/")], BuildError)
            write_bytes(timing_cache_path, cache.serialize())
        tc_file = os.path.abspath(timing_cache_path)
    elif timing_cache_path:
        progress("timing cache: not used by TensorRT-RTX (it picks kernels when the engine loads); nothing saved")
    man.update(engine_build={"trt": C.describe(), "compute_capabilities": [cc_str(c) for c in ccs],
                             "plugins": plugins, "timing_cache": tc_file,
                             "seconds": round(time.perf_counter() - t_all, 2)})
    total = sum(man.data["engines"][n]["bytes"] for n in names)
    progress(f"built {len(names)} engines in {time.perf_counter() - t_all:.1f} s, {_mib(total)} total; "
             f"recorded in {os.path.join(man.root, 'manifest.json')}")
    return man


def ensure_engines(manifest_dir: str, graphs=None, progress=log.progress) -> Manifest:
    """Build the engines of `graphs` (default: all) that are missing, stale or from another TensorRT; keep the
    others. The trt backend's front doors call this after the export (the cache entry gains its engines)."""
    from dflash_trt.engines.load import EngineError, check_engine

    def missing(man):
        need = []
        for g in graphs or man.graphs:
            try:
                check_engine(man, g, allow_unsupported_shapes=True)  # kernel-shape refusals: load_engine's
            except EngineError:
                need.append(g)
        return need

    man = Manifest.load(manifest_dir)
    if missing(man):  # under the entry's lock: concurrent front doors build once, the others wait and reuse
        try:
            with entry_lock(man.root, progress or log.progress, "building engines in"):
                need = missing(Manifest.load(manifest_dir))  # what another process built meanwhile is kept
                if need:
                    build_engines(manifest_dir, graphs=need, progress=progress)
        except OSError as e:
            raise BuildError(f"cannot write engines into {man.root}: {e.strerror or e}") from None
        man = Manifest.load(manifest_dir)
    return man


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", default="trt")
    if pre.parse_known_args(argv)[0].backend == "torch":
        from dflash_trt.tools.prebuild import main as torch_main  # the torch backend's compiled steps

        return torch_main(argv)
    p = ArgumentParser(prog="dflash-trt build", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["trt", "torch"], default="trt",
                   help="trt (default): engines of an export; torch: the torch backend's compiled GPU steps "
                        "(dflash-trt build --backend torch --help)")
    p.add_argument("--manifest", required=True, help="directory of `dflash-trt export` (or its manifest.json)")
    p.add_argument("--k", type=parse_ks, help="build target_k{K} for these K only (default: every exported K)")
    p.add_argument("--graphs", help="comma-separated graph names to build (overrides --k)")
    p.add_argument("--timing-cache", help="TensorRT timing cache file: read if present, written after the build")
    p.add_argument("--target-cc", help="compute capabilities, e.g. 86,89,120 (TensorRT-RTX; default: this GPU, or "
                                       "all of 8.0/8.6/8.9/12.0/12.1 without one), 'current', or 'ampere+' (full TRT)")
    p.add_argument("--max-batch", type=int, help="batch profile max (default: the manifest's max_seqs)")
    p.add_argument("--opt-batch", type=int, help="batch profile opt (default 1)")
    p.add_argument("--opt-level", type=int, help="TensorRT builder optimization level (0-5)")
    p.add_argument("--no-plugins", action="store_true", help="do not register the dflash plugins: inline the ONNX "
                                                               "function bodies (slow reference engines)")
    a = p.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            build_engines(a.manifest, ks=a.k, graphs=a.graphs.split(",") if a.graphs else None,
                          timing_cache_path=a.timing_cache, target_cc=a.target_cc, plugins=not a.no_plugins,
                          max_batch=a.max_batch, opt_batch=a.opt_batch, opt_level=a.opt_level)
    except (BuildError, ManifestError, C.TensorRTMissing, C.ParserLibError, OSError) as e:
        print(f"dflash-trt build: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
