"""The target's MLPs: dense SwiGLU and the Qwen3-Next / Qwen3.5-MoE sparse MoE block (DESIGN §2).

Written in standard torch ops only, so they trace to standard ONNX and run inside a CUDA graph: no host
syncs, no data-dependent shapes or Python control flow.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import TargetConfig
from dflash_trt.modeling.fuse import BUFFER, FP8, SCALES, Linear, linear, linears, swiglu
from dflash_trt.plugins import ops, torch_ops  # noqa: F401  (torch_ops registers torch.ops.dflash.moe_route)
from dflash_trt.plugins.moe import launch as moe_launch
from dflash_trt.plugins.moe import reference as moe_ref
from dflash_trt.plugins.moe import spec as moe_spec
from dflash_trt.plugins.torch_util import dname


def kernel_inference(x) -> bool:
    """Where the CUDA kernels run a block: CUDA tensors, no autograd, not an ONNX export."""
    return x.is_cuda and not torch.is_grad_enabled() and not torch.onnx.is_in_onnx_export()


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
        fused = self.shared_fused(xf)
        if fused is not None:  # a decode step: routed and shared experts in the same two launches
            gate_up, down, scales = fused
            return torch.ops.dflash.moe_experts_shared(xf, *self.top_k_of(logits), self.experts.gate_up_proj,
                                                       self.experts.down_proj, gate_up, down, shared_gate,
                                                       scales).reshape(shape)
        routed = self.experts(xf, *self.top_k_of(logits))
        shared = torch.sigmoid(shared_gate) * self.shared_expert(x).reshape(-1, shape[-1])
        return (routed + shared).reshape(shape)

    def shared_fused(self, x):
        """(shared gate_up [2I,H], down [H,I], FP8 scales or []) where dflash::moe_experts_shared runs the block's
        experts on x [N,H], else None. It needs CUDA inference on the MoE decode path's rows (plugins/moe launch
        .takes_decode_path), every routed expert here (not a tensor-parallel rank's share) and a shared expert as
        wide as a routed one, in their format (FP8: 128x128 blocks), its gate/up fused (TargetModel
        .fuse_projections), all contiguous."""
        experts, sh = self.experts, self.shared_expert
        gate_up, down = getattr(sh, BUFFER + "gate_proj", None), sh.down_proj.weight
        H, I = down.shape  # noqa: E741
        if (gate_up is None or not kernel_inference(x)
                or tuple(experts.gate_up_proj.shape) != (self.gate.out_features, 2 * I, H)
                or not moe_launch.takes_decode_path(x.shape[0], self.top_k, I, dname(x), shared=True)):
            return None
        scales = []
        if experts.gate_up_proj.dtype == FP8:
            block = (moe_spec.FP8_BLOCK, moe_spec.FP8_BLOCK)
            if (gate_up.dtype != FP8 or down.dtype != FP8 or H % block[0] or I % block[0]
                    or tuple(experts.block) != block or tuple(sh.down_proj.block) != block):
                return None
            scales = [experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv,
                      getattr(sh, BUFFER + "gate_proj" + SCALES), sh.down_proj.weight_scale_inv]
        elif not gate_up.dtype == down.dtype == experts.gate_up_proj.dtype == x.dtype:
            return None
        tensors = (gate_up, down, experts.gate_up_proj, experts.down_proj, *scales)
        return (gate_up, down, scales) if all(t.is_contiguous() for t in tensors) else None
