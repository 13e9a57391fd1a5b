"""MoE reference math (the oracle of the kernels and the CPU / ONNX path): the router's top-k (route) and
MoeExperts as a dense combine (moe_experts).

route is HF's Qwen3-Next / Qwen3.5-MoE routing in the standard ops ONNX export traces (Softmax, TopK, ReduceSum,
Div, Cast); on CUDA the kernel moe_route computes the same (ties, which torch.topk leaves unspecified, go to the
lowest expert id there).

moe_experts: every expert runs on every token as one batched matmul over E, then the routing weights (scattered
into an [N,E] combine matrix, 0 where not selected) mix them. All shapes are static and independent of the routing (no
nonzero / boolean indexing / .item()), so it traces to plain ONNX (ScatterElements, MatMul) and runs anywhere;
unselected experts add exactly 0·y. It costs E/top_k times the routed FLOPs and reads every expert per call,
which is why CUDA tensors go to the grouped kernels instead (kernel.cu). Per (token, expert) the ops are HF's:
linear, chunk, silu(gate)·up, linear, × weight in x's dtype. Pass float64 tensors for an fp64 oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits, k: int, norm: bool):
    """Router logits [N,E] -> (topk_idx [N,k] int64, topk_w [N,k] in logits' dtype): softmax in fp32, the k largest
    probabilities (descending), renormalised in fp32 to sum 1 when `norm` (norm_topk_prob), cast to logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, k, dim=-1)
    if norm:
        top = top / top.sum(dim=-1, keepdim=True)
    return idx, top.to(logits.dtype)


def combine_weights(topk_idx, topk_w, num_experts: int, dtype):
    """[N,k] ids + weights -> [N,E] combine matrix in `dtype`."""
    z = torch.zeros(topk_idx.shape[0], num_experts, dtype=dtype, device=topk_w.device)
    return z.scatter(-1, topk_idx.long(), topk_w.to(dtype))


def moe_experts(x, topk_idx, topk_w, gate_up, down):
    """x [N,H], topk_idx / topk_w [N,k], gate_up [E,2I,H], down [E,H,I] -> [N,H] in x's dtype."""
    inter = down.shape[-1]
    combine = combine_weights(topk_idx, topk_w, gate_up.shape[0], x.dtype)
    gu = torch.matmul(x.unsqueeze(0), gate_up.transpose(1, 2))  # [E,N,2I]
    y = torch.matmul(F.silu(gu[..., :inter]) * gu[..., inter:], down.transpose(1, 2))  # [E,N,H]
    return (y * combine.t().unsqueeze(-1)).sum(0)


def moe_experts_fp8(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale):
    """moe_experts on FP8 experts (e4m3 weights, fp32 scales of 128x128 blocks): W = fp8 * scale in fp32 (the W8A16
    reference), x and the routing weights in fp32, the result in x's dtype."""
    gu, dn = _dequantized((gate_up, gate_up_scale), (down, down_scale))
    return moe_experts(x.float(), topk_idx, topk_w.float(), gu, dn).to(x.dtype)


def _dequantized(*pairs):
    """W = fp8 * scale of its 128x128 block, fp32, for each (e4m3 weight, scale) pair."""
    from dflash_trt.plugins.gemv_fp8.reference import dequantize_blockwise
    from dflash_trt.plugins.moe.spec import FP8_BLOCK

    return [dequantize_blockwise(w, s, (FP8_BLOCK, FP8_BLOCK)) for w, s in pairs]


def shared_expert(x, gate_up, down, logit):
    """sigmoid(logit) * SwiGLU expert(x): x [N,H], gate_up [2I,H] (gate rows first), down [H,I], logit [N,1] in the
    model's dtype (its sigmoid rounded there, as HF's; x may be wider: an fp32 / fp64 oracle)."""
    gu = F.linear(x, gate_up)
    inter = down.shape[-1]
    return torch.sigmoid(logit).to(x.dtype) * F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], down)


def moe_experts_shared(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down, shared_logit, scales=()):
    """Routed experts plus the sparse MoE block's shared expert, as the decode path fuses them: moe_experts(...) +
    shared_expert(...). scales: () for 16-bit weights, or the four fp32 block scales of e4m3 weights (routed
    gate_up, down, shared gate_up, down): then W8A16 as moe_experts_fp8, in fp32, the result in x's dtype."""
    if not scales:
        return moe_experts(x, topk_idx, topk_w, gate_up, down) + shared_expert(x, shared_gate_up, shared_down,
                                                                                shared_logit)
    gu, dn, sgu, sdn = _dequantized(*zip((gate_up, down, shared_gate_up, shared_down), scales))
    xf = x.float()
    y = moe_experts(xf, topk_idx, topk_w.float(), gu, dn) + shared_expert(xf, sgu, sdn, shared_logit)
    return y.to(x.dtype)
