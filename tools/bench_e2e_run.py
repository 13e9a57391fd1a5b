"""The orchestration of `dflash-trt bench e2e` (the measurements live in tools/bench_e2e.py): load or build the
pair, measure, print one table and the targets as hit / miss, write JSON."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import numpy as np

from dflash_trt.files import write_json
from dflash_trt.tools.bench_e2e import (RANDOM_0P9B, TARGETS, build_random_pair, copy_bandwidth_gbs, decode_run,
                                        floor_tok_s, hf_tok_s, load_pair, parse_step_ks, print_profile, profile_batches,
                                        step_latency_ms)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prompts(a, vocab: int) -> list[list[int]]:
    if a.model == RANDOM_0P9B:
        rng = np.random.default_rng(0)
        return [[int(t) for t in rng.integers(0, vocab - 1, int(n))] for n in rng.integers(32, 65, 24)]
    from dflash_trt.runtime.load import load_codec

    codec = load_codec(a.model)
    path = os.path.join(REPO, "tests", "prompts_heldout.txt")
    with open(path) as f:
        texts = [json.loads(x) for x in f if x.strip() and not x.startswith("#")]
    return [codec.encode(t) for t in texts]


def _progress(key, count=[0]) -> None:  # noqa: B006  (a counter across calls)
    count[0] += 1
    print(f"\r  capturing CUDA graphs: {count[0]:3d}  {key[0]:<7} K={key[1]:<3} batch={key[2]:<3}",
          end="", file=sys.stderr, flush=True)


def _decode(rt, prompts, batch, a, spec, temperature: float = 0.0):
    """(warm-up run that captures every bucket it will meet, then a.repeats measured runs; the median by tok/s is
    the row, every run's tok/s kept in "tok_s_runs"). Batch 1: batch1_prompts prompts one after another, each
    prefill untimed. Batch B > 1: B x requests_per_slot requests (the prompts cycled), B at a time: at 1 they start
    together (prefills untimed) and the batch drains as they finish; above, the batch stays full until the queue
    runs dry, and the prefills of the requests that join mid-run are inside the timed decode (batch 1 does not pay
    them)."""
    gamma = a.gamma if spec else None
    if batch == 1:
        work, conc = [[p] for p in prompts[:a.batch1_prompts]], None  # one after another
    else:
        work, conc = [[prompts[i % len(prompts)] for i in range(batch * a.requests_per_slot)]], batch
    decode_run(rt, work[0], a.max_new_tokens, gamma, spec, temperature=temperature, concurrency=conc)  # warm-up
    reps = [_pooled([decode_run(rt, w, a.max_new_tokens, gamma, spec, trace=True, temperature=temperature,
                                concurrency=conc) for w in work]) for _ in range(a.repeats)]
    row = sorted(reps, key=lambda r: r["tok_s"])[len(reps) // 2]
    row["tok_s_runs"] = [r["tok_s"] for r in reps]
    row["gc_runs"] = [(r["gc_ms"], r["gc_full"]) for r in reps]  # in run order, beside tok_s_runs
    return row


def _pooled(runs) -> dict:
    """One measured run of a row: its decode_run results pooled."""
    secs = sum(r["new_tokens"] / r["tok_s"] for r in runs)
    new, launches = sum(r["new_tokens"] for r in runs), sum(r["launches"] for r in runs)
    acc = [a for r in runs for a in r["accepted"]]
    # pooled over every prompt's steps: tau = mean tokens a spec step commits; tokens per launch also counts
    # the launches whose tokens were cut (max tokens) or dropped (a step in flight when its request ended)
    return {"tok_s": new / secs, "tau": 1 + float(np.mean(acc)) if acc else 1.0,
            "tokens_per_launch": new / launches if launches else 0.0, "requests": sum(len(r["tokens"]) for r in runs),
            "step_ms": sum(r["step_ms"] * r["launches"] for r in runs if r["launches"]) / launches if launches else 0.0,
            "idle_pct": float(np.mean([r["idle_pct"] for r in runs if r["idle_pct"] is not None] or [0.0])),
            "join_prefill_ms": sum(r.get("join_prefill_ms", 0.0) for r in runs),
            "join_prefill_beside_ms": sum(r.get("join_prefill_beside_ms", 0.0) for r in runs), "decode_s": secs,
            "full_batch_tok_s": _full_batch_tok_s(runs),
            "gc_ms": sum(r["gc_ms"] for r in runs), "gc_full": sum(r["gc_full"] for r in runs),
            "tokens": [t for r in runs for t in r["tokens"]], "failed": [f for r in runs for f in r["failed"]]}


def _full_batch_tok_s(runs) -> float | None:
    """New tokens per second of the full-batch windows (decode_run), None where a run has none (batch 1)."""
    if any(r.get("full_batch_s") is None for r in runs):
        return None
    secs = sum(r["full_batch_s"] for r in runs)
    return sum(r["full_batch_tokens"] for r in runs) / secs if secs > 0 else None


def _backend(a, target, drafter, sizes, dev, dtype: str):
    """torch: the modules; trt (--backend trt): the export of the same checkpoints and its engines, built once."""
    if getattr(a, "backend", "torch") != "trt":
        from dflash_trt.runtime.backends.torch_backend import TorchBackend

        return TorchBackend(target, drafter, compile_steps=not getattr(a, "no_compile", False))
    from dflash_trt.engines.build import ensure_engines
    from dflash_trt.export.onnx_export import ensure_export
    from dflash_trt.runtime.backends import make_backend
    from dflash_trt.abi import verify_widths

    ks = verify_widths(a.gamma, drafter.cfg.block_size if drafter else None, True)
    man = ensure_engines(ensure_export(a.model, a.drafter, ks=ks, sizes=sizes, dtype=dtype))
    return make_backend("trt", manifest=man, device=dev)


def run(a) -> int:
    if not _can_run(a):
        return 2
    import torch

    from dflash_trt.tools.bench import hardware

    random = a.model == RANDOM_0P9B
    dname = a.dtype or ("bfloat16" if random else "float32")
    batches = [int(b) for b in a.batch.split(",")]
    temps = [float(t) for t in getattr(a, "temperatures", "").split(",") if t.strip()]
    rt, dev, target, drafter, hf, sizes = _runtime(a, random, dname, getattr(torch, dname))
    prompts = _prompts(a, target.cfg.vocab_size)
    res = {"hardware": hardware("cuda"), "model": a.model, "drafter": a.drafter or (RANDOM_0P9B if random else None),
           "dtype": dname, "max_new_tokens": a.max_new_tokens, "batches": batches}
    res["copy_bandwidth_GBps"] = bw = copy_bandwidth_gbs(dev)
    _prefill_and_step_latency(rt, dev, a, sizes, target.cfg.vocab_size, res)
    res["floor_ms"], res["floor_tok_s"] = floor_tok_s(SimpleNamespace(backend=SimpleNamespace(target=target),
                                                                      pools=rt.pools), 128, bw)
    rows = _decode_rows(rt, prompts, batches, temps, a, drafter is not None)
    print(file=sys.stderr)
    _finish(a, res, rt, prompts, rows, hf, len(target.layers), random)
    return 0


def _can_run(a) -> bool:
    """Refusals before any GPU work: one line (exit 2) where engines or CUDA cannot run."""
    from dflash_trt.runtime.devices.cuda import CudaUnavailable, require_cuda

    if getattr(a, "backend", "torch") == "trt":
        from dflash_trt.engines.load import check_can_execute
        from dflash_trt.runtime.load import UsageError

        check_can_execute()
        if a.model == RANDOM_0P9B:
            raise UsageError(f"--backend trt builds engines from checkpoint dirs; '{RANDOM_0P9B}' has none on disk")
    try:
        require_cuda()
    except CudaUnavailable as e:
        print(f"dflash-trt bench e2e: error: {e}", file=sys.stderr)
        return False
    return True


def _runtime(a, random: bool, dname: str, dtype):
    """(rt, dev, target, drafter, hf, sizes): the pair loaded or built on the GPU, a Runtime over its backend."""
    from dflash_trt.abi import PoolSizes
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.devices.cuda import CudaDevice
    from dflash_trt.runtime.runtime import Runtime

    dev = CudaDevice()
    target, drafter, hf = (build_random_pair(dtype, dev.device) if random
                           else load_pair(a.model, a.drafter, dtype, dev.device))
    sizes = PoolSizes(max_seq_len=1024, kv_blocks=16 * 64 + 64, page_size=16, max_seqs=32, dkv_blocks=16 * 64 + 64,
                      ctx_window=1024, prefill_chunk=64)
    be = _backend(a, target, drafter, sizes, dev, dname)
    rt = Runtime(be, target.cfg, drafter.cfg if drafter else None, sizes, device=dev)
    rt.executor.on_capture = _progress
    return rt, dev, target, drafter, hf, sizes


def prefill_tok_s(rt, dev, prompt: list[int]) -> float:
    """Tokens/s of one prompt through the prefill graph: the second of two runs (the first captures)."""
    for _ in range(2):
        seq = rt.add_sequence(prompt)
        dev.synchronize()
        e0, e1 = dev.new_event(timing=True), dev.new_event(timing=True)
        dev.record(e0)
        rt.prefill(seq)
        dev.record(e1)
        dev.synchronize()
        rt.release(seq)
    return len(prompt) / (dev.elapsed_ms(e0, e1) * 1e-3)


def _prefill_and_step_latency(rt, dev, a, sizes, vocab: int, res: dict) -> None:
    """Prefill tok/s of one 512-token prompt, chunked through the prefill graph; torch backend: the per-K target
    step latency on its 512-row context. Into res."""
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    long = [int(t) for t in np.random.default_rng(1).integers(0, vocab - 1, 512)]
    res["prefill_tok_s"] = prefill_tok_s(rt, dev, long)
    if isinstance(rt.backend, TorchBackend):  # per-K target step latency, 512-row context
        seq = rt.add_sequence(long)
        rt.prefill(seq)
        _step_latency(rt, seq, a, sizes, res)
        rt.release(seq)


def _step_latency(rt, seq, a, sizes, res: dict) -> None:
    from dflash_trt.runtime import commit

    lat = {}
    commit.reserve(seq, 16, rt.kv_alloc, sizes.page_size)
    for K in parse_step_ks(a.step_ks):
        lat[K] = step_latency_ms(rt, seq, K)
    res["step_latency_ms"], res["step16_over_step1"] = lat, lat[16] / lat[1]
    if rt.backend.compile_steps:  # the compiled step at the two widths the targets name
        res["step_latency_compiled_ms"] = {K: step_latency_ms(rt, seq, K, compiled=True) for K in (1, 16)}
        c = res["step_latency_compiled_ms"]
        res["step16_over_step1"] = c[16] / c[1]


def _decode_rows(rt, prompts, batches, temps, a, spec: bool) -> list:
    """One row per batch: plain and (with a drafter) DFlash, greedy and at each sampling temperature."""
    rows = []
    for b in batches:
        row = {"batch": b, "plain": _decode(rt, prompts, b, a, spec=False)}
        if spec:
            row["dflash"] = _decode(rt, prompts, b, a, spec=True)
            row["identical"] = sum(x == y for x, y in zip(row["plain"]["tokens"], row["dflash"]["tokens"]))
            row["n_seqs"] = len(row["plain"]["tokens"])
        for T in temps:  # sampling: plain vs DFlash (rejection sampling keeps the target's distribution)
            row[f"plain_T{T:g}"] = _decode(rt, prompts, b, a, spec=False, temperature=T)
            if spec:
                row[f"dflash_T{T:g}"] = _decode(rt, prompts, b, a, spec=True, temperature=T)
        rows.append(row)
    return rows


def _finish(a, res: dict, rt, prompts, rows, hf, layers: int, random: bool) -> None:
    """The optional kernel profile and HF baseline, the rows without their tokens, the targets; print, write."""
    batches = res["batches"]
    if a.profile:
        res["profile"] = profile_batches(rt, prompts, batches)
    res["hf_tok_s"] = hf_tok_s(hf, prompts[0], a.hf_tokens) if a.hf_tokens else None
    res["rows"] = [{k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
                    for k, v in r.items()} for r in rows]
    res["eager_keys"] = sorted(map(str, rt.executor.eager_keys))
    res["layers"], res["compiled"] = layers, bool(getattr(rt.backend, "compile_steps", False))
    res["targets"] = targets(res, random)
    print_table(res)
    if a.json:
        write_json(a.json, res)


def targets(res, random: bool) -> dict:
    """The bench e2e targets as {name: (value, threshold, hit)} where they apply to this model."""
    rows = {r["batch"]: r for r in res["rows"]}
    out = {}
    idle = [r[k]["idle_pct"] for r in res["rows"] for k in ("plain", "dflash") if k in r]
    out["GPU idle between steps <= 5% (worst row)"] = (max(idle), TARGETS["idle_pct_max"], max(idle) <= 5.0)
    if 1 in rows and random:
        v = rows[1]["plain"]["tok_s"]
        out["0.9B plain decode batch 1 >= 400 tok/s"] = (v, 400.0, v >= 400.0)
        if res["hf_tok_s"]:
            r = v / res["hf_tok_s"]
            out["0.9B plain >= 30x HF generate()"] = (r, 30.0, r >= 30.0)
    if 1 in rows and "dflash" in rows[1] and not random:
        r = rows[1]["dflash"]["tok_s"] / rows[1]["plain"]["tok_s"]
        out["trained pair DFlash >= 2.5x plain, batch 1"] = (r, 2.5, r >= 2.5)
    if 1 in rows and 16 in rows and "dflash" in rows[16] and not random:  # a random drafter accepts nothing
        r = rows[16]["dflash"]["tok_s"] / rows[1]["dflash"]["tok_s"]
        out["batch 16 aggregate DFlash >= 8x batch 1"] = (r, 8.0, r >= 8.0)
        if rows[16]["dflash"].get("full_batch_tok_s"):  # the same, over the window before the drain
            r = rows[16]["dflash"]["full_batch_tok_s"] / rows[1]["dflash"]["tok_s"]
            out["batch 16 aggregate DFlash >= 8x batch 1, full batch"] = (r, 8.0, r >= 8.0)
    out.update(fused_targets(res, rows, random))
    return out


def fused_targets(res, rows, random: bool) -> dict:
    """The fused step's targets (at the floor) on the same run's figures."""
    out, c = {}, res.get("step_latency_compiled_ms") or res["step_latency_ms"]
    if random and c:
        r = c[1] / res["floor_ms"]
        out["0.9B step(K=1) <= 1.5x floor"] = (r, 1.5, r <= 1.5)
        r = c[16] / c[1]
        out["0.9B step(16)/step(1) <= 1.25"] = (r, 1.25, r <= 1.25)
        if 1 in rows and res["hf_tok_s"]:
            r = rows[1]["plain"]["tok_s"] / res["hf_tok_s"]
            out["0.9B plain >= 50x HF generate()"] = (r, 50.0, r >= 50.0)
    for key, pr in res.get("profile", {}).items():
        if not key.startswith("decode") or "_b" in key:  # a spec step also runs the drafter's layers
            continue
        r = pr["kernels"] / res["layers"]
        out[f"kernels per layer <= 15 ({key})"] = (r, 15.0, r <= 15.0)
    if 1 in rows and "dflash" in rows[1] and not random:
        r = rows[1]["dflash"]["tok_s"] / rows[1]["plain"]["tok_s"]
        out["trained pair DFlash >= 3x plain, batch 1"] = (r, 3.0, r >= 3.0)
    return out


def speedup_terms(r) -> str:
    """Why DFlash is as fast as it is at one batch: DFlash/plain = tokens per launch x (plain step / spec step),
    each step the GPU time of a launch in this run (input copy, graph, read-back)."""
    p, d = r["plain"], r["dflash"]
    terms = d["tokens_per_launch"] / p["tokens_per_launch"] * p["step_ms"] / d["step_ms"]
    return (f"batch {r['batch']}: DFlash/plain {d['tok_s'] / p['tok_s']:.2f}x = {d['tokens_per_launch']:.2f} tokens per "
            f"spec launch (plain {p['tokens_per_launch']:.2f}) x plain step {p['step_ms']:.3f} ms / spec step "
            f"{d['step_ms']:.3f} ms = {terms:.2f}x in GPU time (the two agree when the GPU sets the pace)")


def print_table(res) -> None:
    print(f"bench e2e: {res['model']} ({res['dtype']}{', compiled steps' if res.get('compiled') else ''}) on {res['hardware']}; device copy {res['copy_bandwidth_GBps']:.0f} GB/s;"
          f" floor {res['floor_ms']:.3f} ms/step = {res['floor_tok_s']:.0f} tok/s (batch 1, weights + state)")
    print(f"prefill: {res['prefill_tok_s']:.0f} tok/s (512-token prompt, chunks of 64)")
    print(f"{'batch':>5} {'plain tok/s':>12} {'dflash tok/s':>13} {'speedup':>8} {'tau':>6} {'identical':>10} "
          f"{'idle% plain/dflash':>19}")
    for r in res["rows"]:
        p, d = r["plain"], r.get("dflash")
        dtxt = f"{d['tok_s']:>13.1f} {d['tok_s'] / p['tok_s']:>7.2f}x {d['tau']:>6.2f} " \
               f"{r['identical']:>4}/{r['n_seqs']:<5}" if d else f"{'-':>13} {'-':>8} {'-':>6} {'-':>10}"
        idle = f"{p['idle_pct']:.1f}/{d['idle_pct']:.1f}" if d else f"{p['idle_pct']:.1f}/-"
        print(f"{r['batch']:>5} {p['tok_s']:>12.1f} {dtxt} {idle:>19}")
    spread = [f"batch {r['batch']} {k} " + "/".join(f"{t:.0f}" for t in sorted(r[k]["tok_s_runs"]))
              for r in res["rows"] for k in ("plain", "dflash") if len(r.get(k, {}).get("tok_s_runs", ())) > 1]
    if spread:
        print("tok/s of each measured run (the row is the median): " + "; ".join(spread))
    gcs = [f"batch {r['batch']} {k} " + " / ".join(f"{t:.0f} tok/s {ms:.1f} ms ({full} full)" for t, (ms, full) in
                                                   zip(r[k]["tok_s_runs"], r[k]["gc_runs"]))
           for r in res["rows"] for k in ("plain", "dflash") if r.get(k, {}).get("gc_runs")]
    if gcs:
        print("host garbage-collector pauses in each measured run (run order): " + "; ".join(gcs))
    for r in res["rows"]:
        if r.get("dflash") and r["dflash"].get("step_ms") and r["plain"].get("step_ms"):
            print(speedup_terms(r))
    for r in res["rows"]:  # serving runs: the joiners' prefills' share of the time
        for k in [k for k in ("plain", "dflash") if r.get(k, {}).get("join_prefill_ms")]:
            v = r[k]
            print(f"batch {r['batch']} {k}: {v['requests']} requests; prefills of requests joining mid-run "
                  f"{v['join_prefill_ms']:.1f} ms GPU ({v.get('join_prefill_beside_ms', 0.0):.1f} ms of it beside a step) "
                  f"of {v['decode_s'] * 1e3:.1f} ms decode wall time")
            if v.get("full_batch_tok_s"):
                print(f"batch {r['batch']} {k}: {v['full_batch_tok_s']:.1f} tok/s while the batch was full (until it "
                      f"first ran short with none waiting; the drain after that is as long as the longest request left)")
    for r in res["rows"]:
        for k in [k for k in r if k.startswith("plain_T")]:
            p, d, T = r[k], r.get("dflash_T" + k[len("plain_T"):]), k[len("plain_T"):]
            dtxt = f"dflash {d['tok_s']:.1f} tok/s ({d['tok_s'] / p['tok_s']:.2f}x) tau {d['tau']:.2f}" if d else ""
            print(f"sampled T={T} batch {r['batch']}: plain {p['tok_s']:.1f} tok/s; {dtxt}")
    lat = res["step_latency_ms"]
    print("target step latency (batch 1, 512-row context, CUDA graph): " +
          " ".join(f"K={k}:{v:.3f}" for k, v in lat.items()) + f" ms; step(16)/step(1) = {res['step16_over_step1']:.2f}")
    if res.get("step_latency_compiled_ms"):
        print("compiled target step (Inductor, CUDA graph): " +
              " ".join(f"K={k}:{v:.3f}" for k, v in res["step_latency_compiled_ms"].items()) + " ms")
    if res["hf_tok_s"]:
        p1 = next((r["plain"]["tok_s"] for r in res["rows"] if r["batch"] == 1), None)
        ratio = f"; plain batch 1 / HF = {p1 / res['hf_tok_s']:.1f}x" if p1 else ""
        print(f"HF transformers generate() (same weights, batch 1): {res['hf_tok_s']:.1f} tok/s{ratio}")
    if res["eager_keys"]:
        print(f"eager (capture failed): {res['eager_keys']}")
    print_profile(res)
    for name, (v, thr, hit) in res["targets"].items():
        print(f"target {name}: {v:.2f} vs {thr:g} -> {'HIT' if hit else 'MISS'}")
