"""`bench e2e --model random-27b --batch ... --context N` on CPU (its timings need a GPU): the batch rows measured
through decode_run on the tiny pair (a host-clock device), the prefill FLOP count, the pools the preset sizes for
a batch and a context, the serving-scale targets at their thresholds, and the flags' refusals."""
import numpy as np
import pytest
import torch
from bench_helpers import ClockedCpu, tiny_bench_runtime

from dflash_trt.tools import bench_dense as D
from dflash_trt.tools import bench_scale as S

pytestmark = pytest.mark.usefixtures("one_thread")


def test_batch_rows_measure_each_batch_against_batch_one(tmp_path):
    rt = tiny_bench_runtime(tmp_path, ClockedCpu(), max_seqs=4)
    batches = []
    launch = rt.executor.launch
    rt.executor.launch = lambda plan: batches.append((plan.kind, plan.bucket)) or launch(plan)
    out = S.batch_decode(rt, rt.tcfg.vocab_size, np.random.default_rng(0), [1, 3], 6, 3, {"plain_tok_s": 10.0})
    assert list(out) == [3]  # batch 1 is the baseline run beside it, not measured again
    b = out[3]
    assert b["identical"] and not b["failed"]
    assert b["over_batch1"] == b["plain_tok_s"] / 10.0
    assert b["spec_over_plain"] == b["spec_step_ms"] / b["plain_step_ms"]
    assert b["plain_step_ms"] > 0 and 0 <= b["plain_idle_pct"] <= 100
    assert {("decode", 4), ("spec", 4)} <= set(batches)  # three requests in the 4-row bucket, plain and spec


def test_batch_steps_of_every_narrower_bucket_are_built_before_the_timed_runs(tmp_path):
    """The requests join as their prefills land and end in groups, so a batch also runs in narrower buckets; one
    first met inside a timed run would time its compile. Seven requests that join and end together (here) never
    reach them in the warm-up: the bench builds them anyway."""
    rt = tiny_bench_runtime(tmp_path, ClockedCpu(), max_seqs=8)
    built = set()
    entry = rt.executor.entry
    rt.executor.entry = lambda kind, K, B, *a: (rt.executor.trace is None and built.add((kind, K, B))) or entry(
        kind, K, B, *a)
    S.batch_decode(rt, rt.tcfg.vocab_size, np.random.default_rng(0), [1, 7], 6, 3, {"plain_tok_s": 10.0})
    assert {(kind, K, b) for kind, K in (("decode", 1), ("spec", 4)) for b in (1, 2, 4, 8)} <= built


