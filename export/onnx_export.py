"""`dflash-trt export`: HF target (+ DFlash drafter) checkpoint dirs -> one ONNX graph per K + manifest.json.

Graphs (DESIGN §4, names/io from dflash_trt.abi): target_k{K} per K, target_prefill, drafter_ctx,
drafter_block. Each is traced with torch.onnx.export(dynamo=True); the three custom ops become
`dflash::<Op>` nodes (the op seam, plugins/ops.py) and their FunctionProto bodies are appended afterwards
(plugins/onnx_functions.py, each op's onnx_body.py). Every graph is checked with onnx.checker (full_check) and
against the ABI; weights go to external data when a graph passes 2 GB.

Python: export_graphs(model_dir, drafter_dir, out_dir, ks, sizes) -> Manifest;
        ensure_export(...) reuses a cached export keyed by checkpoint hashes + settings + exporter source.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict

from dflash_trt import log
from dflash_trt.abi import DEFAULT_KS, PoolSizes, graph_io, parse_ks
from dflash_trt.args import ArgumentParser
from dflash_trt.config import cache_root
from dflash_trt.files import entry_lock
from dflash_trt.hashing import source_hash
from dflash_trt.owned import check_replaceable, read_marker, staged_dir
from dflash_trt.export.graphs import run_graph
from dflash_trt.manifest import Manifest, ManifestError, diff_io, expected_graphs

TWO_GB = 2 * 1024**3
MAX_IR = 10  # onnx >= 1.16 writes newer IR versions than onnxruntime 1.30 / TensorRT parsers accept
# Whose source decides what an export contains (the cache key hashes it): the model (modeling/), its graphs (export/),
# the ops' specs, references and ONNX bodies (plugins/), the ABI and the manifest. Whole packages, so a new or
# moved module can never leave the key stale (a change that does not matter only costs one re-export).
_SOURCE_PACKAGES = ("dflash_trt.export", "dflash_trt.modeling", "dflash_trt.plugins")
_SOURCE_MODULES = ("dflash_trt.abi", "dflash_trt.manifest")


def _graph_module(name, target, drafter, in_names, out_names, want_logits):
    """An nn.Module whose forward takes the graph's inputs positionally (ABI order) and returns its outputs."""
    import torch

    class Graph(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.target, self.drafter = target, drafter
            if drafter is not None:  # the drafter borrows these; register them so export sees parameters
                self.embed, self.lm_head = target.embed_tokens, target.lm_head

        def forward(self, *args):
            out = run_graph(name, self.target, self.drafter, dict(zip(in_names, args)), want_logits)
            return tuple(out[n] for n in out_names)

    return Graph().eval()


def _example(ins, batch: int):
    import torch

    return tuple(torch.zeros([batch if isinstance(d, str) else d for d in shape], dtype=getattr(torch, dt))
                 for _, shape, dt in ins)


def _dynamic_shapes(ins):
    from torch.export import Dim

    B = Dim("B", min=1, max=1024)
    return {"args": tuple({i: B for i, d in enumerate(shape) if d == "B"} or None for _, shape, _ in ins)}


def _onnx_io(model):
    """[{name, shape, dtype}] of a ModelProto's inputs and outputs (symbolic dims as 'B')."""
    from onnx import helper

    def rec(v):
        tt = v.type.tensor_type
        dims = ["B" if d.dim_param else d.dim_value for d in tt.shape.dim]
        return {"name": v.name, "shape": dims, "dtype": str(helper.tensor_dtype_to_np_dtype(tt.elem_type))}

    return [rec(v) for v in model.graph.input], [rec(v) for v in model.graph.output]


def export_graph(name, target, drafter, sizes, path, *, batch="B", want_logits=True, kv_dtype="float32",
                 check=True) -> dict:
    """Trace one graph to `path` (+ `path`.data when large); returns {"bytes", "external_data"}."""
    import onnx
    import torch

    from dflash_trt.modeling.fp8 import DQ_OPSET
    from dflash_trt.plugins.onnx_functions import add_functions

    tcfg, dcfg = target.cfg, drafter.cfg if drafter is not None else None
    ins, outs = graph_io(name, tcfg, dcfg, sizes, B=batch, want_logits=want_logits, kv_dtype=kv_dtype)
    mod = _graph_module(name, target, drafter, [n for n, _, _ in ins], [n for n, _, _ in outs], want_logits)
    args = _example(ins, 2 if batch == "B" else batch)
    weights = sum(p.numel() * p.element_size() for p in mod.parameters())
    # FP8 weights dequantize through DequantizeLinear-21 (modeling/fp8.py); other graphs keep the default opset
    fp8 = any(p.dtype == torch.float8_e4m3fn for p in mod.parameters())
    big = weights > TWO_GB - 64 * 1024**2
    log = io.StringIO()
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # torchvision notes
    # opt_einsum (when installed) plans multi-operand einsums on concrete sizes, which pins the batch dim
    opt_einsum = torch.backends.opt_einsum.enabled
    torch.backends.opt_einsum.enabled = False
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), torch.no_grad():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(mod, args, input_names=[n for n, _, _ in ins],
                                     output_names=[n for n, _, _ in outs], dynamo=True, optimize=True, verbose=False,
                                     dynamic_shapes=_dynamic_shapes(ins) if batch == "B" else None,
                                     **({"opset_version": DQ_OPSET} if fp8 else {}))
            model = prog.model_proto
    finally:
        torch.backends.opt_einsum.enabled = opt_einsum
    model.ir_version = min(model.ir_version, MAX_IR)
    add_functions(model)
    model.producer_name, model.doc_string = "dflash-trt", f"dflash-trt graph {name}"
    # written once, finished (function bodies appended): weights beside it past protobuf's 2 GB limit
    onnx.save(model, path, save_as_external_data=big, all_tensors_to_one_file=True,
              location=os.path.basename(path) + ".data")
    got_in, got_out = _onnx_io(model)
    for kind, got, exp in (("input", got_in, ins), ("output", got_out, outs)):
        diff_io(f"exported {path}", kind, got, [{"name": n, "shape": list(s), "dtype": d} for n, s, d in exp],
                "onnx graph", "abi.graph_io")
    if check:
        onnx.checker.check_model(path, full_check=True)
    data = path + ".data"
    size = os.path.getsize(path) + (os.path.getsize(data) if os.path.isfile(data) else 0)
    return {"bytes": size, "external_data": os.path.basename(data) if os.path.isfile(data) else None}


