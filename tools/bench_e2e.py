"""`dflash-trt bench e2e`: the GPU runtime end to end, every ratio against a baseline measured in the same run.

  prefill tok/s            one long prompt through the prefill graph (chunked)
  decode tok/s             plain vs DFlash at each --batch (aggregate new tokens / decode wall time), τ,
                           and whether DFlash reproduced the plain tokens
  step latency K=1..16     the target verify step alone, captured and replayed (CUDA events), step(16)/step(1)
  GPU idle between steps   timing events around every launch: the gaps between one step's end and the next
                           one's start, over the decode wall time (one step is kept in flight)
  sampled decode           plain vs DFlash tok/s and τ at each --temperatures value (speculative rejection
                           sampling; seeds fixed per prompt)
  HF generate()            transformers on the same weights and GPU, batch 1
  floor                    (weight + state bytes of a batch-1 decode step) / device-copy bandwidth measured here
Models: --model DIR [--drafter DIR], or --model random-0.9b (a 0.9B Qwen3.5-text config built in code with a
random 1-layer drafter; never written to disk).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from dflash_trt.args import GAMMA_HELP, ArgumentParser, gamma_arg
from dflash_trt.runtime.batching import PREFILL_STEP
from dflash_trt.tools.run_trace import GcPauses, idle_pct, prefill_beside_steps_ms, step_ms

TARGETS = {  # the end-to-end targets
    "idle_pct_max": 5.0, "plain_tok_s_0p9b": 400.0, "hf_ratio_0p9b": 30.0, "dflash_over_plain_trained": 2.5,
    "batch16_over_batch1": 8.0,
}
RANDOM_0P9B = "random-0.9b"
PRESETS = ("random-27b", "random-moe-35b-a3b")  # the real-scale presets: --layers, batch 1 unless --batch


def random_0p9b_configs() -> tuple[dict, dict]:
    """qwen3_5_text, hidden 2048, 12 layers 3 GDN : 1 attention, GDN Hk16 Hv32 128², attention 16 / 2 KV hd 128,
    vocab 32000; the drafter: one layer of the same width reading taps after layers 1, 6 and 10."""
    layers = 12
    target = dict(
        model_type="qwen3_5_text", vocab_size=32000, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [11, 11, 10]}, eos_token_id=None,
    )
    drafter = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=10000000.0, block_size=16, num_target_layers=layers,
        dflash_config={"target_layer_ids": [1, 6, 10], "mask_token_id": 31999},
    )
    return target, drafter


def build_random_pair(dtype, device):
    """(target, drafter, hf_model) sharing the target weights: HF's own init, copied into our modules."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dflash_trt.config import DrafterConfig, TargetConfig
    from dflash_trt.modeling.drafter import Drafter
    from dflash_trt.modeling.target import TargetModel

    tcfg, dcfg = random_0p9b_configs()
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tcfg)).to(dtype).eval()
        target = TargetModel(TargetConfig.from_dict(tcfg)).to(dtype)
        drafter = Drafter(DrafterConfig.from_dict(dcfg), tcfg["hidden_size"]).to(dtype)
    sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in hf.state_dict().items()}
    missing = target.load_state_dict(sd, strict=False).missing_keys
    if missing:
        raise RuntimeError(f"random-0.9b: HF state dict lacks {missing[:3]}")
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return target.eval(), drafter.eval().bind_target(target), hf


def load_pair(model, drafter_dir, dtype, device):
    from transformers import AutoModelForCausalLM

    from dflash_trt.export.checkpoint import load_drafter, load_target

    target = load_target(model, dtype).to(device)
    drafter = load_drafter(drafter_dir, target, dtype).to(device) if drafter_dir else None
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    return target, drafter, hf