def test_prefill_flops_count_matrices_and_causal_attention():
    target, _ = D.build_random_dense(torch.float32, "cpu", layers=4, dims=dict(
        hidden=256, inter=256, heads=2, kv_heads=1, head_dim=64, gdn_k=2, gdn_v=4, gdn_dim=64, vocab=512, d_heads=2,
        d_kv_heads=1, d_head_dim=64))
    mats = sum(p.numel() for n, p in target.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    T = 10
    assert S.prefill_flops(target, T) == 2 * mats * T + 1 * 4 * 2 * 64 * T * (T + 1) / 2  # one attention layer
    assert S.tensor_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and S.tensor_peak_tflops("NVIDIA H200") == 989.0
    assert S.tensor_peak_tflops("NVIDIA H100 PCIe") == 756.0 and S.tensor_peak_tflops("Tesla T4") is None


def test_pools_hold_the_batch_and_the_long_prompt():
    s = D.bench_sizes(64, 131072, 128, 512)
    assert s.max_seqs == 64 and s.max_seq_len >= 131072 + 128 + 16 and s.ctx_window == s.max_seq_len
    assert s.kv_blocks >= 2 * s.max_blocks + 64 * -(-(S.PROMPT + 128 + 16) // 16)  # the long + the step sweep's
    assert s.dkv_blocks >= s.kv_blocks + 64 * (s.max_ctx_blocks - s.max_blocks)  # each slot's ctx table slack
    small = D.bench_sizes(1, 0, 128, 512)
    assert small.max_seqs == 2 and small.max_seq_len >= D.PREFILL_TOKENS + 128


def test_scale_targets_hit_and_miss_at_their_thresholds():
    res = {"batches": {16: {"over_batch1": 14.0, "spec_over_plain": 1.51}, 64: {"over_batch1": 44.9,
                                                                                   "spec_over_plain": 1.2}},
           "long_context": {"long": {"rows": 131072, "step1_over_floor": 1.15}, "spec_ratio_over_reference": 1.2}}
    got = {k: v[2] for k, v in S.scale_targets(res).items()}
    assert got == {"batch 16 plain tok/s >= 14x batch 1": True, "batch 64 plain tok/s >= 45x batch 1": False,
                   "batch 16 spec step <= 1.5x plain step": False, "131072-row step K=1 <= 1.15x floor": True,
                   "131072-row spec/plain <= 1.15x the 512-row ratio": False}
    assert S.scale_targets({"batches": {}}) == {}


def test_scale_flags_refused_in_one_line():
    from dflash_trt.runtime.load import UsageError
    from dflash_trt.tools.bench_e2e import main

    with pytest.raises(UsageError, match="--context builds the random-27b preset only"):
        main(["--model", "random-0.9b", "--context", "4096"])
    with pytest.raises(UsageError, match="--context must be >= 1"):
        main(["--model", "random-27b", "--context", "0"])
    with pytest.raises(UsageError, match="measures batch 1 only"):
        main(["--model", "random-moe-35b-a3b", "--batch", "1,16"])
    with pytest.raises(UsageError, match=r"batch sizes in 1\.\.64"):
        main(["--model", "random-27b", "--batch", "1,65"])


def test_scale_report_prints_every_row(capsys):
    """The batch and long-context tables from hand-written figures (a long GPU run cannot die in its last lines)."""
    b = {"plain_tok_s": 1500.0, "over_batch1": 14.2, "plain_step_ms": 10.7, "plain_idle_pct": 0.4, "spec_step_ms": 15.1,
         "spec_over_plain": 1.41, "identical": True}
    c = {"rows": 512, "prefill_tok_s": 20000.0, "ttft_s": 0.03, "prefill_tflops": 250.0, "prefill_peak_pct": 25.3,
         "step1_ms": 4.1, "step1_floor_ms": 3.9, "step1_over_floor": 1.05, "plain_step_ms": 4.3, "spec_step_ms": 6.9,
         "spec_over_plain": 1.6}
    res = {"batches": {16: b, 64: {**b, "floor_ms": 8.0, "step_over_floor": 1.34}},
           "long_context": {"reference": c, "long": {**c, "rows": 32768, "prefill_peak_pct": None}}}
    S.print_batches(res)
    S.print_long_context(res)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["16", "1500.0", "14.20", "10.700", "-", "-", "0.4", "15.100", "1.41", "True"]
    assert out[2].split()[4:6] == ["8.000", "1.34"]
    assert out[4].split()[:5] == ["512", "20000", "0.03", "250", "25"] and out[5].split()[4] == "-"


def test_batch_scripted_lines_from_the_batch_steps(capsys):
    """At batch 16 the auto-K checks run on that batch's own plain and spec steps: a 1.5x spec step leaves the
    never-right drafter at plain speed and beats K=16 by more than 10% on the phased script."""
    res = {"batches": {16: {"plain_tok_s": 2000.0, "over_batch1": 12.0, "plain_step_ms": 8.0, "plain_idle_pct": 0.5,
                            "spec_step_ms": 12.0, "spec_over_plain": 1.5, "identical": True}}}
    S.batch_scripted(res, 15)
    rows = res["batches"][16]["scripted"]["rows"]
    assert rows["random"]["K=1"] == pytest.approx(16 / 8e-3)  # 16 rows, one token each per 8 ms step
    assert set(res["targets"]) == {"batch 16 auto K, never-right drafter >= 0.97x plain",
                                   "batch 16 auto K, stationary script >= 0.97x best fixed K",
                                   "batch 16 auto K, phased script >= 1.10x best fixed K"}
    assert all(hit for _, _, hit in res["targets"].values())
    S.print_batches(res)
    assert "scripted phased (batch 16)" in capsys.readouterr().out


def test_batch_rows_print_as_each_batch_is_measured(capsys):
    """A run prints each batch's row when it is measured: the header with the first batch only, then one row each."""
    b = {"plain_tok_s": 1500.0, "over_batch1": 14.2, "plain_step_ms": 10.7, "plain_idle_pct": 0.4, "spec_step_ms": 15.1,
         "spec_over_plain": 1.41, "identical": True}
    res = {"batches": {16: b}}
    S.print_batches(res, only=16)
    res["batches"][64] = {**b, "plain_tok_s": 4000.0}
    S.print_batches(res, only=64)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].split()[0] == "batch"
    assert [x.split()[:2] for x in out[1:]] == [["16", "1500.0"], ["64", "4000.0"]]
