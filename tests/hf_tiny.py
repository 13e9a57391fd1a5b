"""Tiny random transformers models (the oracle) saved with save_pretrained (safetensors)."""
import torch


def tiny_hf_config(kind: str, ratio: int = 2, vocab: int = 251):
    """Hv/Hk = ratio, dk != dv, two attention layers, odd vocab, partial RoPE."""
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2 * ratio, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        tie_word_embeddings=False, max_position_embeddings=512,
    )
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**common, num_experts=0, rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    from transformers import Qwen3_5TextConfig

    # multi-axis RoPE sections must cover rotary_dim/2 = 4 frequencies
    return Qwen3_5TextConfig(**common, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]))


def make_hf_model(kind: str, ratio: int, path: str, seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(kind, ratio)
    cls = Qwen3NextForCausalLM if kind == "qwen3_next" else Qwen3_5ForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():  # HF inits norms to 0/1 and A_log/dt_bias to fixed values: randomise to test them
        for n, p in model.named_parameters():
            if "norm" in n or "dt_bias" in n:
                p.add_(0.1 * torch.randn_like(p))
            if "A_log" in n:
                p.copy_(torch.empty_like(p).uniform_(-2, 1))
    model.save_pretrained(path, safe_serialization=True)
    return model