def copy_bandwidth_gbs(dev, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth, counting bytes read + written (GB/s)."""
    import torch

    with dev.on_stream():
        a = torch.empty(nbytes, dtype=torch.uint8, device=dev.device)
        b = torch.empty_like(a)
        b.copy_(a)
        e0, e1 = dev.new_event(timing=True), dev.new_event(timing=True)
        dev.record(e0)
        for _ in range(reps):
            b.copy_(a)
        dev.record(e1)
    dev.synchronize()
    return 2 * nbytes * reps / (dev.elapsed_ms(e0, e1) * 1e-3) / 1e9


def step_latency_ms(rt, seq, K: int, reps: int = 20, compiled: bool = False) -> float:
    """The target verify step alone at batch 1 on `seq`'s context, captured in a CUDA graph, replayed.
    compiled: the step through Inductor first (as the runtime's compiled steps run it)."""
    import torch

    dev, t = rt.device, rt.backend.target
    x = {"input_ids": torch.zeros(1, K, dtype=torch.int64, device=dev.device),
         "positions": seq.seq_len + torch.arange(K, device=dev.device)[None],
         "slot": torch.tensor([seq.slot], device=dev.device), "seq_len": torch.tensor([seq.seq_len], device=dev.device),
         "block_table": torch.as_tensor(seq.block_table()[None], device=dev.device)}
    step = t.step
    if compiled:
        from dflash_trt.runtime.backends.torch_compile import CompiledStep

        step = CompiledStep(t, "step")
    fn = lambda: step(**x, kv_pool=rt.pools["kv_pool"], gdn_pool=rt.pools["gdn_pool"], conv_pool=rt.pools["conv_pool"])
    replay = dev.capture(fn)
    if replay is None:
        raise RuntimeError(f"step K={K}: capture failed: {dev.capture_failures[-1]}")
    e0, e1 = dev.new_event(timing=True), dev.new_event(timing=True)
    with dev.on_stream():
        for _ in range(3):
            replay()
        dev.record(e0)
        for _ in range(reps):
            replay()
        dev.record(e1)
    dev.synchronize()
    return dev.elapsed_ms(e0, e1) / reps


def decode_run(rt, prompts, max_new: int, gamma, spec: bool, trace: bool = False, temperature: float = 0.0,
               concurrency: int | None = None, ignore_eos: bool = False) -> dict:
    """Every prompt is a request; `concurrency` of them (None: all) run at once and the rest join as others
    leave. The first ones' prefill (admit) is timed apart; a later join's prefill is inside the decode wall
    time (and in the trace). Returns tokens, tok/s, τ, idle; at concurrency > 1 also the full-batch window
    (full_batch_s, full_batch_tokens: the wall time and new tokens until the batch first runs short with none
    waiting; the drain after it lasts as long as the longest request left, whatever the number of requests).
    temperature > 0: every request samples, prompt i with seed i. ignore_eos: every request runs max_new tokens."""
    for i, p in enumerate(prompts):
        rt.add_request(p, max_new, gamma=gamma, spec=spec, temperature=temperature, seed=i if temperature else None,
                       ignore_eos=ignore_eos)
    sch, dev = rt.scheduler, rt.device
    if concurrency is not None:
        sch.max_batch = concurrency
    reqs = list(sch.waiting)
    sch.admit()
    dev.synchronize()
    rt.executor.trace = [] if trace else None
    t0 = time.perf_counter()
    full = None  # (s, new tokens) when the batch first runs short with none waiting: the drain starts
    with GcPauses() as pauses:
        while sch.has_work:
            sch.step()
            if full is None and (concurrency or 0) > 1 and not sch.waiting and \
                    sum(r.wants_step for r in sch.running) < concurrency:
                full = (time.perf_counter() - t0, sum(max(len(r.tokens) - 1, 0) for r in reqs))
        dev.synchronize()
    secs = time.perf_counter() - t0
    tr, rt.executor.trace = rt.executor.trace, None
    acc = [a for r in reqs for a in r.accepted]
    new = sum(len(r.tokens) - 1 for r in reqs)
    steps = [t for t in tr if t[2] != PREFILL_STEP] if tr is not None else None
    return {"tokens": [r.tokens for r in reqs], "tok_s": new / secs, "tau": 1 + float(np.mean(acc)) if acc else 1.0,
            "accepted": [int(a) for a in acc], "new_tokens": new, "launches": len(steps) if tr is not None else None,
            "step_ms": step_ms(dev, steps) if steps else None,
            "steps": max(r.steps for r in reqs), "idle_pct": idle_pct(dev, tr) if tr else None,
            "join_prefill_ms": sum(dev.elapsed_ms(t0, t1) for t0, t1, k in tr if k == PREFILL_STEP) if tr else 0.0,
            "join_prefill_beside_ms": prefill_beside_steps_ms(dev, tr),
            "full_batch_s": full[0] if full else None, "full_batch_tokens": full[1] if full else None,
            "gc_ms": pauses.ms, "gc_full": pauses.full,
            "failed": [str(r.error) for r in reqs if r.error is not None]}


def kernel_profile(rt, prompts, batch: int = 1, keys=(("decode", 1), ("spec", 16)), top: int = 8,
                   replays: int = 5) -> dict:
    """Where a step's GPU time goes: `replays` launches of each key's step as the run launches it (its CUDA graph;
    eager where it has none) on `batch` live sequences (prompts[0..batch-1], cycled) under torch.profiler, per
    launch; {key: {"kernels": count, "busy_ms": total, "top": [(name, ms, calls)], "all": every kernel so}} with
    key kind_k{K} at batch 1, kind_k{K}_b{batch} above (the table prints the top; the JSON keeps all). The
    sequences are thrown away."""
    import torch

    from dflash_trt.runtime import commit
    from dflash_trt.runtime.batching import bucket_for, pad_rows

    ex, out = rt.executor, {}
    keys = [(kind, K) for kind, K in keys if kind != "spec" or rt.dcfg is not None]
    seqs = [rt.add_sequence(prompts[i % len(prompts)]) for i in range(batch)]
    for seq in seqs:
        rt.prefill(seq)
        # pages for every launch below: each commits up to K rows past the last (the device advances seq_len
        # itself), so no write leaves the sequence's own pages
        commit.reserve(seq, sum(K * (replays + 1) for _, K in keys), rt.kv_alloc, rt.sizes.page_size)
    B = bucket_for(batch)
    for kind, K in keys:
        vals = ex._tables(pad_rows(seqs))
        ex.run_key(kind, K, B, vals)  # captures on first use; state advance discarded
        _, run = ex.entry(kind, K, B)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with rt.device.on_stream():
                for _ in range(replays):
                    run()
            rt.device.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            if t > 0 and e.count > 0:
                rows.append((e.key[:160], t / 1e3 / replays, e.count // replays))
        rows.sort(key=lambda r: -r[1])
        out[f"{kind}_k{K}" + (f"_b{batch}" if batch > 1 else "")] = {
            "kernels": sum(r[2] for r in rows), "busy_ms": sum(r[1] for r in rows),
            "top": [(n[:60], ms, c) for n, ms, c in rows[:top]], "all": rows}
    for seq in seqs:
        rt.release(seq)
    return out


def profile_batches(rt, prompts, batches, **kw) -> dict:
    """kernel_profile (kw: its keys, replays) at batch 1 and at the widest of `batches` (where batching's time
    goes)."""
    out = kernel_profile(rt, prompts, **kw)
    if max(batches) > 1:
        out.update(kernel_profile(rt, prompts, max(batches), **kw))
    return out


def print_profile(res) -> None:
    for key, pr in res.get("profile", {}).items():
        print(f"profile {key} (per launch of its CUDA graph): {pr['kernels']} kernels, {pr['busy_ms']:.3f} ms busy; top: " +
              "; ".join(f"{n} {ms:.3f} ms x{c}" for n, ms, c in pr["top"]))


def hf_tok_s(hf, prompt, n: int) -> float:
    import torch

    ids = torch.tensor([prompt], device=next(hf.parameters()).device)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def floor_tok_s(rt, ctx_rows: int, bw_gbs: float) -> tuple[float, float]:
    """(floor ms, floor tok/s) of a batch-1 plain decode step: every weight and the sequence's state read once."""
    t = rt.backend.target
    weights = sum(p.numel() * p.element_size() for p in t.parameters())
    gdn, conv, kv = rt.pools["gdn_pool"], rt.pools["conv_pool"], rt.pools["kv_pool"]
    state = gdn[:, 0].numel() * gdn.element_size() + conv[:, 0].numel() * conv.element_size()
    state += kv.shape[0] * 2 * ctx_rows * kv.shape[4] * kv.shape[5] * kv.element_size()
    ms = (weights + state) / (bw_gbs * 1e9) * 1e3
    return ms, 1000.0 / ms


def parse_step_ks(text: str) -> list[int]:
    """--step-ks: the verify widths of the per-K step latency sweep, sorted; 1 and 16 always (the targets' ratio)."""
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        ks = []
    if not ks or not set(ks) <= set(range(1, 17)) or not {1, 16} <= set(ks):
        from dflash_trt.runtime.load import UsageError

        raise UsageError(f"--step-ks wants comma-separated K in 1..16 including 1 and 16, got {text!r}")
    return ks


def check_args(a) -> None:
    """Bad values refused in one line (UsageError) before any model loads or any GPU work starts."""
    from dflash_trt.runtime.batching import BUCKETS
    from dflash_trt.runtime.load import DTYPES, UsageError

    try:
        batches = [int(b) for b in a.batch.split(",")]
    except ValueError:
        batches = []
    if not batches or any(not 1 <= b <= BUCKETS[-1] for b in batches):
        raise UsageError(f"--batch wants comma-separated batch sizes in 1..{BUCKETS[-1]}, got {a.batch!r}")
    for flag, v, lo in (("--max-new-tokens", a.max_new_tokens, 1), ("--hf-tokens", a.hf_tokens, 0),
                        ("--batch1-prompts", a.batch1_prompts, 1), ("--gamma", a.gamma, 1),
                        ("--requests-per-slot", a.requests_per_slot, 1), ("--repeats", a.repeats, 1),
                        ("--layers", a.layers, 1), ("--context", a.context, 1)):
        if v is not None and v < lo:
            raise UsageError(f"{flag} must be >= {lo}, got {v}")
    try:
        temps = [float(t) for t in a.temperatures.split(",") if t.strip()]
    except ValueError:
        temps = [-1.0]
    if any(not t > 0 for t in temps):
        raise UsageError(f"--temperatures wants comma-separated temperatures > 0 (or ''), got {a.temperatures!r}")
    parse_step_ks(a.step_ks)
    if a.fp8 and a.model not in PRESETS:
        raise UsageError(f"--fp8 builds the random-27b and random-moe-35b-a3b presets only, not --model {a.model!r}")
    if a.dflash2 and a.model != "random-27b":
        raise UsageError(f"--dflash2 builds the random-27b preset only, not --model {a.model!r}")
    if a.context is not None and a.model != "random-27b":
        raise UsageError(f"--context builds the random-27b preset only, not --model {a.model!r}")
    if a.model == "random-moe-35b-a3b" and batches != [1]:
        raise UsageError(f"--model random-moe-35b-a3b measures batch 1 only, got --batch {a.batch!r}")
    if a.layers is not None and a.model not in PRESETS:
        raise UsageError(f"--layers builds the random-27b and random-moe-35b-a3b presets only, not --model {a.model!r}")
    if a.dtype is not None and a.dtype not in DTYPES:
        raise UsageError(f"--dtype {a.dtype!r} not supported ({', '.join(DTYPES)})")


def main(argv=None) -> int:
    p = ArgumentParser(prog="dflash-trt bench e2e")
    p.add_argument("--model", required=True,
                   help=f"target checkpoint dir, or '{RANDOM_0P9B}', 'random-27b' or 'random-moe-35b-a3b'")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="torch", choices=["torch", "trt"],
                   help="trt: the checkpoints' TensorRT engines (TensorRT-RTX: CC 8.0/8.6/8.9/12.x; full TensorRT: Hopper)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: float32; bfloat16 for random-0.9b)")
    p.add_argument("--batch", default=None,
                   help="comma-separated batch sizes, up to 64 (default: 1,4,16; 1 for the random-27b preset)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=gamma_arg, default="auto", help=GAMMA_HELP)
    p.add_argument("--temperatures", default="0.6,1.0", help="also decode sampling at these temperatures ('': skip)")
    p.add_argument("--hf-tokens", type=int, default=64, help="new tokens of the HF generate() baseline (0: skip)")
    # default: every held-out prompt (24 for the trained pair), the set the bf16 check reports on; a prefix of them
    # is not representative for the shipped drafter (docs/PERF.md)
    p.add_argument("--batch1-prompts", type=int, default=None,
                   help="batch 1 runs this many prompts one after another (default: all of them)")
    # default 4 (a server's batch): the batch stays full, the joiners' prefills inside the timed decode; at 1 the
    # batch drains as its requests finish, and a draining batch emits far fewer tokens a launch (docs/PERF.md)
    p.add_argument("--requests-per-slot", type=int, default=4,
                   help="a batch B > 1 serves B x this many requests, B at a time: one joins as another leaves "
                        "(1: the B requests start together and the batch drains as they finish)")
    # the host shares the machine, so one run's idle time varies (docs/PERF.md): the row is the median run of
    # several, its spread printed beside it
    p.add_argument("--repeats", type=int, default=3,
                   help="measured runs of every decode row after its warm-up; the table shows the median by tok/s")
    p.add_argument("--step-ks", default=",".join(map(str, range(1, 17))),
                   help="verify widths of the per-K target step latency sweep (default 1..16; 1 and 16 always)")
    p.add_argument("--no-compile", action="store_true", help="run the captured steps without Inductor")
    p.add_argument("--compile-regions", action="store_true",
                   help="random-27b / random-moe-35b-a3b: compile the models' pieces (each kind of layer once) instead "
                        "of each step whole, the step's glue compiled between its model calls: compile time "
                        "independent of --layers")
    p.add_argument("--profile", action="store_true",
                   help="also break the decode and spec steps down by kernel, at batch 1 and the widest --batch")
    p.add_argument("--fp8", action="store_true",
                   help="random-27b / random-moe-35b-a3b: FP8 block-wise projections and experts (the release layout)")
    p.add_argument("--dflash2", action="store_true",
                   help="random-27b: a DFlash2 drafter (convolutions + candidate selector) of the same size")
    p.add_argument("--layers", type=int, default=None,
                   help="random-27b / random-moe-35b-a3b: target layers built (default 64 / 8; the models have 64 / 40)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="random-27b: also one N-token prompt: time to first token, the step against its floor, "
                        "spec/plain beside a 512-token prompt's")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.batch is None:
        a.batch = "1" if a.model in PRESETS else "1,4,16"
    check_args(a)
    if a.model == "random-moe-35b-a3b":  # the MoE bench: tools/bench_moe.py
        from dflash_trt.tools.bench_moe import run as run_moe

        return run_moe(a)
    if a.model == "random-27b":  # the dense real-scale bench: tools/bench_dense.py
        from dflash_trt.tools.bench_dense import run as run_dense

        return run_dense(a)
    from dflash_trt.tools.bench_e2e_run import run

    return run(a)


if __name__ == "__main__":
    sys.exit(main())
