"""`bench e2e`'s report half on CPU (its measurements need a GPU): the targets computed from a run's
figures — hit / miss at their thresholds — and the table printing every row kind, so a long GPU
run cannot die in its last line. Figures here are hand-written run results, not outputs of the code."""
from bench_helpers import ClockedCpu, tiny_bench_runtime

from dflash_trt.tools.bench_e2e_run import print_table, targets


def _row(batch, plain, dflash=None, tau=1.0, idle=(1.0, 2.0), temps=()):
    r = {"batch": batch, "plain": {"tok_s": plain, "tau": 1.0, "idle_pct": idle[0], "failed": []}}
    if dflash is not None:
        r["dflash"] = {"tok_s": dflash, "tau": tau, "idle_pct": idle[1], "failed": []}
        r["identical"], r["n_seqs"] = 8, 8
    for T in temps:
        r[f"plain_T{T:g}"] = {"tok_s": plain / 2, "tau": 1.0, "idle_pct": 0.0, "failed": []}
        r[f"dflash_T{T:g}"] = {"tok_s": dflash / 2, "tau": tau - 0.5, "idle_pct": 0.0, "failed": []}
    return r


def _res(model, rows, compiled=None, profile=None, hf=10.0):
    res = {"model": model, "dtype": "bfloat16", "hardware": "NVIDIA H200", "copy_bandwidth_GBps": 4268.0,
           "floor_ms": 0.44, "floor_tok_s": 2272.0, "prefill_tok_s": 9000.0, "hf_tok_s": hf,
           "step_latency_ms": {1: 2.368, 16: 2.755}, "step16_over_step1": 2.755 / 2.368, "rows": rows,
           "eager_keys": [], "layers": 12, "compiled": compiled is not None}
    if compiled:
        res["step_latency_compiled_ms"], res["step16_over_step1"] = compiled, compiled[16] / compiled[1]
    if profile:
        res["profile"] = profile
    return res


def test_random_model_targets_and_table(capsys):
    prof = {"decode_k1": {"kernels": 168, "busy_ms": 0.9, "top": [("gemv", 0.5, 40)]},
            "spec_k16": {"kernels": 400, "busy_ms": 1.2, "top": [("gemm", 0.6, 40)]}}
    res = _res("random-0.9b", [_row(1, 700.0, 1400.0, 3.0, temps=(0.6, 1.0)), _row(16, 6000.0, 9800.0, 3.0)],
               compiled={1: 0.6, 16: 0.8}, profile=prof)
    t = targets(res, random=True)
    assert t["0.9B plain decode batch 1 >= 400 tok/s"] == (700.0, 400.0, True)
    assert t["0.9B plain >= 30x HF generate()"][2] and t["0.9B plain >= 50x HF generate()"][2]  # 70x
    assert t["0.9B step(K=1) <= 1.5x floor"][2] is True  # 0.6 / 0.44 = 1.36
    assert t["0.9B step(16)/step(1) <= 1.25"][2] is False  # 0.8 / 0.6 = 1.33
    assert t["kernels per layer <= 15 (decode_k1)"] == (14.0, 15.0, True)  # 168 / 12 layers
    assert not any("spec_k16" in k for k in t)  # a spec step also runs drafter layers: not counted per layer
    assert not any(k.startswith("batch 16") for k in t)  # DFlash with a random drafter: not the target's subject
    assert t["GPU idle between steps <= 5% (worst row)"] == (2.0, 5.0, True)
    res["targets"] = t
    print_table(res)
    out = capsys.readouterr().out
    assert "compiled steps" in out and "compiled target step (Inductor, CUDA graph): K=1:0.600 K=16:0.800 ms" in out
    assert "sampled T=0.6 batch 1" in out and "-> MISS" in out and "-> HIT" in out


def test_trained_pair_targets_without_compile(capsys):
    res = _res("models/target", [_row(1, 2000.0, 5400.0, 3.8, idle=(1.0, 6.5)), _row(16, 20000.0, 48600.0, 3.6)],
               hf=None)
    t = targets(res, random=False)
    assert t["batch 16 aggregate DFlash >= 8x batch 1"] == (9.0, 8.0, True)
    assert t["trained pair DFlash >= 2.5x plain, batch 1"] == (2.7, 2.5, True)
    assert t["trained pair DFlash >= 3x plain, batch 1"] == (2.7, 3.0, False)
    assert t["GPU idle between steps <= 5% (worst row)"] == (6.5, 5.0, False)
    assert not any(k.startswith("0.9B") for k in t)
    res["targets"] = t
    print_table(res)
    assert "compiled target step" not in capsys.readouterr().out


