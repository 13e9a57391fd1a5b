"""`dflash-trt compare`: run the same prompts step by step on several backends and compare every graph output.

The first backend drives a Runtime (prefill, then steps cycling through the exported K: K=1 decode,
K>1 a spec step with γ = K-1). Every graph launch is run on all backends with the *same* inputs
through polygraphy's Comparator (one BaseRunner per backend and graph); each output is compared with
polygraphy's SimpleCompareFunc against the first backend, and logits by top-k KL. The first backend's
outputs feed the runtime, so all backends always see identical inputs.

Report: per (graph, output) max abs / rel error and worst step; per step the top-k KL of logits.
Exit 0 when everything is within tolerance, 1 naming each output over it, 2 on bad input.
Python: compare(manifest_dir, ["torch", "ort"]) -> CompareReport (.ok, .failures, .format()).
"""
from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from dflash_trt.args import ArgumentParser
from dflash_trt.manifest import Manifest, ManifestError

DEFAULT_PROMPTS = ["def fibonacci(n):\n    ", "The quick brown fox jumps over the lazy dog because"]
DEFAULT_TOL = {"float32": 1e-4, "float64": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}


def topk_kl(ref_logits, logits, k: int = 10) -> float:
    """Max over rows of KL(P || Q) on the reference's top-k tokens plus one bucket for the rest."""
    a = np.asarray(ref_logits, np.float64).reshape(-1, ref_logits.shape[-1])
    b = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    p = np.exp(a - a.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(b - b.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    k = min(k, a.shape[-1])
    idx = np.argsort(-a, axis=-1)[:, :k]
    pk, qk = np.take_along_axis(p, idx, -1), np.take_along_axis(q, idx, -1)
    P = np.concatenate([pk, np.clip(1 - pk.sum(-1, keepdims=True), 0, None)], -1)
    Q = np.concatenate([qk, np.clip(1 - qk.sum(-1, keepdims=True), 0, None)], -1)
    eps = 1e-30
    kl = (P * (np.log(P + eps) - np.log(Q + eps))).sum(-1)
    return float(max(kl.max(), 0.0)) if kl.size else 0.0


def _runner_cls():
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class BackendRunner(BaseRunner):
        """polygraphy runner over one of our backends for one graph (inputs/outputs from the manifest)."""

        def __init__(self, backend, graph: str, manifest: Manifest, name: str):
            super().__init__(name=name)
            self.backend, self.graph, self.manifest = backend, graph, manifest

        def activate_impl(self):
            pass

        def deactivate_impl(self):
            pass

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for spec in self.manifest.io(self.graph)[0]:
                meta.add(spec["name"], np.dtype(spec["dtype"]), [None if isinstance(d, str) else d for d in spec["shape"]])
            return meta

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            out = self.backend.run(self.graph, dict(feed_dict))
            self.inference_time = time.perf_counter() - t0
            return OrderedDict((o["name"], np.asarray(out[o["name"]])) for o in self.manifest.io(self.graph)[1])

    return BackendRunner


@dataclass
class OutputStat:
    pair: tuple
    graph: str
    output: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_step: int = -1
    failed_steps: list = field(default_factory=list)


@dataclass
class CompareReport:
    backends: list
    atol: float
    rtol: float
    kl_tol: float
    topk: int
    stats: dict = field(default_factory=dict)  # (pair, graph, output) -> OutputStat
    kl: list = field(default_factory=list)  # (step, graph, pair, kl)
    steps: int = 0

    @property
    def failures(self) -> list[str]:
        out = [] if self.stats else ["nothing was compared (no graph output recorded)"]  # no PASS on nothing
        for s in self.stats.values():
            if s.failed_steps:
                out.append(f"{s.graph}/{s.output} ({s.pair[1]} vs {s.pair[0]}): max abs {s.max_abs:.3g}, max rel "
                           f"{s.max_rel:.3g} over atol {self.atol:g} / rtol {self.rtol:g} at steps {s.failed_steps[:8]}")
        for step, graph, pair, kl in self.kl:
            if kl > self.kl_tol:
                out.append(f"{graph}/logits ({pair[1]} vs {pair[0]}): top-{self.topk} KL {kl:.3g} > {self.kl_tol:g} "
                           f"at step {step}")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [(f"compare {' vs '.join(self.backends)}: {self.steps} graph launches, atol {self.atol:g}, "
                  f"rtol {self.rtol:g}, top-{self.topk} KL tol {self.kl_tol:g}"),
                 f"{'graph/output':<28} {'pair':<16} {'max abs':>10} {'max rel':>10} {'step':>5}  status"]
        for s in sorted(self.stats.values(), key=lambda s: (s.graph, s.output, s.pair)):
            lines.append(f"{s.graph + '/' + s.output:<28} {s.pair[1] + '/' + s.pair[0]:<16} {s.max_abs:10.3g} "
                         f"{s.max_rel:10.3g} {s.worst_step:5d}  {'FAIL' if s.failed_steps else 'ok'}")
        if self.kl:
            lines.append("top-k KL of logits per step (vs " + self.backends[0] + "):")
            lines += [f"  step {st:3d} {g:<16} {p[1]:<8} {kl:.3e}" for st, g, p, kl in self.kl]
            lines.append(f"max top-{self.topk} KL: {max(k for *_, k in self.kl):.3e}")
        fails = self.failures
        lines += ["FAIL: " + f for f in fails] if fails else ["PASS: every output within tolerance"]
        return "\n".join(lines)


class _Tee:
    """Backend for the Runtime: runs each launch on all backends (polygraphy), records, returns the first's."""

    def __init__(self, backends, names, manifest: Manifest, report: CompareReport):
        self.backends, self.names, self.manifest, self.report = backends, names, manifest, report
        self.name, self.kv_dtype = "compare", backends[0].kv_dtype
        self.Runner = _runner_cls()

    def run(self, graph: str, inputs: dict) -> dict:
        from polygraphy.comparator import Comparator
        from polygraphy.comparator.compare import SimpleCompareFunc

        r = self.report
        step = r.steps
        r.steps += 1
        runners = [self.Runner(be, graph, self.manifest, n) for be, n in zip(self.backends, self.names)]
        with np.errstate(divide="ignore", invalid="ignore"):  # rel. error of a 0 ref divides by 0
            results = Comparator.run(runners, data_loader=[inputs])
        ints = {o["name"]: 0 for o in self.manifest.io(graph)[1] if "int" in o["dtype"]}
        func = SimpleCompareFunc(atol={"": r.atol, **ints}, rtol={"": r.rtol, **ints}, check_shapes=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            acc = Comparator.compare_accuracy(results, comparisons=[(0, i) for i in range(1, len(runners))],
                                              compare_func=func)
        for pair, iters in acc[0].items():
            for out_name, res in iters[0].items():
                s = r.stats.setdefault((pair, graph, out_name), OutputStat(pair, graph, out_name))
                if res.max_absdiff is not None and res.max_absdiff >= s.max_abs:
                    s.max_abs, s.worst_step = float(res.max_absdiff), step
                s.max_rel = max(s.max_rel, float(res.max_reldiff or 0.0))
                if not bool(res):
                    s.failed_steps.append(step)
        ref = results[0][1][0]
        if "logits" in ref:
            for i in range(1, len(runners)):
                pair = (self.names[0], self.names[i])
                r.kl.append((step, graph, pair, topk_kl(ref["logits"], results[i][1][0]["logits"], r.topk)))
        return {k: np.array(v) for k, v in ref.items()}


def _torch_backend(m: Manifest, model_dir=None, drafter_dir=None):
    import torch

    from dflash_trt.export.checkpoint import checkpoint_hash, load_drafter, load_target
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    tdir = model_dir or m.data["target"].get("dir")
    ddir = drafter_dir or (m.data.get("drafter") or {}).get("dir")
    for what, d in (("target", tdir), ("drafter", ddir)):
        if d is not None and not os.path.isdir(d):
            raise ManifestError(f"{what} checkpoint dir {d} (recorded in the manifest) does not exist; "
                                f"pass --{'model' if what == 'target' else 'drafter'} DIR")
    m.check(target_hash=checkpoint_hash(tdir), drafter_hash=checkpoint_hash(ddir) if ddir else None)
    dt = getattr(torch, m.kv_dtype)
    target = load_target(tdir, dt)
    drafter = load_drafter(ddir, target, dt) if ddir else None
    return TorchBackend(target, drafter, want_logits=m.want_logits)


def make_named_backend(name: str, m: Manifest, model_dir=None, drafter_dir=None):
    if name == "torch":
        return _torch_backend(m, model_dir, drafter_dir)
    from dflash_trt.runtime.backends import make_backend

    return make_backend(name, manifest=m)


def compare(manifest, backends=("torch", "ort"), prompts=None, steps: int = 8, *, atol=None, rtol=None,
            kl_tol: float = 1e-6, topk: int = 10, model_dir=None, drafter_dir=None, names=None) -> CompareReport:
    """backends: names ("torch", "ort", "trt") or backend objects (with .run, .kv_dtype); the first is the
    reference. prompts: strings (encoded with the target's tokenizer, else bytes) or lists of token ids."""
    from polygraphy.logger import G_LOGGER

    from dflash_trt.runtime.runtime import Runtime
    from dflash_trt.runtime.load import ByteCodec, TokenizerCodec

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # the report says what failed; keep polygraphy quiet
    # values that would compare nothing are refused before any backend loads
    for what, v in (("steps", steps), ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{what} must be a positive integer, got {v!r}")
    if prompts is not None and not list(prompts):
        raise ValueError("no prompts given (the prompts file is empty)")
    if "trt" in backends:  # one line where engines cannot run here, before any backend loads
        from dflash_trt.engines.load import check_can_execute

        check_can_execute()
    m = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest)
    if len(backends) < 2:
        raise ValueError("compare needs at least two backends")
    objs = [make_named_backend(b, m, model_dir, drafter_dir) if isinstance(b, str) else b for b in backends]
    names = list(names or [b if isinstance(b, str) else getattr(b, "name", f"backend{i}") for i, b in enumerate(backends)])
    names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
    tol = DEFAULT_TOL.get(m.kv_dtype, 1e-4)
    report = CompareReport(names, tol if atol is None else atol, tol if rtol is None else rtol, kl_tol, topk)
    tee = _Tee(objs, names, m, report)
    tcfg, dcfg, sizes = m.target_config, m.drafter_config, m.sizes
    rt = Runtime(tee, tcfg, dcfg, sizes)
    codec = ByteCodec()
    tdir = model_dir or m.data["target"].get("dir")
    if tdir:
        from dflash_trt.export.checkpoint import load_tokenizer

        tok = load_tokenizer(tdir) if os.path.isdir(tdir) else None
        codec = TokenizerCodec(tok) if tok is not None else codec
    ks = [k for k in m.ks if dcfg is not None and 1 < k <= dcfg.block_size] or [1]
    if 1 in m.ks and ks != [1]:
        ks = [1] + ks
    room = sizes.max_seq_len - steps * max(ks) - 1
    if room < 1:
        raise ValueError(f"--steps {steps} with K up to {max(ks)} does not fit max_seq_len {sizes.max_seq_len}")
    for p in DEFAULT_PROMPTS if prompts is None else prompts:
        ids = [int(t) for t in (codec.encode(p) if isinstance(p, str) else p)][-room:]
        seq = rt.add_sequence(ids)
        try:
            rt.prefill(seq)
            for i in range(steps):
                K = ks[i % len(ks)]
                rt.decode_step([seq]) if K == 1 else rt.spec_step([seq], K - 1)
        finally:
            rt.release(seq)
    return report


def main(argv=None) -> int:
    p = ArgumentParser(prog="dflash-trt compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", required=True, help="export directory (manifest.json)")
    p.add_argument("--backends", default="torch,ort", help="comma-separated; the first is the reference")
    p.add_argument("--prompts", help="file with one prompt per line (default: two built-in prompts)")
    p.add_argument("--steps", type=int, default=8, help="target steps per prompt after prefill (cycling the K list)")
    p.add_argument("--atol", type=float, default=None, help="default 1e-4 (fp32 graphs), 2e-2 (fp16/bf16)")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--kl-tol", type=float, default=1e-6)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--model", help="target checkpoint dir for the torch backend (default: the manifest's)")
    p.add_argument("--drafter", help="drafter checkpoint dir for the torch backend (default: the manifest's)")
    a = p.parse_args(argv)
    prompts = None
    try:
        if a.prompts:
            with open(a.prompts) as f:
                prompts = [ln.rstrip("\n").replace("\\n", "\n") for ln in f if ln.strip()]
        rep = compare(a.manifest, [b.strip() for b in a.backends.split(",") if b.strip()], prompts, a.steps,
                      atol=a.atol, rtol=a.rtol, kl_tol=a.kl_tol, topk=a.topk, model_dir=a.model, drafter_dir=a.drafter)
    except (ManifestError, ValueError, OSError) as e:
        print(f"dflash-trt compare: error: {e}", file=sys.stderr)
        return 2
    print(rep.format())
    return 0 if rep.ok else 1
