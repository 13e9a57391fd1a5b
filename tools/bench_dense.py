"""`dflash-trt bench e2e --model random-27b [--fp8] [--layers N]`: a random dense target with Qwen3.5-27B's shapes
(64 layers, 3 GDN : 1 gated attention) and a random 5-layer drafter of the same width reading 5 taps, built in memory
on the GPU (never saved). --fp8: the same model with every projection FP8 block-wise (e4m3, 128x128 fp32 scales) as
Qwen's FP8 release stores it, except FP8_SKIP; --layers N builds the first N layers (drafter taps spread over them).

  copy bandwidth        device-to-device copy measured in this run (bench_e2e.copy_bandwidth_gbs)
  step(K), K in --step-ks  the target verify step alone at batch 1 on a 512-row context, compiled as the runtime
                        runs it (--no-compile: eager), captured in a CUDA graph and replayed (bench_moe.verify_steps)
  floor(K)              bytes the step must read / copy bandwidth (bench_moe.step_bytes): every parameter as stored
                        (fp8 bytes + fp32 scales for the FP8 projections, bf16 elsewhere) but the embedding table,
                        the K embedding rows, and the sequence's state (GDN + conv slot, the KV rows of the context)
  plain vs DFlash       plain decode tok/s (batch 1) and the spec step (K = gamma + 1 = 16 with the drafter) time, the
                        spec/plain step ratio (= break-even τ) and DFlash tok/s at a scripted acceptance
                        (bench_moe.spec_vs_plain: a random drafter accepts nothing); the scripted fixed / auto K
                        lines and checks (tools/scripted.bench_scripted) from the measured steps
  prefill tok/s         one PREFILL_TOKENS-token prompt through the prefill graph, chunks of the model's default
                        (abi.default_prefill_chunk: 512 rows at these widths)
"""
from __future__ import annotations

import sys

import numpy as np

from dflash_trt.files import write_json
from dflash_trt.tools.bench_e2e import copy_bandwidth_gbs, print_profile, profile_batches
from dflash_trt.tools.bench_e2e_run import prefill_tok_s
from dflash_trt.tools.bench_moe import (compiled_words, context_sweep, random_bench_runtime, random_init, spec_vs_plain,
                                        step_bytes)
from dflash_trt.tools.bench_scale import (PROMPT, batch_decode, batch_scripted, long_context, print_batches,
                                          print_long_context, scale_targets)
from dflash_trt.tools.scripted import bench_scripted, print_scripted

RANDOM_27B = "random-27b"
LAYERS = 64
DRAFTER_LAYERS = 5
TAPS = 5
PREFILL_TOKENS = 2048
CONTEXT = 512  # rows of context of the per-K step sweep
# Kept 16-bit in the FP8 model (checkpoint module names, Fp8Config.converts patterns): the embedding, lm_head and
# the GDN's per-head a/b in-projections. Norms, conv1d and the GDN's A_log/dt_bias are not linear layers and never
# convert; a dense model has no routers or shared-expert gates.
FP8_SKIP = ("model.embed_tokens", "lm_head", "in_proj_a", "in_proj_b")
# Qwen3.5-27B; the drafter's attention is z-lab's DFlash drafter's (32 heads / 8 KV of 128)
DIMS_27B = dict(hidden=5120, inter=17408, heads=24, kv_heads=4, head_dim=256, gdn_k=16, gdn_v=48, gdn_dim=128,
                vocab=248320, d_heads=32, d_kv_heads=8, d_head_dim=128)
FP8_TYPICAL = 112.0  # random e4m3 weights are N(0, 1) * this (|w| <= 448), scaled to N(0, 0.02)


def taps(layers: int, n: int = TAPS) -> list[int]:
    """n target layers spread evenly from layer 1 to layers - 3 (z-lab's DFlash drafters' pattern), distinct."""
    hi = max(1, layers - 3)
    return sorted({min(layers - 1, int(round(v))) for v in np.linspace(1, hi, n)})


def dense_target_config(layers: int = LAYERS, dims: dict = DIMS_27B) -> dict:
    d = dims
    return dict(
        model_type="qwen3_5_text", vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
        num_hidden_layers=layers, num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"], linear_num_key_heads=d["gdn_k"], linear_num_value_heads=d["gdn_v"],
        linear_key_head_dim=d["gdn_dim"], linear_value_head_dim=d["gdn_dim"], linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        eos_token_id=None,
    )


# --dflash2: the drafter with DFlash2's convolutions and candidate selector. Sizes assumed, not read from a release:
# a kernel of 4 over groups of 128 channels, a rank-256 selector over the top 8 candidates.
DFLASH2_FIELDS = dict(conv_kernel_size=4, conv_group_size=128, selector_rank=256, selector_top_k=8)