def test_speedup_terms_explain_the_ratio(capsys):
    """DFlash/plain = tokens per launch x plain step / spec step (hand-written run figures: 2.8 x 0.333 / 0.75)."""
    r = _row(1, 3000.0, 3700.0, 3.1)
    r["plain"].update(tokens_per_launch=1.0, step_ms=0.333)
    r["dflash"].update(tokens_per_launch=2.8, step_ms=0.75)
    res = _res("models/target", [r], hf=None)
    res["targets"] = targets(res, random=False)
    print_table(res)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("batch 1: DFlash/plain"))
    assert "1.23x = 2.80 tokens per spec launch (plain 1.00)" in line and "= 1.24x in GPU time" in line


def test_decode_pools_every_prompt(monkeypatch):
    """_decode over prompts run one after another: tok/s over the summed time, tau over every step, step ms
    weighted by launches (hand-written per-prompt figures; decode_run itself needs a GPU trace)."""
    from types import SimpleNamespace

    from dflash_trt.tools import bench_e2e_run as R

    runs = iter([{"tokens": [[0] * 9]}, {"tokens": [[0] * 9], "new_tokens": 8, "tok_s": 4.0, "accepted": [3, 3],
                                          "launches": 3, "step_ms": 1.0, "idle_pct": 1.0, "failed": [],
                                          "gc_ms": 1.5, "gc_full": 0},
                 {"tokens": [[0] * 5], "new_tokens": 4, "tok_s": 1.0, "accepted": [0, 0, 0, 1], "launches": 5,
                  "step_ms": 2.0, "idle_pct": 3.0, "failed": [], "gc_ms": 40.0, "gc_full": 1}])
    monkeypatch.setattr(R, "decode_run", lambda *a, **k: next(runs))
    out = R._decode(None, [[1], [2]], 1, SimpleNamespace(gamma=15, batch1_prompts=2, max_new_tokens=8, repeats=1),
                  spec=True)
    assert out["tok_s"] == 12 / 6.0  # 8 tokens in 2 s + 4 tokens in 4 s
    assert out["tau"] == 1 + 7 / 6 and out["tokens_per_launch"] == 12 / 8
    assert out["step_ms"] == (3 * 1.0 + 5 * 2.0) / 8 and out["idle_pct"] == 2.0
    assert out["gc_ms"] == 41.5 and out["gc_full"] == 1 and out["gc_runs"] == [(41.5, 1)]  # summed over the prompts


def test_decode_row_is_the_median_measured_run(monkeypatch, capsys):
    """--repeats 3: the row is the measured run of median tok/s (all its figures from that run), every run's tok/s
    kept and printed beside the table (hand-written per-run figures)."""
    from types import SimpleNamespace

    from dflash_trt.tools import bench_e2e_run as R

    def run(tok_s, idle):
        return {"tokens": [[0] * 9], "new_tokens": 8, "tok_s": tok_s, "accepted": [], "launches": 8, "step_ms": 1.0,
                "idle_pct": idle, "failed": [], "gc_ms": 100.0 / tok_s, "gc_full": int(tok_s < 15)}

    runs = iter([run(1.0, 0.0), run(40.0, 1.0), run(10.0, 12.0), run(20.0, 3.0)])  # warm-up, then 3 measured
    monkeypatch.setattr(R, "decode_run", lambda *a, **k: next(runs))
    a = SimpleNamespace(gamma=None, requests_per_slot=1, max_new_tokens=8, repeats=3)
    out = R._decode(None, [[1]], 16, a, spec=False)
    assert out["tok_s"] == 20.0 and out["idle_pct"] == 3.0 and out["tok_s_runs"] == [40.0, 10.0, 20.0]
    res = _res("models/target", [{"batch": 16, "plain": out}], hf=None)
    res["targets"] = targets(res, random=False)
    print_table(res)
    printed = capsys.readouterr().out
    assert "tok/s of each measured run (the row is the median): batch 16 plain 10/20/40" in printed
    assert ("host garbage-collector pauses in each measured run (run order): batch 16 plain 40 tok/s 2.5 ms (0 full)"
            " / 10 tok/s 10.0 ms (1 full) / 20 tok/s 5.0 ms (0 full)") in printed


