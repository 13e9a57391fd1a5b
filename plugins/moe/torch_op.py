"""torch custom op dflash::moe_experts: CUDA -> kernel.cu via launch.py on torch's current stream, CPU -> the
dense-combine reference (reference.py), plus a fake impl (torch.compile / export). Registered through
dflash_trt.plugins.torch_ops.

  moe_experts(x [N,H], topk_idx [N,k] int, topk_w [N,k], gate_up [E,2I,H], down [E,H,I]) -> y [N,H] (x's dtype)
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.moe import launch, reference, spec
from dflash_trt.plugins.opspec import KernelError


@torch.library.custom_op("dflash::moe_experts", mutates_args=())
def moe_experts(x: Tensor, topk_idx: Tensor, topk_w: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    raise NotImplementedError("dflash::moe_experts: no kernel for this device")


def _check(x, topk_idx, topk_w, gate_up, down):
    spec.SPEC.check_shapes([tuple(t.shape) for t in (x, topk_idx, topk_w, gate_up, down)])


@moe_experts.register_kernel("cpu")
def _moe_experts_cpu(x, topk_idx, topk_w, gate_up, down):
    _check(x, topk_idx, topk_w, gate_up, down)
    return reference.moe_experts(x, topk_idx, topk_w, gate_up, down)


@moe_experts.register_kernel("cuda")
def _moe_experts_cuda(x, topk_idx, topk_w, gate_up, down):
    _check(x, topk_idx, topk_w, gate_up, down)
    U.check_groups(spec.SPEC, (x, topk_idx, topk_w, gate_up, down))
    N, H = x.shape
    k, E, I = topk_idx.shape[1], gate_up.shape[0], down.shape[2]  # noqa: E741
    spec.check_dims(N, k, E, H, I)
    if gate_up.stride(-1) != 1 or not gate_up.is_contiguous() or not down.is_contiguous():
        raise KernelError("moe_experts: expert weights must be contiguous (copying them per call would defeat it)")
    x, topk_idx, topk_w = x.contiguous(), topk_idx.contiguous(), topk_w.contiguous()
    dev = x.device
    plan = torch.empty(launch.workspace_ints(N, k, E), device=dev, dtype=torch.int32)
    h = torch.empty(N * k, I, device=dev, dtype=x.dtype)
    y_pair = torch.empty(N * k, H, device=dev, dtype=torch.float32)
    out = torch.empty_like(x)
    launch.moe_experts(x.data_ptr(), topk_idx.data_ptr(), topk_w.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                       out.data_ptr(), plan.data_ptr(), h.data_ptr(), y_pair.data_ptr(), N=N, k=k, E=E, H=H, I=I,
                       dtype=U.dname(x), idx_dtype=U.dname(topk_idx), w_dtype=U.dname(topk_w), stream=U.stream(x))
    return out


@moe_experts.register_fake
def _moe_experts_fake(x, topk_idx, topk_w, gate_up, down):
    return torch.empty_like(x)
