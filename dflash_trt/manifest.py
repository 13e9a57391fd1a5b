"""manifest.json: the one on-disk description of an exported graph set (DESIGN §4).

Written by the exporter next to the graphs, read by every backend that runs them (ort, trt) and by
the engine builder. It records the graph files and, for each, every input/output name, shape and
dtype (from dflash_trt.abi.graph_io — never restated), the K list, pool shapes and sizes, block size,
tap ids, mask id, vocab, eos ids, the configs and hashes of the source checkpoints.
The batch dim is the string "B" when the graphs take a dynamic batch, else an int.

`Manifest.load(dir)` validates the file against the ABI of this dflash-trt; `check(...)` and
`check_inputs(...)` compare it with what a caller is about to do. Every error is a ManifestError that
names what differs. numpy/json only (the runtime core imports this).
"""
from __future__ import annotations

import os
from dataclasses import asdict, fields

import numpy as np

from dflash_trt.files import entry_lock, write_json
from dflash_trt.abi import (DRAFTER_CTX, MAX_K, PREFILL, PoolSizes, drafter_block_graph, drafter_block_lens,
                            graph_io, parse_target_graph, pool_specs, target_graph)
from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig, read_json
from dflash_trt.hashing import sha256_files

FORMAT = "dflash-trt-manifest"
VERSION = 3  # 2: every graph record carries the sha256 of its files; 3: target_prefill's argmax/logits are [B, 1]
FILENAME = "manifest.json"


class ManifestError(ValueError):
    """manifest.json is missing/invalid, or does not match the graphs, checkpoints or sizes in use."""


def _io_json(specs):
    return [{"name": n, "shape": list(s), "dtype": d} for n, s, d in specs]


def expected_graphs(ks, block_size: int | None) -> list[str]:
    """The graphs of a manifest for verify widths ks; block_size None: no drafter. A drafter block graph per
    block length γ+1 in ks (abi.drafter_block_lens) besides the full one."""
    names = [target_graph(k) for k in ks] + [PREFILL]
    if block_size is None:
        return names
    return names + [DRAFTER_CTX] + [drafter_block_graph(bs, block_size) for bs in drafter_block_lens(ks, block_size)]