class ExportError(ValueError):
    """An export cannot be written where asked (directory holds other files, cache not writable, ...)."""


KIND = "export"  # the ownership marker's kind (dflash_trt.owned)


def export_graphs(model_dir, drafter_dir, out_dir, ks=DEFAULT_KS, sizes: PoolSizes | None = None, *, batch="B",
                  want_logits=True, dtype="float32", check=True, progress=log.progress, _cache_entry=False,
                  _reuse: Manifest | None = None) -> Manifest:
    """Export every graph of the ABI and write manifest.json, atomically: everything goes into a fresh
    temporary directory beside out_dir, renamed into place only when complete (under out_dir's lock, which
    the engine builder also takes). An older export of ours in out_dir (its ownership marker lists every
    entry, dflash_trt.owned) is replaced as a whole (its engines too: they were built from its graphs), never
    mixed with new files; any other non-empty directory is refused before loading anything. Temporaries of
    killed exports of out_dir are removed. _reuse: a verified export of the same checkpoints and settings whose
    graphs are taken over as they are (hard links), so only the graphs it lacks are traced."""
    from dflash_trt.export.checkpoint import checkpoint_hash, load_drafter, load_target
    from dflash_trt.optional import require_torch

    torch = require_torch("exporting the checkpoint to ONNX", ExportError)

    sizes = sizes or PoolSizes()
    progress = progress or (lambda *_: None)
    out_dir = os.path.abspath(out_dir)
    check_replaceable(out_dir, KIND, ExportError, trust_unmarked=_cache_entry)
    t_all = time.perf_counter()
    tdt = getattr(torch, dtype)
    target = load_target(model_dir, tdt)
    drafter = load_drafter(drafter_dir, target, tdt) if drafter_dir else None
    man = Manifest.new(target.cfg, drafter.cfg if drafter else None, sizes, ks, batch=batch, want_logits=want_logits,
                       kv_dtype=dtype, target={"dir": os.path.abspath(model_dir), "hash": checkpoint_hash(model_dir)},
                       drafter={"dir": os.path.abspath(drafter_dir), "hash": checkpoint_hash(drafter_dir)}
                       if drafter_dir else None)
    with staged_dir(out_dir, KIND, ExportError, trust_unmarked=_cache_entry, lock=True, progress=progress) as tmp:
        man.root = tmp
        names = expected_graphs(man.ks, drafter.cfg.block_size if drafter is not None else None)
        for i, name in enumerate(names, 1):
            if _reuse is not None and name in _reuse.graphs:
                _take_graph(_reuse, name, man, tmp)
                continue
            t0 = time.perf_counter()
            info = export_graph(name, target, drafter, sizes, os.path.join(tmp, name + ".onnx"), batch=batch,
                                want_logits=want_logits, kv_dtype=dtype, check=check)
            dt = time.perf_counter() - t0
            man.add_graph(name, name + ".onnx", seconds=round(dt, 2), **info)
            progress(f"[{i}/{len(names)}] {name:<16} {dt:6.1f} s  {_mb(info['bytes'])}"
                     + (" (external data)" if info["external_data"] else ""))
        if _reuse is not None:
            _take_engines(_reuse, man, tmp)
        man.data["export_seconds"] = round(time.perf_counter() - t_all, 2)
        man.data["exporter"] = _source_hash()
        man.save(tmp)
    man.root = out_dir
    total = sum(g["bytes"] for g in man.data["graphs"].values())
    progress(f"exported {len(names)} graphs to {out_dir} in {man.data['export_seconds']:.1f} s, {_mb(total)} total")
    return man


