"""`bench e2e --model random-27b` at serving scale: batches of up to 64 sequences (--batch) and long contexts
(--context), each against a baseline measured in the same run.

  batch B        B requests of PROMPT random tokens start together, --max-new-tokens each through EOS (so the
                 batch stays full): aggregate plain tok/s (new tokens / decode wall time) over batch 1's on the same
                 prompt length, the wall time per step against its floor (weights + every sequence's state and KV
                 rows) and the GPU idle share; the spec step at B (K = gamma + 1; the random drafter accepts next to
                 nothing, so every step verifies K rows of every sequence) over the plain step at B; the scripted
                 fixed / auto K lines (tools/scripted.py) from those two steps
  context N      one N-token prompt: prefill tok/s, its time to first token and the projection + attention TFLOP/s
                 against the GPU's dense 16-bit tensor-core peak; the target step K=1 (graph replay) against its floor
                 (weights + the N rows of KV + state); the spec step over the plain step of a decode on that prompt,
                 beside the same ratio on a REFERENCE_CONTEXT-row prompt (the drafter attends its whole context)
"""
from __future__ import annotations

import functools

import numpy as np

from dflash_trt.runtime.prebuild import prebuild
from dflash_trt.tools.bench_e2e import decode_run
from dflash_trt.tools.scripted import print_scripted