def test_decode_run_traces_every_launch(tmp_path):
    """decode_run's own figures on CPU (the fused step executor runs eagerly there), with a device whose events
    are host clock reads: one trace pair per launch, tokens and accepted counts from the requests."""
    import numpy as np

    from dflash_trt.tools.bench_e2e import decode_run

    rt = tiny_bench_runtime(tmp_path, ClockedCpu())
    launches = []
    launch = rt.executor.launch
    rt.executor.launch = lambda plan: launches.append(plan.K) or launch(plan)
    prompts = [[int(x) for x in np.random.default_rng(i).integers(0, 250, 7)] for i in (1, 2)]
    for spec in (False, True):
        launches.clear()
        r = decode_run(rt, prompts, 12, 3 if spec else None, spec, trace=True)
        assert r["launches"] == len(launches) > 0 and set(launches) == {4 if spec else 1}
        assert r["new_tokens"] == sum(len(x) - 1 for x in r["tokens"]) == 2 * 11
        assert r["step_ms"] > 0 and r["idle_pct"] >= 0
        assert (len(r["accepted"]) > 0) == spec and all(0 <= a <= 3 for a in r["accepted"])
    # one at a time: the second request joins mid-run; its prefill is traced (idle counts it as busy), not a step
    traces = []
    rt.executor.launch_prefill = lambda seqs, chunks, _f=rt.executor.launch_prefill: (
        traces.append(rt.executor.trace is not None) or _f(seqs, chunks))
    launches.clear()
    r = decode_run(rt, prompts, 12, 3, True, trace=True, concurrency=1)
    assert traces == [False, True] and r["launches"] == len(launches) and r["new_tokens"] == 2 * 11
    assert r["join_prefill_ms"] > 0  # the second request's prefill, timed by its own trace events
    assert r["full_batch_s"] is None  # one at a time: no batch to fill
    # three at two: full until the third has joined and a row first goes short (the drain: one request left)
    r = decode_run(rt, prompts + [prompts[0][::-1]], 12, 3, True, trace=True, concurrency=2)
    assert 0 < r["full_batch_s"] < r["new_tokens"] / r["tok_s"] and 0 < r["full_batch_tokens"] < r["new_tokens"]


def test_kernel_profile_keeps_pools_consistent(tmp_path, monkeypatch):
    """bench e2e --profile launches each key's step several times on one sequence (the device advances its rows):
    every write stays in that sequence's reserved pages and everything is given back (CPU: eager steps, no
    CUDA kernels to count)."""
    import torch

    from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
    from dflash_trt.tools.bench_e2e import kernel_profile

    rt = tiny_bench_runtime(tmp_path, TorchCpuDevice())

    class CpuActivities:  # a CPU-only torch has no CUDA activity to profile: count its CPU ops instead
        CUDA = torch.profiler.ProfilerActivity.CPU

    monkeypatch.setattr(torch.profiler, "ProfilerActivity", CpuActivities)
    held = {"kv_pool": rt.kv_alloc.alloc(2), "dkv_pool": rt.dkv_alloc.alloc(2)}  # another sequence's pages 0, 1
    for name, pages in held.items():
        rt.pools[name][:, :, pages] = 7.0
    prompts = [list(range(3, 12)), list(range(5, 9)), list(range(2, 19))]
    out = kernel_profile(rt, prompts, keys=(("decode", 1), ("spec", 4)), replays=3)
    assert set(out) == {"decode_k1", "spec_k4"}
    out = kernel_profile(rt, prompts, batch=2, keys=(("decode", 1), ("spec", 4)), replays=3)
    assert set(out) == {"decode_k1_b2", "spec_k4_b2"}
    for name, pages in held.items():  # a row past the reservation would land in page 0 (block-table padding)
        assert bool((rt.pools[name][:, :, pages] == 7.0).all()), name
    rt.kv_alloc.free(held["kv_pool"])
    rt.dkv_alloc.free(held["dkv_pool"])
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.slots.num_total
    assert rt.dkv_alloc.num_free == rt.dkv_alloc.num_total


def test_step_ks():
    from dflash_trt.tools.bench_e2e import parse_step_ks

    assert parse_step_ks("16, 4,1,4") == [1, 4, 16]
    assert parse_step_ks(",".join(map(str, range(1, 17)))) == list(range(1, 17))