class Manifest:
    def __init__(self, data: dict, root: str | None = None):
        self.data, self.root = data, root

    # ---- construction (exporter) ----------------------------------------------------
    @classmethod
    def new(cls, tcfg: TargetConfig, dcfg: DrafterConfig | None, sizes: PoolSizes, ks, *, batch="B",
            want_logits=True, kv_dtype="float32", target=None, drafter=None) -> Manifest:
        """target / drafter: {"dir": ..., "hash": ...} of the source checkpoints."""
        ks = sorted({int(k) for k in ks})
        if not ks or ks[0] < 1 or ks[-1] > MAX_K:
            raise ManifestError(f"K list {ks} must be non-empty with every K in 1..{MAX_K}")
        data = {
            "format": FORMAT, "version": VERSION,
            "ks": ks, "batch": batch, "want_logits": bool(want_logits), "kv_dtype": kv_dtype,
            "sizes": asdict(sizes),
            "target": {**(target or {}), "config": asdict(tcfg)},
            "drafter": None if dcfg is None else {**(drafter or {}), "config": asdict(dcfg)},
            "block_size": dcfg.block_size if dcfg else None,
            "tap_ids": list(dcfg.target_layer_ids) if dcfg else [],
            "mask_token_id": dcfg.mask_token_id if dcfg else None,
            "vocab_size": tcfg.vocab_size, "eos_token_ids": list(tcfg.eos_token_ids),
            "pools": {n: {"shape": list(s), "dtype": d} for n, (s, d) in pool_specs(tcfg, dcfg, sizes, kv_dtype).items()},
            "graphs": {},
        }
        return cls(data)

    def add_graph(self, name: str, file: str, external_data: str | None = None, **extra) -> None:
        """Record a written graph file (+ its external-data file) with the sha256 of their bytes."""
        ins, outs = self.abi_io(name)
        self.data["graphs"][name] = {"file": file, "external_data": external_data, "inputs": _io_json(ins),
                                     "outputs": _io_json(outs), **extra}
        self.data["graphs"][name]["sha256"] = sha256_files(self._files(name, self.root))

    def save(self, root: str) -> str:
        os.makedirs(root, exist_ok=True)
        path = write_json(os.path.join(root, FILENAME), self.data)
        self.root = root
        return path

    def update(self, engines: dict | None = None, **fields) -> None:
        """Add `engines` (name -> record) and set top-level `fields` in root/manifest.json under the directory's
        lock (entry_lock, shared with the exporter and the builders), re-reading the file inside it: concurrent
        writers of one manifest each add their records and none is lost. self.data becomes the merged file."""
        path = os.path.join(self.root, FILENAME)
        with entry_lock(self.root, lambda *_: None, "recording into"):
            try:
                data = read_json(path)
            except ConfigError as e:
                raise ManifestError(str(e)) from None
            if engines:
                data["engines"] = {**(data.get("engines") or {}), **engines}
            data.update(fields)
            write_json(path, data)
        self.data = data

    # ---- loading + validation ---------------------------------------------------------
    @classmethod
    def load(cls, root: str, check_files: bool = True) -> Manifest:
        path = os.path.join(root, FILENAME) if os.path.isdir(root) or not root.endswith(".json") else root
        root = os.path.dirname(path)
        if not os.path.isfile(path):
            raise ManifestError(f"{path}: no manifest (run `dflash-trt export ... --out {root}` first)")
        try:
            data = read_json(path)
        except ConfigError as e:
            raise ManifestError(str(e)) from None
        if data.get("format") != FORMAT:
            raise ManifestError(f"{path}: not a dflash-trt manifest (format {data.get('format')!r}, expected {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ManifestError(f"{path}: manifest version {data.get('version')} but this dflash-trt reads {VERSION}; "
                                f"re-run `dflash-trt export`")
        for key in ("ks", "batch", "sizes", "target", "graphs", "kv_dtype", "want_logits", "pools"):
            if key not in data:
                raise ManifestError(f"{path}: missing field '{key}'")
        m = cls(data, root)
        m._validate(path, check_files)
        return m

    def _validate(self, path: str, check_files: bool) -> None:
        try:
            tcfg, dcfg, sizes = self.target_config, self.drafter_config, self.sizes
        except (TypeError, ValueError) as e:
            raise ManifestError(f"{path}: bad config/sizes record ({e})") from None
        want = expected_graphs(self.ks, dcfg.block_size if dcfg is not None else None)
        missing = [g for g in want if g not in self.data["graphs"]]
        if missing:
            raise ManifestError(f"{path}: graph(s) {missing} missing from 'graphs' (K list {self.ks})")
        pools = pool_specs(tcfg, dcfg, sizes, self.kv_dtype)
        for n, (shape, dt) in pools.items():
            rec = self.data["pools"].get(n)
            if rec is None or list(rec["shape"]) != list(shape) or rec["dtype"] != dt:
                raise ManifestError(f"{path}: pool {n} recorded as {rec} but sizes/configs give shape {list(shape)} {dt}")
        for g, rec in self.data["graphs"].items():
            ins, outs = self.abi_io(g)
            for kind, got, exp in (("input", rec.get("inputs"), ins), ("output", rec.get("outputs"), outs)):
                diff_io(f"{path}: graph {g}", kind, got or [], _io_json(exp), "manifest", "this dflash-trt's ABI")
            if not isinstance(rec.get("sha256"), str):
                raise ManifestError(f"{path}: graph {g}: no sha256 recorded")
            missing = [f for f in self.graph_files(g) if not os.path.isfile(f)] if check_files else []
            if missing:
                raise ManifestError(f"{path}: graph {g}: file {missing[0]} does not exist")

    # ---- accessors --------------------------------------------------------------------
    @property
    def ks(self) -> list[int]:
        return [int(k) for k in self.data["ks"]]

    @property
    def batch(self):
        return self.data["batch"]

    @property
    def kv_dtype(self) -> str:
        return self.data["kv_dtype"]

    @property
    def want_logits(self) -> bool:
        return bool(self.data["want_logits"])

    @property
    def sizes(self) -> PoolSizes:
        names = {f.name for f in fields(PoolSizes)}
        extra = set(self.data["sizes"]) - names
        if extra:
            raise ValueError(f"unknown sizes field(s) {sorted(extra)}")
        return PoolSizes(**self.data["sizes"])

    @property
    def target_config(self) -> TargetConfig:
        return TargetConfig(**self.data["target"]["config"])

    @property
    def drafter_config(self) -> DrafterConfig | None:
        d = self.data.get("drafter")
        return None if not d else DrafterConfig(**d["config"])

    @property
    def graphs(self) -> list[str]:
        return list(self.data["graphs"])

    def abi_io(self, name: str):
        """(inputs, outputs) of graph `name` from abi.graph_io with this manifest's configs and sizes."""
        return graph_io(name, self.target_config, self.drafter_config, self.sizes, B=self.batch,
                        want_logits=self.want_logits, kv_dtype=self.kv_dtype)

    def require_graph(self, name: str) -> dict:
        rec = self.data["graphs"].get(name)
        if rec is None:
            k = parse_target_graph(name)
            if k is not None:
                raise ManifestError(f"K={k} not exported: {self.root} has target graphs for K {self.ks} "
                                    f"(re-export with --k including {k})")
            raise ManifestError(f"graph '{name}' not exported in {self.root} (has {self.graphs})")
        return rec

    def graph_path(self, name: str) -> str:
        return os.path.join(self.root or ".", self.require_graph(name)["file"])

    def _files(self, name: str, root: str | None) -> list[str]:
        rec = self.data["graphs"][name]
        return [os.path.join(root or ".", f) for f in (rec["file"], rec.get("external_data")) if f]

    def graph_files(self, name: str) -> list[str]:
        """The files whose bytes are graph `name`: the .onnx and its external-data file, if any."""
        self.require_graph(name)
        return self._files(name, self.root)

    def verify_graph(self, name: str) -> str:
        """Check graph `name`'s files against the sha256 the exporter recorded; returns it. A graph rewritten,
        truncated or left by another (interrupted) export is refused with one line naming what to re-run."""
        want = self.require_graph(name)["sha256"]
        try:
            got = sha256_files(self.graph_files(name))
        except OSError as e:
            raise ManifestError(f"graph {name}: cannot read {e.filename}: {e.strerror}; "
                                f"re-run `dflash-trt export ... --out {self.root}`") from None
        if got != want:
            raise ManifestError(f"graph {name}: {self.graph_path(name)} is not the file this manifest's export wrote "
                                f"(sha256 {got[:12]}…, recorded {want[:12]}…); re-run `dflash-trt export ... --out {self.root}`")
        return got

    def io(self, name: str) -> tuple[list[dict], list[dict]]:
        rec = self.require_graph(name)
        return rec["inputs"], rec["outputs"]

    # ---- comparisons with what the caller has -------------------------------------------
    def check(self, *, ks=None, sizes: PoolSizes | None = None, target_hash=None, drafter_hash=None,
              kv_dtype=None) -> None:
        """Raise ManifestError naming the first thing that differs from the caller's expectations."""
        if ks is not None:
            miss = sorted({int(k) for k in ks} - set(self.ks))
            if miss:
                raise ManifestError(f"K {miss} not exported in {self.root} (manifest K list {self.ks})")
        if sizes is not None and asdict(sizes) != self.data["sizes"]:
            diff = {k: (v, self.data["sizes"].get(k)) for k, v in asdict(sizes).items() if self.data["sizes"].get(k) != v}
            raise ManifestError("pool sizes differ from the exported graphs' (static) sizes: " +
                                ", ".join(f"{k}: wanted {a}, manifest {b}" for k, (a, b) in diff.items()))
        for what, h in (("target", target_hash), ("drafter", drafter_hash)):
            rec = self.data.get(what) or {}
            if h is not None and rec.get("hash") != h:
                raise ManifestError(f"{what} checkpoint hash differs: checkpoint {h}, manifest {rec.get('hash')} "
                                    f"(exported from {rec.get('dir')}); re-export")
        if kv_dtype is not None and kv_dtype != self.kv_dtype:
            raise ManifestError(f"kv dtype differs: wanted {kv_dtype}, manifest {self.kv_dtype}")

    def check_inputs(self, name: str, inputs: dict) -> None:
        """Names, dtypes and shapes of a feed (numpy arrays) against graph `name`."""
        ins, _ = self.io(name)
        want = [i["name"] for i in ins]
        if sorted(inputs) != sorted(want):
            raise ManifestError(f"graph {name}: inputs {sorted(inputs)} but the exported graph takes {want}")
        for spec in ins:
            a = inputs[spec["name"]]
            if not _shape_ok(a.shape, spec["shape"]):
                raise ManifestError(f"graph {name}: input {spec['name']} has shape {list(a.shape)}, the exported graph "
                                    f"expects {spec['shape']}")
            if np.dtype(a.dtype) != np.dtype(spec["dtype"]):
                raise ManifestError(f"graph {name}: input {spec['name']} is {a.dtype}, the exported graph expects "
                                    f"{spec['dtype']}")


