"""`dflash-trt bench e2e --model random-moe-35b-a3b`: a random MoE target with the real per-layer shapes of
Qwen3.6-35B-A3B and fewer layers (built in memory in bf16 on the GPU, never saved) and a random 1-layer drafter.

  copy bandwidth        device-to-device copy measured in this run (bench_e2e.copy_bandwidth_gbs)
  step(K), K in --step-ks  the target verify step alone at batch 1 on a 512-row context, as the runtime's compiled
                        steps run it (Inductor, our kernels opaque; --no-compile: eager) captured in a CUDA graph
                        and replayed, with random token ids (identical ids would route identically); for each K the
                        distinct experts the step selects (mean over MoE layers and over DRAWS random id draws)
  floor(K)              bytes the step must read / copy bandwidth: every non-expert weight (attention/GDN,
                        routers, shared experts, norms, lm_head), the K embedding rows, the DISTINCT experts that
                        step selects, and the sequence's state (GDN + conv slot, the KV rows of the context)
  MoE block alone       one SparseMoE layer at T tokens (captured, compiled as the step): routed kernels vs the
                        distinct-expert floor
  plain vs DFlash       plain decode tok/s measured (batch 1); the DFlash step time measured on the real spec step
                        graph with the random drafter (a fixed gamma: every step is a spec step of K = gamma+1), then
                        tok/s = mean(accepted + 1 over ACCEPTED) / spec-step time: the random drafter's τ (≈1)
                        replaced by the scripted acceptance sequence ACCEPTED. The break-even τ is
                        spec-step time / plain-step time.
  scripted fixed / auto K  tok/s of every fixed width and of the cost-aware width (runtime.draft_length) at the
                        scripts of tools/scripted.py (never-right, stationary, phased), from the measured step(K)
                        plus the spec step's drafter time (tools/scripted.step_costs), with their checks
Target: plain step(K=1) <= 2x its bytes floor.
"""
from __future__ import annotations

import sys

import numpy as np

from dflash_trt.files import write_json
from dflash_trt.tools.bench import graph_replay_ms

from dflash_trt.tools.bench_e2e import copy_bandwidth_gbs, decode_run, kernel_profile, parse_step_ks, print_profile
from dflash_trt.tools.scripted import ACCEPTED, bench_scripted, print_scripted

RANDOM_MOE = "random-moe-35b-a3b"
LAYERS = 8  # 6 GDN + 2 attention (3:1); the real model has 40
DRAWS = 4
TARGET_FLOOR_RATIO = 2.0


def moe_target_config(layers: int = LAYERS) -> dict:
    """qwen3_5_moe_text with Qwen3.6-35B-A3B's per-layer shapes: hidden 2048, 3 GDN : 1 attention, 16 heads / 2 KV,
    head_dim 256, GDN Hk16 Hv32 dk=dv=128, 256 experts top-8, moe_intermediate 512, shared expert 512 (sigmoid
    gate), norm_topk_prob, vocab 248320."""
    return dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, eos_token_id=None,
    )


