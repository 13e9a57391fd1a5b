"""moe_experts, as the models call it through plugins.ops."""
from __future__ import annotations

from dflash_trt.plugins import seam_base as S
from dflash_trt.plugins.moe import reference as moe_ref
from dflash_trt.plugins.moe.spec import SPEC


def moe_experts(x, topk_idx, topk_w, gate_up, down):
    """MoeExperts: routed SwiGLU experts given the routing (plugins/moe/spec.py). CUDA tensors: the grouped-GEMM
    kernels (each selected expert's weights read once per call). Under export: one dflash::MoeExperts node (its
    body the dense combine for ORT; the same kernels as a TensorRT plugin). CPU: the dense-combine reference."""
    if S.exporting():
        return S.node(SPEC, (x, topk_idx, topk_w, gate_up, down), {})[0]
    dflash = S.cuda_ops(x)
    if dflash is not None:
        return dflash.moe_experts(x, topk_idx, topk_w, gate_up, down)
    return moe_ref.moe_experts(x, topk_idx, topk_w, gate_up, down)
