"""Tiny random transformers models (the oracle) saved with save_pretrained (safetensors)."""
import torch


# sparse MoE: 6 experts, top-3 (more than one selected, fewer than all), expert / shared widths unlike the dense one
MOE = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40)
# FP8 block-wise checkpoints (tests/fp8_helpers.py): every projection width a multiple of the 128 block
# (the GDN b/a and router widths aside, kept unquantized as Qwen's releases do), 4 layers: still fast on a CPU
FP8_DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=128, linear_key_head_dim=64, linear_value_head_dim=128,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)


def tiny_hf_config(kind: str, ratio: int = 2, vocab: int = 251, dims: dict | None = None):
    """Hv/Hk = ratio, dk != dv, two attention layers, odd vocab, partial RoPE.
    kind: qwen3_next | qwen3_5 (dense) | qwen3_next_moe (MoE with dense layers mixed in: layer 2 by
    mlp_only_layers, odd layers by decoder_sparse_step 2) | qwen3_5_moe (text model, every layer MoE).
    dims: overrides of the sizes above and of MOE (e.g. FP8_DIMS)."""
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2 * ratio, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        tie_word_embeddings=False, max_position_embeddings=512,
    )
    dims = dims or {}
    common.update({k: v for k, v in dims.items() if k in common})
    moe = {**MOE, **{k: v for k, v in dims.items() if k in MOE}}
    next_rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    # multi-axis RoPE sections must cover rotary_dim/2 frequencies
    f = common["head_dim"] // 4
    q35_rope = dict(next_rope, mrope_section=[f // 2, f // 4, f - f // 2 - f // 4])
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**common, num_experts=0, rope_parameters=next_rope)
    if kind == "qwen3_next_moe":  # sparse layers 3, 5 (step 2, layer 1 dense by mlp_only_layers); 0, 2, 4 dense
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**common, **moe, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[1],
                               rope_parameters=next_rope)
    if kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        common.pop("intermediate_size")  # every layer is MoE: the config has no dense width
        return Qwen3_5MoeTextConfig(**common, **moe, rope_parameters=q35_rope)
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**common, rope_parameters=q35_rope)


def make_hf_model(kind: str, ratio: int, path: str, seed: int = 0, dims: dict | None = None):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(kind, ratio, dims=dims)
    cls = {"qwen3_next": Qwen3NextForCausalLM, "qwen3_next_moe": Qwen3NextForCausalLM,
           "qwen3_5_moe": Qwen3_5MoeForCausalLM}.get(kind, Qwen3_5ForCausalLM)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # HF inits norms to 0/1 and A_log/dt_bias to fixed values: randomise to test them
        for n, p in model.named_parameters():
            if "norm" in n or "dt_bias" in n:
                p.add_(0.1 * torch.randn_like(p))
            if "A_log" in n:
                p.copy_(torch.empty_like(p).uniform_(-2, 1))
            if n.endswith("mlp.gate.weight"):  # HF inits the router to zeros: all experts tie, top-k arbitrary
                p.copy_(0.5 * torch.randn_like(p))
            if "experts" in n or "shared_expert" in n:  # weights large enough that a wrong route shows
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def cached_greedy_vs_hf(hf, model_dir: str, new_tokens: int):
    """Our runtime (prefill chunks of 16, so state carries across chunks, then K=1 cached steps) and HF greedy
    recomputed on the full sequence each token, from the same 36-token prompt: (ours, hf's, runtime)."""
    from dflash_trt.abi import PoolSizes
    from dflash_trt.export.checkpoint import load_target
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.runtime import Runtime

    ours = load_target(model_dir)
    rt = Runtime(TorchBackend(ours), ours.cfg, None,
                 PoolSizes(kv_blocks=16, page_size=8, max_seq_len=96, max_seqs=2, prefill_chunk=16))
    prompt = hf_prompt(hf)
    new, _ = rt.generate(prompt, new_tokens, spec=False)
    return new, hf_greedy(hf, prompt, new_tokens), rt


def hf_prompt(hf) -> list[int]:
    """The 36-token prompt the oracle checks start from."""
    return torch.randint(0, hf.config.vocab_size, (36,), generator=torch.Generator().manual_seed(2)).tolist()


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """HF greedy, recomputed on the full sequence for each new token (no cache: the plainest oracle)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]
