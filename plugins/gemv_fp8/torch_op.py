"""torch custom ops dflash::gemv_fp8 / dflash::gemv_fp8_swiglu: CUDA -> kernel.cu via launch.py on torch's current
stream, CPU -> reference.py, plus fake impls (torch.compile). Registered through dflash_trt.plugins.torch_ops; models
reach them through modeling/fp8.py (Fp8Linear), which sends only the calls the kernel takes (spec.usable) here.

  gemv_fp8(x [*,K], w [N,K] e4m3, scale_inv [ceil(N/128),ceil(K/128)] fp32, fp32_out=False) -> y [*,N]
  gemv_fp8_swiglu(x [*,K], w [2I,K], scale_inv [2I/128,ceil(K/128)]) -> y [*,I] = silu(x @ gate.T) * (x @ up.T)
  w8a8_gemm(x [*,K], w [N,K], scale_inv [ceil(N/128),K/128], fp32_out=False) -> y [*,N]: W8A8 (reference.w8a8_gemm),
    K a multiple of 128, any number of rows. CUDA: quant.cuh's activation quantization, then torch's block-scaled
    scaled_mm (cuBLASLt, 1x128 x 128x128 scales) where it runs (compute capability 9.0, N % 16 == 0), else the
    reference math on the device.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
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


@torch.library.custom_op("dflash::w8a8_gemm", mutates_args=())
def w8a8_gemm(x: Tensor, w: Tensor, scale_inv: Tensor, fp32_out: bool = False) -> Tensor:
    raise NotImplementedError("dflash::w8a8_gemm: no kernel for this device")


@w8a8_gemm.register_kernel("cpu")
def _w8a8_gemm_cpu(x, w, scale_inv, fp32_out=False):
    return reference.w8a8_gemm(x, w, scale_inv, fp32_out)


@functools.lru_cache(maxsize=None)
def block_scaled_mm_runs(device_index: int) -> bool:
    """torch's block-scaled FP8 GEMM (F.scaled_mm with BlockWise1x128 x BlockWise128x128) runs on sm_90 only."""
    return hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(device_index) == (9, 0)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@w8a8_gemm.register_kernel("cuda")
def _w8a8_gemm_cuda(x, w, scale_inv, fp32_out=False):
    K, N = x.shape[-1], w.shape[0]
    need(K % spec.BLOCK == 0 and scale_inv.shape == spec.scale_shape(N, K),
         f"w8a8_gemm: K={K} must be whole {spec.BLOCK}-blocks and scale_inv {tuple(scale_inv.shape)} "
         f"{spec.scale_shape(N, K)}")
    if (not block_scaled_mm_runs(x.device.index or 0) or N % 16 or x.dtype not in (torch.bfloat16, torch.float16)):
        return reference.w8a8_gemm(x, w, scale_inv, fp32_out)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    # A's scales column-major with a leading dimension of exactly its rows, a multiple of 4 (torch versions check
    # one or the other): rows padded with zeros to whole groups of 4 where M is not
    xq, s = quantize_activations_cuda(F.pad(x2, (0, 0, 0, (-M) % 4)))
    # B = w.T [K, N] column-major; its scales [round_up(kb, 4), N/128] column-major (zero rows past kb)
    sb = F.pad(scale_inv.float(), (0, (-scale_inv.shape[1]) % 4)).t()
    y = F.scaled_mm(xq, w.t(), s, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                    output_dtype=torch.float32 if fp32_out else x.dtype)
    return y[:M].reshape(*x.shape[:-1], N)


def quantize_activations_cuda(x2):
    """reference.quantize_activations of a 16-bit x2 [M, K] (K % 128 == 0) by quant.cuh: (xq [M, K] e4m3, s [M, K/128]
    fp32), s column-major with a leading dimension of whole 4-row groups (the A-scale layout scaled_mm checks)."""
    x2 = x2.contiguous()
    (M, K), ld = x2.shape, _round_up(max(x2.shape[0], 1), 4)
    xq = torch.empty(M, K, device=x2.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(K // spec.BLOCK, ld, device=x2.device, dtype=torch.float32)
    if M:
        launch.quantize_groups(x2.data_ptr(), xq.data_ptr(), s.data_ptr(), M=M, K=K, ld_s=ld, dtype=U.dname(x2),
                               stream=U.stream(x2))
    return xq, s[:, :M].t()


@w8a8_gemm.register_fake
def _w8a8_gemm_fake(x, w, scale_inv, fp32_out=False):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.float32 if fp32_out else x.dtype)