def _shape_ok(shape, spec) -> bool:
    return len(shape) == len(spec) and all(isinstance(s, str) or int(s) == d for d, s in zip(shape, spec))


def diff_io(where: str, kind: str, got: list, exp: list, got_name: str = "graph", exp_name: str = "manifest") -> None:
    """Compare two io lists ({name, shape, dtype}); raise naming the first difference (also used by backends)."""
    gn, en = [g["name"] for g in got], [e["name"] for e in exp]
    if gn != en:
        raise ManifestError(f"{where}: {kind} names {gn} in {got_name}, {en} in {exp_name}")
    for g, e in zip(got, exp):
        if [str(x) for x in g["shape"]] != [str(x) for x in e["shape"]]:
            raise ManifestError(f"{where}: {kind} {g['name']} dims {g['shape']} in {got_name}, {e['shape']} in {exp_name}")
        if g["dtype"] != e["dtype"]:
            raise ManifestError(f"{where}: {kind} {g['name']} dtype {g['dtype']} in {got_name}, {e['dtype']} in {exp_name}")


class ManifestBacked:
    """What a Runtime needs from a backend over an export (ort, trt): configs and pool sizes, from its manifest."""

    manifest: Manifest

    @property
    def tcfg(self):
        return self.manifest.target_config

    @property
    def dcfg(self):
        return self.manifest.drafter_config

    @property
    def sizes(self):
        return self.manifest.sizes

    def step_widths(self) -> tuple:
        """The exported verify widths (Backend.step_widths)."""
        return tuple(self.manifest.data["ks"])

    def weights_id(self, which: str):
        """'checkpoint:<hash>' of the checkpoint the export was made from (Backend.weights_id)."""
        h = (self.manifest.data.get(which) or {}).get("hash")
        return f"checkpoint:{h}" if h else None