def dense_drafter_config(layers: int = LAYERS, dims: dict = DIMS_27B, dflash2: bool = False) -> dict:
    d = dims
    return dict(**(DFLASH2_FIELDS if dflash2 else {}),
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=d["hidden"], intermediate_size=d["inter"],
        num_hidden_layers=DRAFTER_LAYERS, num_attention_heads=d["d_heads"], num_key_value_heads=d["d_kv_heads"],
        head_dim=d["d_head_dim"], rms_norm_eps=1e-6, rope_theta=10000000.0, block_size=16, num_target_layers=layers,
        dflash_config={"target_layer_ids": taps(layers), "mask_token_id": d["vocab"] - 1},
    )


def fp8_config(skip=FP8_SKIP):
    from dflash_trt.quant import Fp8Config

    return Fp8Config(skip=skip)


def quantize_random(target, gen, skip=FP8_SKIP) -> list[str]:
    """The target's projections (and routed experts) made FP8 as the release converts them (quantize_modules with
    the release's skip list), each filled with random e4m3 weights and one scale per block so that W ~ N(0, 0.02)
    like the 16-bit layers; the 16-bit weights they replace are freed layer by layer. Returns the converted
    checkpoint module names."""
    import torch

    from dflash_trt.modeling.fp8 import Fp8Experts, Fp8Linear, quantize_modules

    done = quantize_modules(target, fp8_config(skip), "model.")
    with torch.no_grad():
        for m in target.modules():
            if isinstance(m, Fp8Linear):
                pairs = [(m.weight, m.weight_scale_inv)]
            elif isinstance(m, Fp8Experts):
                pairs = [(m.gate_up_proj, m.gate_up_proj_scale_inv), (m.down_proj, m.down_proj_scale_inv)]
            else:
                continue
            for w, s in pairs:
                for wi in (w if w.dim() == 3 else [w]):  # one expert at a time: a small 16-bit temporary
                    r = torch.randn(wi.shape, device=wi.device, generator=gen, dtype=torch.bfloat16)
                    wi.copy_(r.mul_(FP8_TYPICAL).clamp_(-448, 448).to(wi.dtype))
                s.fill_(0.02 / FP8_TYPICAL)
    return done


def build_random_dense(dtype, device, layers: int = LAYERS, fp8: bool = False, dims: dict = DIMS_27B,
                       dflash2: bool = False):
    """(target, drafter) with random weights made on `device` in `dtype` (no fp32 copy of the model first), the
    target's projections FP8 when `fp8` (quantize_random) and then the drafter's too (quantize_projections, as
    load_runtime does for an FP8 target); DFlash2 when `dflash2`."""
    import torch

    from dflash_trt.config import DrafterConfig, TargetConfig
    from dflash_trt.modeling.drafter import Drafter
    from dflash_trt.modeling.target import TargetModel

    tcfg = dense_target_config(layers, dims)
    gen = torch.Generator(device=device).manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = TargetModel(TargetConfig.from_dict(tcfg))
            drafter = Drafter(DrafterConfig.from_dict(dense_drafter_config(layers, dims, dflash2)), tcfg["hidden_size"],
                              tcfg["vocab_size"])
    finally:
        torch.set_default_dtype(default)
    random_init([*target.named_parameters(), *drafter.named_parameters()], gen, device)
    if fp8:  # made on the device, in fp32 by default (the scales)
        from dflash_trt.modeling.fp8 import quantize_projections

        with torch.device(device):
            quantize_random(target, gen)
        quantize_projections(drafter)
    return target.eval(), drafter.eval().bind_target(target)