def test_serving_rows_say_what_the_joiners_prefills_took(capsys):
    """A run with requests joining mid-run (--requests-per-slot > 1) prints the GPU time of their prefills
    against the decode wall time; the drain rows print no such line (hand-written figures)."""
    from dflash_trt.tools.bench_e2e_run import print_table, targets

    r1, r16 = _row(1, 3000.0, 6000.0, 2.8), _row(16, 33000.0, 43000.0, 3.4)
    r16["dflash"].update(requests=64, join_prefill_ms=61.34, join_prefill_beside_ms=20.06, decode_s=0.19,
                         full_batch_tok_s=49000.0)
    res = _res("models/target", [r1, r16], hf=None)
    res["targets"] = targets(res, random=False)
    print_table(res)
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if "joining mid-run" in x] == [
        "batch 16 dflash: 64 requests; prefills of requests joining mid-run 61.3 ms GPU (20.1 ms of it beside a step) "
        "of 190.0 ms decode wall time"]
    assert [x for x in out if "while the batch was full" in x] == [
        "batch 16 dflash: 49000.0 tok/s while the batch was full (until it first ran short with none waiting; the "
        "drain after that is as long as the longest request left)"]
    assert [x for x in out if "8x" in x] == ["target batch 16 aggregate DFlash >= 8x batch 1: 7.17 vs 8 -> MISS",
                                             "target batch 16 aggregate DFlash >= 8x batch 1, full batch: 8.17 vs 8 -> HIT"]


def test_idle_is_the_wall_time_no_launch_covers():
    """Prefills on the second stream overlap the steps: idle is what the union of launches leaves uncovered, not
    the sum of gaps between consecutive ones (hand-written event times, ms)."""
    from dflash_trt.tools.run_trace import idle_pct, prefill_beside_steps_ms

    class Clock:  # events are their times; elapsed_ms is their difference
        def sync_all(self):
            pass

        @staticmethod
        def elapsed_ms(a, b):
            return b - a

    # step 0-4, prefill 3-6 (overlaps it and the gap), step 7-10, prefill 8-9 inside it: idle 6-7 of 0-10
    trace = [(0.0, 4.0, "spec"), (3.0, 6.0, "prefill"), (7.0, 10.0, "spec"), (8.0, 9.0, "prefill")]
    assert abs(idle_pct(Clock(), trace) - 10.0) < 1e-9
    # a prefill that started before the first step launched (another stream) widens the wall time
    assert abs(idle_pct(Clock(), [(1.0, 3.0, "spec"), (-1.0, 0.0, "prefill")]) - 25.0) < 1e-9
    # of the prefills' 4 ms, 1 ran beside the first step and 1 inside the second
    assert abs(prefill_beside_steps_ms(Clock(), trace) - 2.0) < 1e-9


def test_gc_pauses_counts_the_collections_inside_it():
    """GcPauses (bench e2e's host GC figures): collections inside the block are counted and timed, full ones apart;
    none leak in after it."""
    import gc

    from dflash_trt.tools.run_trace import GcPauses

    with GcPauses() as p:
        gc.collect(0)
        gc.collect()
    assert p.count >= 2 and p.full >= 1 and p.ms > 0.0
    seen = (p.count, p.full, p.ms)
    gc.collect()
    assert (p.count, p.full, p.ms) == seen and p._cb not in gc.callbacks


def test_profile_of_batch_one_and_the_widest_batch_printed(tmp_path, monkeypatch, capsys):
    """bench e2e --profile (the 0.9B, 27B and MoE presets alike): the decode and spec steps at batch 1 and at the
    widest --batch, a line each."""
    import torch

    from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
    from dflash_trt.tools.bench_e2e import print_profile, profile_batches

    rt = tiny_bench_runtime(tmp_path, TorchCpuDevice())

    class CpuActivities:
        CUDA = torch.profiler.ProfilerActivity.CPU

    monkeypatch.setattr(torch.profiler, "ProfilerActivity", CpuActivities)
    res = {"profile": profile_batches(rt, [list(range(3, 12))], [1, 2], keys=(("decode", 1), ("spec", 4)), replays=2)}
    assert set(res["profile"]) == {"decode_k1", "spec_k4", "decode_k1_b2", "spec_k4_b2"}
    assert all(set(p) == {"kernels", "busy_ms", "top", "all"} for p in res["profile"].values())
    assert rt.kv_alloc.num_free == rt.sizes.kv_blocks
    print_profile(res)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == list(res["profile"])