def _take_graph(src: Manifest, name: str, man: Manifest, tmp: str) -> None:
    """Graph `name` of export `src` into the staged export `tmp`: its files hard-linked (copied across
    filesystems) and its record, sha256 included, as `src` has it."""
    for f in src.graph_files(name):
        _link(f, os.path.join(tmp, os.path.basename(f)))
    man.data["graphs"][name] = dict(src.require_graph(name))


def _take_engines(src: Manifest, man: Manifest, tmp: str) -> None:
    """The engines of `src` built from graphs taken over unchanged (same sha256) come along with their records;
    the engine builder checks each before use as it checks any."""
    recs = {}
    for name, rec in (src.data.get("engines") or {}).items():
        g = man.data["graphs"].get(rec.get("graph"))
        if g is None or g.get("sha256") != src.data["graphs"].get(rec.get("graph"), {}).get("sha256"):
            continue
        dst = os.path.join(tmp, rec["file"])
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        _link(os.path.join(src.root, rec["file"]), dst)
        recs[name] = dict(rec)
    if recs:
        man.data["engines"] = recs


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _mb(n: int) -> str:
    return f"{n / 1024**2:8.2f} MB"


def _source_hash() -> str:
    return source_hash(_SOURCE_PACKAGES, _SOURCE_MODULES)