PROMPT = 48  # tokens of each batch request's prompt (batch 1's prompt in bench_dense has the same length)
REFERENCE_CONTEXT = 512
# dense 16-bit tensor-core peak (TFLOP/s, no sparsity) by device name; a GPU not named here gets no percentage
TENSOR_TFLOPS = (("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("B200", 2250.0),
                 ("A100", 312.0))
TARGETS = {"batch16_over_batch1": 14.0, "batch64_over_batch1": 45.0, "spec_over_plain_batch16": 1.5,
           "long_step1_over_floor": 1.15, "long_spec_ratio_over_reference": 1.15}


def tensor_peak_tflops(name: str) -> float | None:
    return next((v for key, v in TENSOR_TFLOPS if key in name), None)


def prefill_flops(target, tokens: int) -> float:
    """Projection + attention FLOPs of one prompt: 2 per weight of every matrix in the layers per token, and the
    causal QK^T and PV products of every attention layer (the GDN recurrence and the last row's lm_head left out)."""
    proj = sum(p.numel() for layer in target.layers for p in layer.parameters() if p.dim() == 2)
    cfg = target.cfg
    attn = len(cfg.attn_layers) * 2 * 2 * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2.0 * proj * tokens + attn


def _step_ms(run: dict) -> float:
    """Decode wall time per scheduler step."""
    return run["new_tokens"] / run["tok_s"] / run["steps"] * 1e3


def batch_decode(rt, vocab: int, rng, batches, max_new: int, gamma: int, batch1: dict) -> dict:
    """{B: plain / spec figures} for every B > 1 of `batches`; batch1: bench_moe.spec_vs_plain's batch-1 result."""
    out = {}
    for B in (b for b in batches if b > 1):
        prompts = [[int(t) for t in rng.integers(0, vocab - 1, PROMPT)] for _ in range(B)]
        # every request runs max_new tokens (an early EOS would shrink the batch); the requests still join in
        # prefill groups as their prefills land and end in groups, so the batch also runs in the narrower buckets:
        # every step the run may launch is built first (a compile inside the timed run would be timed)
        prebuild(rt, gamma, max_batch=B)
        run = functools.partial(decode_run, rt, prompts, concurrency=B, ignore_eos=True)
        run(4, None, spec=False)  # warm-up
        plain = run(max_new, None, spec=False, trace=True)
        run(4, gamma, spec=True)
        spec = run(max_new, gamma, spec=True, trace=True)
        out[B] = {"plain_tok_s": plain["tok_s"], "plain_step_ms": _step_ms(plain), "plain_idle_pct": plain["idle_pct"],
                  "over_batch1": plain["tok_s"] / batch1["plain_tok_s"], "spec_step_ms": _step_ms(spec),
                  "spec_idle_pct": spec["idle_pct"], "spec_over_plain": _step_ms(spec) / _step_ms(plain),
                  "identical": spec["tokens"] == plain["tokens"], "failed": plain["failed"] + spec["failed"]}
    return out


def context_decode(rt, dev, target, prompt, bw: float, compiled: bool, rng, max_new: int, gamma: int) -> dict:
    """Prefill, step K=1 against its floor and the spec / plain step ratio on one prompt (module doc)."""
    from dflash_trt.tools.bench import hardware
    from dflash_trt.tools.bench_e2e_run import prefill_tok_s
    from dflash_trt.tools.bench_moe import context_sweep

    n = len(prompt)
    tok_s = prefill_tok_s(rt, dev, prompt)
    tflops = prefill_flops(target, n) * tok_s / n / 1e12
    peak = tensor_peak_tflops(hardware("cuda"))
    step = context_sweep(rt, dev, n, bw, [1], compiled, rng)[1]
    plain = decode_run(rt, [prompt], max_new, None, spec=False)
    spec = decode_run(rt, [prompt], max_new, gamma, spec=True)
    return {"rows": n, "prefill_tok_s": tok_s, "ttft_s": n / tok_s, "prefill_tflops": tflops,
            "prefill_peak_pct": 100.0 * tflops / peak if peak else None, "step1_ms": step["ms"],
            "step1_floor_ms": step["floor_ms"], "step1_over_floor": step["ratio"], "plain_step_ms": _step_ms(plain),
            "spec_step_ms": _step_ms(spec), "spec_over_plain": _step_ms(spec) / _step_ms(plain),
            "identical": spec["tokens"] == plain["tokens"]}


def long_context(rt, dev, target, rows: int, bw: float, compiled: bool, rng, max_new: int, gamma: int) -> dict:
    """context_decode at REFERENCE_CONTEXT rows and at `rows`, and the ratio of their spec / plain ratios."""
    vocab = target.cfg.vocab_size
    ref, long = ([int(t) for t in rng.integers(0, vocab - 1, n)] for n in (REFERENCE_CONTEXT, rows))
    res = {"reference": context_decode(rt, dev, target, ref, bw, compiled, rng, max_new, gamma),
           "long": context_decode(rt, dev, target, long, bw, compiled, rng, max_new, gamma)}
    res["spec_ratio_over_reference"] = res["long"]["spec_over_plain"] / res["reference"]["spec_over_plain"]
    return res


def batch_scripted(res: dict, gamma: int, only=None) -> None:
    """The scripted fixed / auto K lines (tools/scripted.py) at each measured batch B > 1 (only = B: at B alone), from
    that batch's plain and spec steps (widths 1 and gamma + 1), into res["batches"][B]["scripted"] and their checks
    into res["targets"]."""
    from dflash_trt.runtime.draft_length import CostTable
    from dflash_trt.tools.scripted import scripted_lines

    for B, b in res.get("batches", {}).items():
        if only is not None and B != only:
            continue
        costs = CostTable({(1, B): b["plain_step_ms"] / 1e3, (gamma + 1, B): b["spec_step_ms"] / 1e3})
        b["scripted"] = scripted_lines(costs, bucket=B)
        res.setdefault("targets", {}).update(b["scripted"]["targets"])


def scale_targets(res: dict) -> dict:
    """name -> (value, threshold, hit) of the serving-scale targets the run measured."""
    t, out = TARGETS, {}
    for B, key in ((16, "batch16_over_batch1"), (64, "batch64_over_batch1")):
        if B in res.get("batches", {}):
            v = res["batches"][B]["over_batch1"]
            out[f"batch {B} plain tok/s >= {t[key]:g}x batch 1"] = (v, t[key], v >= t[key])
    if 16 in res.get("batches", {}):
        v = res["batches"][16]["spec_over_plain"]
        out[f"batch 16 spec step <= {t['spec_over_plain_batch16']:g}x plain step"] = (v, t["spec_over_plain_batch16"],
                                                                                   v <= t["spec_over_plain_batch16"])
    lc = res.get("long_context")
    if lc:
        n, v, r = lc["long"]["rows"], lc["long"]["step1_over_floor"], lc["spec_ratio_over_reference"]
        out[f"{n}-row step K=1 <= {t['long_step1_over_floor']:g}x floor"] = (v, t["long_step1_over_floor"],
                                                                              v <= t["long_step1_over_floor"])
        out[f"{n}-row spec/plain <= {t['long_spec_ratio_over_reference']:g}x the {REFERENCE_CONTEXT}-row ratio"] = (
            r, t["long_spec_ratio_over_reference"], r <= t["long_spec_ratio_over_reference"])
    return out


def print_batches(res: dict, only=None) -> None:
    """The batch table, or (only = B) its header when B is the first batch, B's row and B's scripted lines: a run
    prints each batch as it is measured (a killed one keeps the batches it finished)."""
    rows = {B: b for B, b in res.get("batches", {}).items() if only is None or B == only}
    if rows and (only is None or only == next(iter(res["batches"]))):
        print(f"{'batch':>5} {'plain tok/s':>11} {'x batch 1':>9} {'step ms':>8} {'floor ms':>8} {'ratio':>5} "
              f"{'idle %':>6} {'spec step ms':>12} {'spec/plain':>10} {'identical':>9}")
    for B, b in rows.items():
        floor = (f"{b['floor_ms']:>8.3f} {b['step_over_floor']:>5.2f}" if "floor_ms" in b else f"{'-':>8} {'-':>5}")
        print(f"{B:>5} {b['plain_tok_s']:>11.1f} {b['over_batch1']:>9.2f} {b['plain_step_ms']:>8.3f} {floor} "
              f"{b['plain_idle_pct']:>6.1f} {b['spec_step_ms']:>12.3f} {b['spec_over_plain']:>10.2f} "
              f"{str(b['identical']):>9}")
    for b in rows.values():
        if "scripted" in b:
            print_scripted(b["scripted"])


def print_long_context(res: dict) -> None:
    lc = res.get("long_context")
    if lc:
        print(f"{'context':>7} {'prefill tok/s':>13} {'TTFT s':>7} {'TFLOP/s':>7} {'% peak':>6} {'step1 ms':>8} "
              f"{'floor ms':>8} {'ratio':>5} {'plain ms':>8} {'spec ms':>8} {'spec/plain':>10}")
        for c in (lc["reference"], lc["long"]):
            pct = f"{c['prefill_peak_pct']:.0f}" if c["prefill_peak_pct"] is not None else "-"
            print(f"{c['rows']:>7} {c['prefill_tok_s']:>13.0f} {c['ttft_s']:>7.2f} {c['prefill_tflops']:>7.0f} {pct:>6} "
                  f"{c['step1_ms']:>8.3f} {c['step1_floor_ms']:>8.3f} {c['step1_over_floor']:>5.2f} "
                  f"{c['plain_step_ms']:>8.3f} {c['spec_step_ms']:>8.3f} {c['spec_over_plain']:>10.2f}")
