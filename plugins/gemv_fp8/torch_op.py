"""torch custom ops dflash::gemv_fp8 / dflash::gemv_fp8_swiglu: CUDA -> kernel.cu via launch.py on torch's current
stream, CPU -> reference.py, plus fake impls (torch.compile). Registered through dflash_trt.plugins.torch_ops; models
reach them through modeling/fp8.py (Fp8Linear), which sends only the calls the kernel takes (spec.usable) here.

  gemv_fp8(x [*,K], w [N,K] e4m3, scale_inv [ceil(N/128),ceil(K/128)] fp32, fp32_out=False) -> y [*,N]
  gemv_fp8_swiglu(x [*,K], w [2I,K], scale_inv [2I/128,ceil(K/128)]) -> y [*,I] = silu(x @ gate.T) * (x @ up.T)
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.gemv_fp8 import launch, reference, spec
from dflash_trt.plugins.opspec import need


@torch.library.custom_op("dflash::gemv_fp8", mutates_args=())
def gemv_fp8(x: Tensor, w: Tensor, scale_inv: Tensor, fp32_out: bool = False) -> Tensor:
    raise NotImplementedError("dflash::gemv_fp8: no kernel for this device")


@gemv_fp8.register_kernel("cpu")
def _gemv_fp8_cpu(x, w, scale_inv, fp32_out=False):
    return reference.gemv_fp8(x, w, scale_inv, fp32_out)


def _run(x, w, scale_inv, fallback, cols: int, y_dtype, **kw):
    """Both ops' CUDA kernel: y [*, cols] of launch.gemv_fp8(..., **kw). Shapes and dtypes are checked here;
    `fallback()` serves a view at an odd offset (the kernel's 16-byte loads cannot read it)."""
    spec.SPEC.check_shapes([tuple(x.shape), tuple(w.shape), tuple(scale_inv.shape)])
    U.check_groups(spec.SPEC, (x, w, scale_inv))
    x, w, scale_inv = x.contiguous(), w.contiguous(), scale_inv.contiguous()
    if x.data_ptr() % 16 or w.data_ptr() % 16:
        return fallback()
    N, K = w.shape
    y = torch.empty(*x.shape[:-1], cols, device=x.device, dtype=y_dtype)
    launch.gemv_fp8(w.data_ptr(), scale_inv.data_ptr(), x.data_ptr(), y.data_ptr(), M=x.numel() // K, N=N, K=K,
                    dtype=U.dname(x), stream=U.stream(x), **kw)
    return y


@gemv_fp8.register_kernel("cuda")
def _gemv_fp8_cuda(x, w, scale_inv, fp32_out=False):
    return _run(x, w, scale_inv, lambda: reference.gemv_fp8(x, w, scale_inv, fp32_out), w.shape[0],
                torch.float32 if fp32_out else x.dtype, y_fp32=fp32_out)


@gemv_fp8.register_fake
def _gemv_fp8_fake(x, w, scale_inv, fp32_out=False):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.float32 if fp32_out else x.dtype)


@torch.library.custom_op("dflash::gemv_fp8_swiglu", mutates_args=())
def gemv_fp8_swiglu(x: Tensor, w: Tensor, scale_inv: Tensor) -> Tensor:
    raise NotImplementedError("dflash::gemv_fp8_swiglu: no kernel for this device")


@gemv_fp8_swiglu.register_kernel("cpu")
def _gemv_fp8_swiglu_cpu(x, w, scale_inv):
    return reference.gemv_fp8_swiglu(x, w, scale_inv)


@gemv_fp8_swiglu.register_kernel("cuda")
def _gemv_fp8_swiglu_cuda(x, w, scale_inv):
    need(spec.swiglu_usable(w.shape[0]), f"gemv_fp8_swiglu: w {tuple(w.shape)} must be [gate; up] of I rows each "
         f"with I % {spec.BLOCK} == 0")
    return _run(x, w, scale_inv, lambda: reference.gemv_fp8_swiglu(x, w, scale_inv), w.shape[0] // 2, x.dtype,
                swiglu=True)


@gemv_fp8_swiglu.register_fake
def _gemv_fp8_swiglu_fake(x, w, scale_inv):
    return x.new_empty(*x.shape[:-1], w.shape[0] // 2)
