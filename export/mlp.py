"""The target's MLPs: dense SwiGLU and the Qwen3-Next / Qwen3.5-MoE sparse MoE block (DESIGN §2).

Written in standard torch ops only, so they trace to standard ONNX and run inside a CUDA graph: no host
syncs, no data-dependent shapes or Python control flow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import TargetConfig


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E routed SwiGLU experts stacked as HF holds them in memory: gate_up_proj [E,2I,H] (gate rows first),
    down_proj [E,H,I]. checkpoint.py also fills these from per-expert tensors (released checkpoints)."""

    def __init__(self, n: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(n, hidden, inter))

    def forward(self, x, combine):
        """x [N,H], combine [N,E] (routing weight of expert e for token n, 0 where not selected) -> [N,H].
        Dense combine: every expert runs on every token as one batched matmul over E, then the combine weights
        mix them. Chosen for correctness and portability first: all shapes are static and independent of the
        routing (no nonzero / boolean indexing / .item(), so it traces to plain ONNX MatMul and captures in a
        CUDA graph), and unselected experts add exactly 0·y. It costs E/top_k times the routed FLOPs and
        reads every expert once per step; the grouped-GEMM path (issue 16 item 3) replaces it on the GPU.
        Per (token, expert) the ops are HF's: linear, chunk, silu(gate)·up, linear, × weight in x's dtype."""
        inter = self.down_proj.shape[-1]
        gu = torch.matmul(x.unsqueeze(0), self.gate_up_proj.transpose(1, 2))  # [E,N,2I]
        y = torch.matmul(F.silu(gu[..., :inter]) * gu[..., inter:], self.down_proj.transpose(1, 2))  # [E,N,H]
        return (y * combine.t().unsqueeze(-1).to(y.dtype)).sum(0)


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
        """x [N,H] -> combine weights [N,E] in x's dtype (top-k scattered into zeros: ScatterElements in ONNX)."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter(-1, idx, top.to(logits.dtype))

    def forward(self, x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        routed = self.experts(xf, self.route(xf))
        shared = torch.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        return (routed + shared).reshape(shape)
