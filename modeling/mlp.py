"""The target's MLPs: dense SwiGLU and the Qwen3-Next / Qwen3.5-MoE sparse MoE block (DESIGN §2).

Written in standard torch ops only, so they trace to standard ONNX and run inside a CUDA graph: no host
syncs, no data-dependent shapes or Python control flow.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import TargetConfig
from dflash_trt.modeling.fuse import Linear, linear, linears, swiglu
from dflash_trt.plugins import ops, torch_ops  # noqa: F401  (torch_ops registers torch.ops.dflash.moe_route)
from dflash_trt.plugins.moe import reference as moe_ref


class MLP(nn.Module):
    PROJECTIONS = ("gate_proj", "up_proj")  # one GEMM once fused (modeling/fuse.py)

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(swiglu(self, self.PROJECTIONS, x))


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
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    GATES = ("gate", "shared_expert_gate")  # both read x: one GEMM once fused (TargetModel.fuse_projections)

    def route(self, x):
        """x [N,H] -> (topk_idx [N,k] int64, topk_w [N,k] in x's dtype)."""
        return self.top_k_of(linear(x, self.gate.weight))

    def top_k_of(self, logits):
        """Router logits [N,E] -> (topk_idx, topk_w). CUDA inference: one kernel per call
        (dflash::moe_route; torch's softmax + topk cost two sort kernels per layer). CPU, ONNX export and autograd
        (the kernel has no backward; training keeps the router's gradient): the standard ops of reference.route,
        the same math (equal probabilities aside, which the kernel gives to the lowest expert id)."""
        if logits.is_cuda and not torch.is_grad_enabled() and not torch.onnx.is_in_onnx_export():
            return torch.ops.dflash.moe_route(logits, self.top_k, bool(self.norm_topk_prob))
        return moe_ref.route(logits, self.top_k, self.norm_topk_prob)

    def forward(self, x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        # the dense projections see x's rows per sequence [..., T, H] (FP8 prefill-only W8A8 keys on T:
        # modeling/fp8_gemm.w8a8_takes), the routed experts its rows flat
        logits, shared_gate = (y.reshape(-1, y.shape[-1]) for y in linears(self, self.GATES, x))
        routed = self.experts(xf, *self.top_k_of(logits))
        shared = torch.sigmoid(shared_gate) * self.shared_expert(x).reshape(-1, shape[-1])
        return (routed + shared).reshape(shape)
