"""Tiny seeded random target + DFlash drafter, written as HF-format checkpoint directories.

Used by tests and as the demo's fallback model when no trained pair ships. Same files a downloaded
checkpoint has (config.json, model.safetensors), loaded by the same loaders.
"""
from __future__ import annotations

import os

import torch

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.export.checkpoint import save_checkpoint
from dflash_trt.modeling.drafter import Drafter
from dflash_trt.modeling.target import TargetModel


# a tiny sparse-MoE MLP (tiny_target_config(**TINY_MOE)): 4 experts, top-2, every layer but layer 1 sparse
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                norm_topk_prob=True, mlp_only_layers=[1])


def tiny_target_config(vocab=259, hidden=64, layers=4, ratio=2, model_type="qwen3_5_text", **over) -> dict:
    cfg = dict(
        model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2 * ratio, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, eos_token_id=None,
    )
    cfg.update(over)
    return cfg


def tiny_drafter_config(target: dict, layers=1, block_size=16, taps=None, mask_token_id=None, **over) -> dict:
    n = target["num_hidden_layers"]
    cfg = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=target["hidden_size"],
        intermediate_size=2 * target["hidden_size"], num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        block_size=block_size, num_target_layers=n,
        dflash_config={"target_layer_ids": taps or sorted({1, n - 2}),
                       "mask_token_id": target["vocab_size"] - 1 if mask_token_id is None else mask_token_id},
    )
    cfg.update(over)
    return cfg


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1, 1, generator=gen))
            elif "norm" in name:  # zero-centred norms: small offsets; plain norms: around 1
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("base_kernel"):  # DFlash2 convs: near the identity (tap 0), so signal passes
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
                p[:, 0] += 1.0
            elif name.endswith("mlp.gate.weight"):  # router: logits far enough apart that top-k is not a tie
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "conv1d" in name else 0.08))


# the smallest tiny-pair shapes our CUDA kernels take (GDN dk 64, dv a multiple of 32; attention head_dim 64):
# make_tiny_pair(dir, **KERNEL_SHAPES) for GPU tests
KERNEL_SHAPES = dict(target_over=dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=32),
                     drafter_over=dict(head_dim=64))


def make_tiny_pair(out_dir: str, seed: int = 0, target_over: dict | None = None,
                   drafter_over: dict | None = None) -> tuple[str, str]:
    """Writes out_dir/target and out_dir/drafter; returns their paths."""
    gen = torch.Generator().manual_seed(seed)
    tcfg_d = tiny_target_config(**(target_over or {}))
    dcfg_d = tiny_drafter_config(tcfg_d, **(drafter_over or {}))
    target = TargetModel(TargetConfig.from_dict(tcfg_d))
    _randomize(target, gen)
    drafter = Drafter(DrafterConfig.from_dict(dcfg_d), tcfg_d["hidden_size"], tcfg_d["vocab_size"])
    _randomize(drafter, gen)
    tdir, ddir = os.path.join(out_dir, "target"), os.path.join(out_dir, "drafter")
    save_checkpoint(target, tcfg_d, tdir, prefix="model.")
    save_checkpoint(drafter, dcfg_d, ddir)
    return tdir, ddir