def ensure_export(model_dir, drafter_dir, ks=DEFAULT_KS, sizes: PoolSizes | None = None, *, cache_dir=None,
                  batch="B", want_logits=True, dtype="float32", progress=log.progress) -> str:
    """Export once, reuse after: one cache entry per checkpoint pair and settings (keyed by both checkpoint
    hashes, the sizes, batch, logits, dtype and a hash of the exporter's source), holding every verify width any
    caller asked for. A width it lacks is added by re-staging the entry with its graphs taken over and only the
    missing ones traced. Returns the manifest directory.

    Process-safe: a hit is verified (every graph's sha256) and used read-only; a miss, a missing width or a
    damaged entry is (re)built under an advisory lock, so concurrent cold starts export once and the others wait;
    exports are atomic (export_graphs) and leftovers of dead exports are removed."""
    from dflash_trt.export.checkpoint import checkpoint_hash

    sizes = sizes or PoolSizes()
    ks = sorted({int(k) for k in ks})
    progress = progress or (lambda *_: None)
    root = cache_dir or cache_root()
    key = json.dumps([checkpoint_hash(model_dir), checkpoint_hash(drafter_dir) if drafter_dir else None,
                      asdict(sizes), batch, want_logits, dtype, _source_hash()])
    out = os.path.join(root, "onnx-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    have = _valid_entry(out, progress)
    if have is not None and set(ks) <= set(have.ks):
        return _record_source_dirs(out, model_dir, drafter_dir)
    where = f"the export cache {root} (set DFLASH_TRT_CACHE to use another directory)"
    try:
        os.makedirs(root, exist_ok=True)
        open(out + ".lock", "a").close()  # entry_lock's file: a read-only cache fails here, in one line
    except OSError as e:
        raise ExportError(f"cannot write {where}: {e.strerror}") from None
    with entry_lock(out, progress, "exporting into"):
        have = _valid_entry(out, progress)  # another process may have finished it meanwhile
        if have is not None and set(ks) <= set(have.ks):
            return _record_source_dirs(out, model_dir, drafter_dir)
        if have is not None:
            progress(f"cached export {out} lacks verify widths {sorted(set(ks) - set(have.ks))}; adding them")
        try:
            export_graphs(model_dir, drafter_dir, out, sorted(set(ks) | set(have.ks if have else ())), sizes,
                          batch=batch, want_logits=want_logits, dtype=dtype, progress=progress, _cache_entry=True,
                          _reuse=have)
        except OSError as e:
            raise ExportError(f"cannot write {where}: {e.strerror}") from None
    return out


def _record_source_dirs(out: str, model_dir, drafter_dir) -> str:
    """A hit keyed by the checkpoints' hashes may come from another copy of the same weights that is gone since
    (another checkout, a moved folder): the caller's dirs, which hold those weights, are recorded in its place."""
    m = Manifest.load(out, check_files=False)
    stale = {}
    for what, d in (("target", model_dir), ("drafter", drafter_dir)):
        rec = m.data.get(what)
        if d and isinstance(rec, dict) and not os.path.isdir(str(rec.get("dir"))):
            stale[what] = {**rec, "dir": os.path.abspath(d)}
    if stale:
        try:
            m.update(**stale)
        except (OSError, ManifestError):  # a read-only cache: the entry is still valid, only its record is stale
            pass
    return out


def _valid_entry(out: str, progress) -> Manifest | None:
    """The manifest of a complete cache entry whose every graph matches its recorded sha256 (read only), or None."""
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        return None
    if (read_marker(out) or {}).get("kind") != KIND:
        progress(f"cached export {out} has no dflash-trt ownership marker (an older dflash-trt wrote it); "
                 "exporting again")
        return None
    try:
        m = Manifest.load(out)
        for g in m.graphs:
            m.verify_graph(g)
    except ManifestError as e:
        progress(f"cached export {out} is damaged ({e}); exporting again")
        return None
    return m


def add_size_args(p: argparse.ArgumentParser) -> None:
    d = PoolSizes()
    for f, v in asdict(d).items():
        p.add_argument("--" + f.replace("_", "-"), type=int, default=v, help=f"pool size {f} (default {v})")


def sizes_from_args(a) -> PoolSizes:
    return PoolSizes(**{f: getattr(a, f) for f in asdict(PoolSizes())})


def _parse_batch(s: str):
    """--batch: 'B' (dynamic) or a positive int, checked before any tracing."""
    if s == "B":
        return s
    try:
        b = int(s)
    except ValueError:
        b = 0
    if b < 1:
        raise ExportError(f"--batch must be 'B' (dynamic) or a positive integer, got {s!r}")
    return b


def main(argv=None) -> int:
    p = ArgumentParser(prog="dflash-trt export", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target checkpoint dir (HF format)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir (omit: target graphs only)")
    p.add_argument("--k", type=parse_ks, default=list(DEFAULT_KS), help="verify widths, e.g. 1,2,3,4,8,16")
    p.add_argument("--out", required=True, help="output directory (graphs + manifest.json)")
    p.add_argument("--batch", default="B", help="'B' for a dynamic batch dim (default) or a fixed int")
    p.add_argument("--no-logits", action="store_true", help="do not output logits (argmax only)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--no-check", action="store_true", help="skip onnx.checker full_check")
    add_size_args(p)
    a = p.parse_args(argv)
    try:
        batch = _parse_batch(a.batch)
        export_graphs(a.model, a.drafter, a.out, a.k, sizes_from_args(a), batch=batch, want_logits=not a.no_logits,
                      dtype=a.dtype, check=not a.no_check)
    except (ValueError, OSError) as e:  # ConfigError / CheckpointError / ManifestError are ValueErrors
        print(f"dflash-trt export: error: {e}", file=sys.stderr)
        return 2
    return 0


