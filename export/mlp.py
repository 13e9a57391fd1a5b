"""The target's MLPs: dense SwiGLU and the Qwen3-Next / Qwen3.5-MoE sparse MoE block (DESIGN §2).

Written in standard torch ops only, so they trace to standard ONNX and run inside a CUDA graph: no host
syncs, no data-dependent shapes or Python control flow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import TargetConfig
from dflash_trt.export.fuse import linears
from dflash_trt.plugins import ops


class MLP(nn.Module):
    PROJECTIONS = ("gate_proj", "up_proj")  # one GEMM once fused (export/fuse.py)

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = linears(self, self.PROJECTIONS, x)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """E routed SwiGLU experts stacked as HF holds them in memory: gate_up_proj [E,2I,H] (gate rows first),
    down_proj [E,H,I]. checkpoint.py also fills these from per-expert tensors (released checkpoints)."""

    def __init__(self, n: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(n, hidden, inter))

    def forward(self, x, topk_idx, topk_w):
        """x [N,H], topk_idx / topk_w [N,k] (the selected experts and their weights) -> [N,H] in x's dtype.
        Through the op seam: on CUDA the grouped-GEMM kernels (plugins/moe: each selected expert's weights read
        once per step, static grids inside the step's CUDA graph); on CPU and under ONNX export the dense-combine
        reference (plugins/moe/reference.py: every expert on every token, standard ops, routing-independent
        shapes)."""
        return ops.moe_experts(x, topk_idx, topk_w, self.gate_up_proj, self.down_proj)


class SparseMoE(nn.Module):
    """Qwen3-Next / Qwen3.5-MoE sparse MoE block (HF Qwen3NextSparseMoeBlock numerics): router logits in x's
    dtype -> softmax in fp32 -> top-k -> renormalise in fp32 when norm_topk_prob -> cast to the logits dtype;
    routed experts + shared expert × sigmoid(shared_expert_gate(x)). Parameter names are HF's."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))  # router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x):
        """x [N,H] -> (topk_idx [N,k] int64, topk_w [N,k] in x's dtype)."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return idx, top.to(logits.dtype)

    def forward(self, x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        routed = self.experts(xf, *self.route(xf))
        shared = torch.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        return (routed + shared).reshape(shape)