def moe_drafter_config(layers: int = LAYERS) -> dict:
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=10000000.0, block_size=16, num_target_layers=layers,
        dflash_config={"target_layer_ids": sorted({1, layers // 2, layers - 2}), "mask_token_id": 248319},
    )


# the FP8 release's 16-bit modules: bench_dense's (embeddings, lm_head, the GDN a / b projections), the router and
# the shared expert's gate
FP8_SKIP_MOE = ("model.embed_tokens", "lm_head", "in_proj_a", "in_proj_b", "mlp.gate", "mlp.shared_expert_gate")


def build_random_moe(dtype, device, layers: int = LAYERS, fp8: bool = False):
    """(target, drafter) with random weights made on the device (N(0, 0.02) matrices, zero-centred norms at 0,
    GDN A_log / dt_bias in their usual ranges); fp8: the target's projections and routed experts FP8 as the
    release stores them (bench_dense.quantize_random with FP8_SKIP_MOE), then the drafter's projections (as
    load_runtime quantizes a drafter beside an FP8 target)."""
    import torch

    from dflash_trt.config import DrafterConfig, TargetConfig
    from dflash_trt.modeling.drafter import Drafter
    from dflash_trt.modeling.target import TargetModel

    tcfg = moe_target_config(layers)
    gen = torch.Generator(device=device).manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in dtype: an fp32 model first would not fit at 40 layers
    try:
        with torch.device(device):
            target = TargetModel(TargetConfig.from_dict(tcfg))
            drafter = Drafter(DrafterConfig.from_dict(moe_drafter_config(layers)), tcfg["hidden_size"])
    finally:
        torch.set_default_dtype(default)
    random_init([*target.named_parameters(), *drafter.named_parameters()], gen, device)
    if fp8:
        from dflash_trt.modeling.fp8 import quantize_projections
        from dflash_trt.tools.bench_dense import quantize_random

        with torch.device(device):
            quantize_random(target, gen, FP8_SKIP_MOE)
        quantize_projections(drafter)
    return target.eval(), drafter.eval().bind_target(target)


def random_init(named_params, gen, device) -> None:
    """N(0, 0.02) matrices, GDN A_log / dt_bias in their usual ranges, norms left at their init (the random
    presets: this module's and bench_dense's)."""
    import torch

    with torch.no_grad():
        for name, p in named_params:
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.uniform_(-1, 1, generator=gen)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)


def _expert_bytes(target) -> int:
    """Bytes of ONE routed expert (gate + up + down, and their block scales when FP8) of one layer."""
    ex = next(layer.mlp.experts for layer in target.layers if hasattr(layer.mlp, "experts"))
    return sum(p[0].numel() * p.element_size() for p in ex.parameters())


def step_bytes(target, pools, ctx_rows: int, K: int, distinct_per_layer: list[float], batch: int = 1) -> float:
    """The floor's bytes of one step of K tokens for each of `batch` sequences of ctx_rows rows (see the module
    doc); a dense target: no experts, []. Parameters count as stored (FP8 projections: 1 byte a weight + their
    fp32 scales); each sequence adds its state and KV rows."""
    moe = [layer.mlp.experts for layer in target.layers if hasattr(layer.mlp, "experts")]
    experts = {id(p) for ex in moe for p in ex.parameters()}
    emb = target.embed_tokens.weight
    dense = sum(p.numel() * p.element_size() for p in target.parameters() if id(p) not in experts and p is not emb)
    dense += batch * K * emb.shape[1] * emb.element_size()
    gdn, conv, kv = pools["gdn_pool"], pools["conv_pool"], pools["kv_pool"]
    state = gdn[:, 0].numel() * gdn.element_size() + conv[:, 0].numel() * conv.element_size()
    state += kv.shape[0] * 2 * (ctx_rows + K) * kv.shape[4] * kv.shape[5] * kv.element_size()
    return dense + batch * state + (sum(distinct_per_layer) * _expert_bytes(target) if distinct_per_layer else 0)


def _capture(fn, reps: int = 20):
    """(outputs, mean replay ms) of `fn` captured in a torch CUDA graph."""
    outs, ms = graph_replay_ms([fn], reps)
    return outs[0], ms


def compiled_words(compiled) -> str:
    """How the report names the steps' compile ("regions" is not the default, and says so)."""
    if compiled == "regions":
        return ", compiled by regions (--compile-regions, not the default)"
    return ", compiled steps" if compiled else ""


def _compiled(owner, name: str, compiled: bool):
    """owner.name through Inductor as the runtime's compiled steps run it (torch_compile.CompiledStep), or itself
    (also where compiled is "regions": the target's pieces compile inside its step)."""
    if not compiled or compiled == "regions":
        return getattr(owner, name)
    from dflash_trt.runtime.backends.torch_compile import CompiledStep

    return CompiledStep(owner, name)


def distinct_experts(target, fn) -> list[int]:
    """Run `fn` once eagerly; the number of distinct experts each MoE layer selected."""
    seen, hooks = [], []
    for layer in target.layers:
        if hasattr(layer.mlp, "experts"):
            hooks.append(layer.mlp.experts.register_forward_pre_hook(
                lambda mod, args: seen.append(int(args[1].unique().numel()))))
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


def verify_steps(rt, seq, ctx_rows: int, bw: float, ks, compiled: bool) -> dict:
    """{K: {ms, floor_ms, ratio, distinct (timed draw, mean over layers), distinct_mean (DRAWS draws)}}; a dense
    target: one draw, distinct None."""
    import torch

    t, dev = rt.backend.target, rt.device.device
    gen = torch.Generator(device=dev).manual_seed(1)
    step = _compiled(t, "step", compiled)  # one compiled function, one static-shape entry per K
    moe = any(hasattr(layer.mlp, "experts") for layer in t.layers)  # dense: no expert draws (bench_dense)
    out = {}
    for K in ks:
        def inputs():
            return {"input_ids": torch.randint(0, t.cfg.vocab_size, (1, K), device=dev, generator=gen),
                    "positions": seq.seq_len + torch.arange(K, device=dev)[None],
                    "slot": torch.tensor([seq.slot], device=dev), "seq_len": torch.tensor([seq.seq_len], device=dev),
                    "block_table": torch.as_tensor(seq.block_table()[None], device=dev)}
        pools = dict(kv_pool=rt.pools["kv_pool"], gdn_pool=rt.pools["gdn_pool"], conv_pool=rt.pools["conv_pool"])
        draws = []
        with torch.no_grad():
            for _ in range(DRAWS if moe else 1):
                x = inputs()
                draws.append(distinct_experts(t, lambda: t.step(**x, **pools)))
            _, ms = _capture(lambda: step(**x, **pools))  # the last draw is the timed one
        floor = step_bytes(t, rt.pools, ctx_rows, K, draws[-1]) / (bw * 1e9) * 1e3
        out[K] = {"ms": ms, "floor_ms": floor, "ratio": ms / floor,
                  "distinct": float(np.mean(draws[-1])) if moe else None,
                  "distinct_mean": float(np.mean(draws)) if moe else None}
    return out


def moe_block(target, bw: float, compiled: bool, tokens=(1, 4, 16, 64)) -> dict:
    """One SparseMoE layer alone at T tokens (captured): the whole block and the routed-experts op, against the
    floor of the block's bytes (router + shared expert + the distinct experts selected)."""
    import torch

    block = next(layer.mlp for layer in target.layers if hasattr(layer.mlp, "experts"))
    run_block = _compiled(block, "forward", compiled)
    eb = _expert_bytes(target)
    other = sum(p.numel() * p.element_size() for n, p in block.named_parameters() if not n.startswith("experts."))
    gen = torch.Generator(device="cuda").manual_seed(2)
    out = {}
    with torch.no_grad():
        for T in tokens:
            x = torch.randn(T, target.cfg.hidden_size, device="cuda", generator=gen).to(block.gate.weight.dtype)
            idx, w = block.route(x)
            d = int(idx.unique().numel())
            _, ms_experts = _capture(lambda: block.experts(x, idx, w))  # bf16 or FP8 experts, as the step runs them
            _, ms_block = _capture(lambda: run_block(x))
            out[T] = {"distinct": d, "experts_us": ms_experts * 1e3, "experts_floor_us": d * eb / (bw * 1e9) * 1e6,
                      "block_us": ms_block * 1e3, "block_floor_us": (d * eb + other) / (bw * 1e9) * 1e6}
    return out


def spec_vs_plain(rt, prompt, max_new: int, gamma: int, step1_ms: float) -> dict:
    decode_run(rt, [prompt], max_new, None, spec=False)  # warm-up: captures
    plain = decode_run(rt, [prompt], max_new, None, spec=False)
    decode_run(rt, [prompt], max_new, gamma, spec=True)
    spec = decode_run(rt, [prompt], max_new, gamma, spec=True)
    new = len(spec["tokens"][0]) - 1
    spec_ms = new / spec["tok_s"] / spec["steps"] * 1e3
    plain_ms = 1e3 / plain["tok_s"]
    tau = 1.0 + float(np.mean(ACCEPTED))
    return {"plain_tok_s": plain["tok_s"], "plain_step_ms": plain_ms, "spec_step_ms": spec_ms, "gamma": gamma,
            "random_drafter_tau": spec["tau"], "random_drafter_tok_s": spec["tok_s"],
            "identical": spec["tokens"] == plain["tokens"], "scripted_accepted": list(ACCEPTED),
            "scripted_tau": tau, "dflash_tok_s": tau / spec_ms * 1e3, "dflash_over_plain": tau * plain_ms / spec_ms,
            "break_even_tau": spec_ms / plain_ms, "plain_step_over_graph_step1": plain_ms / step1_ms}


def random_bench_runtime(a, build, sizes):
    """(rt, dev, target, compiled) over the random pair build(dtype, device) on a CudaDevice (steps compiled unless
    --no-compile), or None with one line said where CUDA is missing."""
    from dflash_trt.runtime.devices.cuda import CudaUnavailable, require_cuda

    try:
        require_cuda()
    except CudaUnavailable as e:
        print(f"dflash-trt bench e2e: error: {e}", file=sys.stderr)
        return None
    import torch

    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.devices.cuda import CudaDevice
    from dflash_trt.runtime.runtime import Runtime

    dev = CudaDevice()
    target, drafter = build(getattr(torch, a.dtype or "bfloat16"), dev.device)
    compiled = compile_choice(a)
    rt = Runtime(TorchBackend(target, drafter, compile_steps=compiled), target.cfg, drafter.cfg, sizes, device=dev)
    return rt, dev, target, compiled


def compile_choice(a):
    """TorchBackend's compile_steps from a bench's --no-compile / --compile-regions: False, "regions" or True."""
    return "regions" if getattr(a, "compile_regions", False) and not a.no_compile else not a.no_compile


def context_sweep(rt, dev, ctx: int, bw: float, ks, compiled: bool, rng) -> dict:
    """verify_steps on a fresh sequence of ctx random tokens (prefilled, 16 rows reserved; released after)."""
    from dflash_trt.runtime import commit

    ps = rt.sizes.page_size
    seq = rt.add_sequence([int(t) for t in rng.integers(0, rt.tcfg.vocab_size - 1, ctx)])
    rt.prefill(seq)
    dev.synchronize()
    commit.reserve(seq, 16, rt.kv_alloc, ps)
    steps = verify_steps(rt, seq, ctx, bw, ks, compiled)
    commit.finish(seq, 0, rt.kv_alloc, ps)
    rt.release(seq)
    return steps


def run(a) -> int:
    """bench e2e's entry for --model random-moe-35b-a3b (batch 1; --batch is not used)."""
    from dflash_trt.abi import PoolSizes
    from dflash_trt.tools.bench import hardware

    sizes = PoolSizes(max_seq_len=1024, kv_blocks=4 * 64 + 64, page_size=16, max_seqs=4, dkv_blocks=4 * 64 + 64,
                      ctx_window=1024, prefill_chunk=64)
    layers = a.layers or LAYERS
    made = random_bench_runtime(a, lambda dt, d: build_random_moe(dt, d, layers, a.fp8), sizes)
    if made is None:
        return 2
    rt, dev, target, compiled = made
    res = {"hardware": hardware("cuda"), "model": RANDOM_MOE, "layers": layers, "dtype": a.dtype or "bfloat16",
           "fp8": bool(a.fp8),
           "compiled": compiled, "weights_GB": sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9,
           "expert_MB": _expert_bytes(target) / 1e6}
    res["copy_bandwidth_GBps"] = bw = copy_bandwidth_gbs(dev)
    rng = np.random.default_rng(1)
    res["steps"] = steps = context_sweep(rt, dev, 512, bw, parse_step_ks(a.step_ks), compiled, rng)
    res["step16_over_step1"] = steps[16]["ms"] / steps[1]["ms"]
    res["moe_block"] = moe_block(target, bw, bool(compiled))  # the block alone, compiled whole either way
    prompt = [int(t) for t in rng.integers(0, target.cfg.vocab_size - 1, 48)]
    res["decode"] = spec_vs_plain(rt, prompt, a.max_new_tokens, a.gamma or 15, steps[1]["ms"])
    res["step1_split"] = step1_split(res, sum(hasattr(layer.mlp, "experts") for layer in target.layers))
    r1 = steps[1]["ratio"]
    res["targets"] = {f"plain step(K=1) <= {TARGET_FLOOR_RATIO:g}x bytes floor": (r1, TARGET_FLOOR_RATIO,
                                                                                 r1 <= TARGET_FLOOR_RATIO)}
    bench_scripted(res)
    if a.profile:
        res["profile"] = kernel_profile(rt, [prompt])  # batch 1: the only batch this bench runs
    print_table(res)
    print_profile(res)
    if a.json:
        write_json(a.json, res)
    return 0


def step1_split(res, moe_layers: int) -> dict:
    """Where plain step(K=1) goes over its floor: the MoE blocks (moe_layers x the one-layer block time at T=1)
    against the rest of the step (attention/GDN, norms, lm_head, copies), each with its own share of the floor."""
    s1, b1 = res["steps"][1], res["moe_block"][1]
    moe_ms, moe_floor = moe_layers * b1["block_us"] * 1e-3, moe_layers * b1["block_floor_us"] * 1e-3
    return {"moe_ms": moe_ms, "moe_floor_ms": moe_floor, "rest_ms": s1["ms"] - moe_ms,
            "rest_floor_ms": s1["floor_ms"] - moe_floor}


def print_table(res) -> None:
    fp8 = ", FP8 projections and experts" if res.get("fp8") else ""
    print(f"bench e2e: {res['model']} ({res['layers']} layers, {res['dtype']}{fp8}"
          f"{compiled_words(res.get('compiled'))}, {res['weights_GB']:.1f} GB, "
          f"{res['expert_MB']:.2f} MB/expert) on {res['hardware']}; device copy {res['copy_bandwidth_GBps']:.0f} GB/s")
    print(f"{'K':>3} {'step ms':>8} {'floor ms':>9} {'ratio':>6} {'distinct/layer':>15} {'(mean of draws)':>16}")
    for K, s in res["steps"].items():
        print(f"{K:>3} {s['ms']:>8.3f} {s['floor_ms']:>9.3f} {s['ratio']:>6.2f} {s['distinct']:>15.1f} "
              f"{s['distinct_mean']:>16.1f}")
    print(f"step(16)/step(1) = {res['step16_over_step1']:.2f}")
    print(f"{'T':>3} {'distinct':>8} {'experts us':>11} {'floor us':>9} {'block us':>9} {'floor us':>9}  (one MoE layer)")
    for T, b in res["moe_block"].items():
        print(f"{T:>3} {b['distinct']:>8} {b['experts_us']:>11.1f} {b['experts_floor_us']:>9.1f} {b['block_us']:>9.1f} "
              f"{b['block_floor_us']:>9.1f}")
    d = res["decode"]
    print(f"decode batch 1: plain {d['plain_tok_s']:.1f} tok/s ({d['plain_step_ms']:.3f} ms/step); spec step (gamma "
          f"{d['gamma']}) {d['spec_step_ms']:.3f} ms; random drafter tau {d['random_drafter_tau']:.2f}, "
          f"identical tokens {d['identical']}")
    print(f"DFlash with scripted acceptance {d['scripted_accepted']} (tau {d['scripted_tau']:.2f}): "
          f"{d['dflash_tok_s']:.1f} tok/s = {d['dflash_over_plain']:.2f}x plain; break-even tau {d['break_even_tau']:.2f}")
    print_scripted(res["scripted"])
    sp = res["step1_split"]
    print(f"plain step(K=1) split: MoE blocks {sp['moe_ms']:.3f} ms (floor {sp['moe_floor_ms']:.3f}), rest of the step "
          f"{sp['rest_ms']:.3f} ms (floor {sp['rest_floor_ms']:.3f})")
    for name, (v, thr, hit) in res["targets"].items():
        print(f"target {name}: {v:.2f} vs {thr:g} -> {'HIT' if hit else 'MISS'}")