def bench_sizes(batch: int, context: int, max_new: int, prefill_chunk: int):
    """Pools for `batch` sequences of PROMPT + max_new rows at once and one sequence of max(PREFILL_TOKENS, context)
    rows beside a CONTEXT-row one (the step sweep's), each with a spec step's rows to spare; the drafter sees every
    row (ctx_window = max_seq_len)."""
    from dataclasses import replace

    from dflash_trt.abi import MAX_K, PoolSizes

    ps = 16
    longest = max(PREFILL_TOKENS, context) + max_new + 2 * MAX_K
    pages = -(-longest // ps)
    kv = 2 * pages + batch * -(-(PROMPT + max_new + 2 * MAX_K) // ps) + 64
    sizes = PoolSizes(max_seq_len=pages * ps, kv_blocks=kv, page_size=ps, max_seqs=max(2, batch), dkv_blocks=kv,
                      prefill_chunk=prefill_chunk)
    return replace(sizes, dkv_blocks=kv + sizes.drafter_slack_blocks)


def floor_bytes(target, pools, ctx_rows: int, K: int, batch: int = 1) -> float:
    """Bytes of one step of K tokens for `batch` sequences: bench_moe.step_bytes with no routed experts."""
    return step_bytes(target, pools, ctx_rows, K, [], batch)


def run(a) -> int:
    """bench e2e's entry for --model random-27b: batch 1, then --batch's larger batches and the --context rows
    (tools/bench_scale.py)."""
    from dflash_trt.abi import default_prefill_chunk
    from dflash_trt.config import TargetConfig
    from dflash_trt.tools.bench import hardware
    from dflash_trt.tools.bench_e2e import parse_step_ks

    layers = a.layers or LAYERS
    batches = [int(b) for b in a.batch.split(",")]
    sizes = bench_sizes(max(batches), a.context or 0, a.max_new_tokens,
                        default_prefill_chunk(TargetConfig.from_dict(dense_target_config(layers))))
    made = random_bench_runtime(a, lambda dt, d: build_random_dense(dt, d, layers, a.fp8, dflash2=a.dflash2), sizes)
    if made is None:
        return 2
    rt, dev, target, compiled = made
    res = {"hardware": hardware("cuda"), "model": RANDOM_27B, "layers": layers, "dtype": a.dtype or "bfloat16",
           "fp8": bool(a.fp8), "dflash2": DFLASH2_FIELDS if a.dflash2 else None, "compiled": compiled,
           "weights_GB": sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9,
           "fp8_skip": list(FP8_SKIP) if a.fp8 else None, "drafter_taps": rt.dcfg.target_layer_ids}
    res["copy_bandwidth_GBps"] = bw = copy_bandwidth_gbs(dev)
    show(print_header, res)
    rng = np.random.default_rng(1)
    vocab = target.cfg.vocab_size
    res["steps"] = steps = context_sweep(rt, dev, CONTEXT, bw, parse_step_ks(a.step_ks), compiled, rng)
    res["step16_over_step1"] = steps[16]["ms"] / steps[1]["ms"]
    show(print_steps, res)
    prompt = [int(t) for t in rng.integers(0, vocab - 1, PROMPT)]
    gamma = a.gamma or 15
    res["decode"] = spec_vs_plain(rt, prompt, a.max_new_tokens, gamma, steps[1]["ms"])
    bench_scripted(res)
    show(print_decode, res)
    res["prefill_tokens"] = PREFILL_TOKENS
    res["prefill_tok_s"] = prefill_tok_s(rt, dev, [int(t) for t in rng.integers(0, vocab - 1, PREFILL_TOKENS)])
    print(f"prefill {res['prefill_tokens']}-token prompt: {res['prefill_tok_s']:.0f} tok/s", flush=True)
    res["batches"] = {}
    for B in (b for b in batches if b > 1):  # each batch reported as soon as it is measured
        b = res["batches"][B] = batch_decode(rt, vocab, rng, [B], a.max_new_tokens, gamma, res["decode"])[B]
        # the plain step's floor at the decode's mean context
        b["floor_ms"] = floor_bytes(target, rt.pools, PROMPT + a.max_new_tokens // 2, 1, B) / (bw * 1e9) * 1e3
        b["step_over_floor"] = b["plain_step_ms"] / b["floor_ms"]
        batch_scripted(res, gamma, only=B)
        print_batches(res, only=B)
        sys.stdout.flush()
    if a.profile:
        res["profile"] = profile_batches(rt, [prompt], batches)
        show(print_profile, res)
    if a.context:
        res["long_context"] = long_context(rt, dev, target, a.context, bw, compiled, rng, a.max_new_tokens, gamma)
        show(print_long_context, res)
    res.setdefault("targets", {}).update(scale_targets(res))
    show(print_targets, res)
    if a.json:
        write_json(a.json, res)
    return 0


def show(part, res) -> None:
    """One part of the report as soon as it is measured (a long run shows its progress; a killed one keeps it)."""
    part(res)
    sys.stdout.flush()


def print_header(res) -> None:
    fp8 = (", FP8 projections (target and drafter)" if res["fp8"] else "") + (", DFlash2 drafter" if res.get("dflash2") else "")
    print(f"bench e2e: {res['model']} ({res['layers']} layers, {res['dtype']}{fp8}"
          f"{compiled_words(res['compiled'])}, {res['weights_GB']:.1f} GB) on {res['hardware']}; "
          f"device copy {res['copy_bandwidth_GBps']:.0f} GB/s; drafter taps {res['drafter_taps']}")


def print_steps(res) -> None:
    print(f"{'K':>3} {'step ms':>8} {'floor ms':>9} {'ratio':>6}")
    for K, s in res["steps"].items():
        print(f"{K:>3} {s['ms']:>8.3f} {s['floor_ms']:>9.3f} {s['ratio']:>6.2f}")
    print(f"step(16)/step(1) = {res['step16_over_step1']:.2f}")


def print_decode(res) -> None:
    d = res["decode"]
    print(f"decode batch 1: plain {d['plain_tok_s']:.1f} tok/s ({d['plain_step_ms']:.3f} ms/step); spec step (K = "
          f"{d['gamma'] + 1} + drafter) {d['spec_step_ms']:.3f} ms = {d['break_even_tau']:.2f}x plain; identical "
          f"tokens {d['identical']}")
    print(f"DFlash with scripted acceptance (tau {d['scripted_tau']:.2f}): {d['dflash_tok_s']:.1f} tok/s = "
          f"{d['dflash_over_plain']:.2f}x plain")
    print_scripted(res["scripted"])


def print_targets(res) -> None:
    for name, (v, thr, hit) in res.get("targets", {}).items():
        print(f"target {name}: {v:.2f} vs {thr:g} -> {'HIT' if hit else 'MISS'}")
