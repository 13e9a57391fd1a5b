"""The shipped pair's architecture (HF config.json dicts) and its weight init."""
from __future__ import annotations

import math

import torch

EOS, MASK = "<|endoftext|>", "<|mask|>"
BLOCK = 16  # drafter block: [anchor token, MASK x15]


def target_config(vocab: int, eos_id: int, hidden=256, layers=8, inter=768, max_pos=2048) -> dict:
    """Qwen3.5 text decoder: layer i is full attention iff (i+1) % 4 == 0, else Gated DeltaNet."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=vocab,
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, layer_types=types,
        full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [8, 4, 4]},
        max_position_embeddings=max_pos, tie_word_embeddings=True, eos_token_id=eos_id,
        bos_token_id=None, pad_token_id=None, torch_dtype="bfloat16", dtype="bfloat16",
    )


def zlab_taps(n_target: int, n_draft: int) -> list[int]:
    """z-lab dflash `build_target_layer_ids`: one tap per drafter layer, spread over [1, n-3]."""
    if n_draft == 1:
        return [n_target // 2]
    start, end = 1, n_target - 3
    return [int(round(start + i * (end - start) / (n_draft - 1))) for i in range(n_draft)]


def drafter_config(tcfg: dict, mask_id: int, layers=2, inter=1024) -> dict:
    taps = zlab_taps(tcfg["num_hidden_layers"], layers)
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=tcfg["hidden_size"],
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
        max_position_embeddings=tcfg["max_position_embeddings"], vocab_size=tcfg["vocab_size"],
        tie_word_embeddings=False, block_size=BLOCK, num_target_layers=tcfg["num_hidden_layers"],
        dflash_config={"target_layer_ids": taps, "mask_token_id": mask_id}, torch_dtype="bfloat16",
    )


def init_weights(module, n_layers: int, gen: torch.Generator, std: float = 0.02):
    """GPT-style init: N(0, 0.02), residual-out projections scaled by 1/sqrt(2L); norms as the modules
    create them (zero-centred target norms 0, plain norms 1); GDN gates Mamba-style: A in [1,16],
    dt in [1e-3, 1e-1] (log-uniform) through dt_bias = softplus^-1(dt); conv like nn.Conv1d.
    Draws from `gen` in named_parameters order (the seeds of models/ depend on that order)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "conv1d" in name:
                bound = 1 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif "norm" in name:
                continue
            else:
                s = std / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "out_proj.weight",
                                                                    "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)

# models/target/chat_template.jinja (stage finalize writes it; dflash_trt.api.chat renders it)
CHAT_TEMPLATE = "{#- ChatML, as Qwen3.5 checkpoints write it: system / user / assistant turns, the assistant's turn opened by\n    add_generation_prompt; enable_thinking=false writes the empty think block. The shipped pair was trained on\n    Python source only: this template makes chat work end to end, not a chat model. -#}\n{%- macro text(content) -%}\n    {%- if content is string -%}\n        {{- content -}}\n    {%- else -%}\n        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}\n    {%- endif -%}\n{%- endmacro -%}\n{%- for message in messages -%}\n    {%- if message.role not in ('system', 'user', 'assistant') -%}\n        {{- raise_exception('role ' ~ message.role ~ ' is not one of system, user, assistant') -}}\n    {%- endif -%}\n    {{- '<|im_start|>' ~ message.role ~ '\\n' ~ text(message.content) ~ '<|im_end|>\\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{- '<|im_start|>assistant\\n' -}}\n    {%- if enable_thinking is defined and enable_thinking is false -%}\n        {{- '<think>\\n\\n</think>\\n\\n' -}}\n    {%- endif -%}\n{%- endif -%}\n"
