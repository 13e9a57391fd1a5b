"""torch custom op dflash::gemv: CUDA -> kernel.cu via launch.py on torch's current stream, CPU -> reference.py,
plus a fake impl (torch.compile). Registered through dflash_trt.plugins.torch_ops; models reach it through
dflash_trt.modeling.fuse.linear, which sends only the calls the kernel takes (spec.usable) here.

  gemv(x [*,K], w [N,K], fp32_out=False) -> y [*,N] in x's dtype, or fp32 (logits: sums not rounded to 16 bits)
  gemv_swiglu(x [*,K], w [2I,K]) -> y [*,I] = silu(x @ gate.T) * (x @ up.T), w = [gate; up] (the SwiGLU MLP's fused
      gate/up projection with its activation in the kernel's epilogue: no elementwise kernel before down_proj)
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.gemv import launch, reference, spec
from dflash_trt.plugins.opspec import need


@torch.library.custom_op("dflash::gemv", mutates_args=())
def gemv(x: Tensor, w: Tensor, fp32_out: bool = False) -> Tensor:
    raise NotImplementedError("dflash::gemv: no kernel for this device")


@gemv.register_kernel("cpu")
def _gemv_cpu(x, w, fp32_out=False):
    return reference.gemv(x, w, fp32_out)


def _run(x, w, fallback, cols: int, y_dtype, **kw):
    """Both ops' CUDA kernel: y [*, cols] of launch.gemv(..., **kw). The caller has checked the shapes; this checks
    the dtypes. `fallback(x, w)` for a view at an odd offset (the kernel's 16-byte loads cannot read it)."""
    U.check_groups(spec.SPEC, (x, w))
    x, w = x.contiguous(), w.contiguous()
    if x.data_ptr() % 16 or w.data_ptr() % 16:
        return fallback(x, w)
    N, K = w.shape
    y = torch.empty(*x.shape[:-1], cols, device=x.device, dtype=y_dtype)
    launch.gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), M=x.numel() // K, N=N, K=K, dtype=U.dname(x),
                stream=U.stream(x), **kw)
    return y


@gemv.register_kernel("cuda")
def _gemv_cuda(x, w, fp32_out=False):
    spec.SPEC.check_shapes([tuple(x.shape), tuple(w.shape)])
    return _run(x, w, lambda x, w: reference.gemv(x, w, fp32_out), w.shape[0],
                torch.float32 if fp32_out else x.dtype, y_fp32=fp32_out)


@gemv.register_fake
def _gemv_fake(x, w, fp32_out=False):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.float32 if fp32_out else x.dtype)


@torch.library.custom_op("dflash::gemv_swiglu", mutates_args=())
def gemv_swiglu(x: Tensor, w: Tensor) -> Tensor:
    raise NotImplementedError("dflash::gemv_swiglu: no kernel for this device")


@gemv_swiglu.register_kernel("cpu")
def _gemv_swiglu_cpu(x, w):
    return reference.gemv_swiglu(x, w)


@gemv_swiglu.register_kernel("cuda")
def _gemv_swiglu_cuda(x, w):
    spec.SPEC.check_shapes([tuple(x.shape), tuple(w.shape)])
    need(w.shape[0] % 2 == 0, f"gemv_swiglu: w {tuple(w.shape)} must be [gate; up], an even number of rows")
    return _run(x, w, reference.gemv_swiglu, w.shape[0] // 2, x.dtype, swiglu=True)


@gemv_swiglu.register_fake
def _gemv_swiglu_fake(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0] // 2)
