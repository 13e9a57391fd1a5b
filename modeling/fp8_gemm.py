"""W8A8 for FP8 projections at prefill widths: the activations quantized to float8_e4m3fn per token and group of 128
channels (dynamic scales, the checkpoints' `activation_scheme: "dynamic"`), times the FP8 weights and their 128x128
block scales, accumulated in fp32.

Why: past the 1-16 rows of the W8A16 kernel (plugins/gemv_fp8), an FP8 layer otherwise dequantizes its whole weight
to 16 bits per call (read fp8, write and read 16-bit) and runs a 16-bit GEMM, so an FP8 prefill chunk costs more
than a bf16 one. A block-scaled FP8 GEMM reads the fp8 bytes once and runs on the FP8 tensor cores.

The mode is DFLASH_TRT_FP8_GEMM: "w8a16" (default: dequantize, the exact reference of the checkpoint's weights) or
"w8a8" (rows beyond gemv_fp8's: on CUDA compute capability 9.0 torch's block-scaled `scaled_mm` (cuBLASLt,
1x128 x 128x128 scales); on the CPU `w8a8_reference`, the same math in fp32, for tests). Elsewhere w8a16.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dflash_trt.config import ConfigError
from dflash_trt.plugins.gemv_fp8.reference import dequantize_blockwise
from dflash_trt.plugins.gemv_fp8.spec import BLOCK, MAX_ROWS

MODES = ("w8a16", "w8a8")
MODE = os.environ.get("DFLASH_TRT_FP8_GEMM", "w8a16")
E4M3_MAX = 448.0
MIN_AMAX = 1e-10  # a group of zeros: scale from this, not 0 (its values quantize to 0 either way)


def _groups(x, group: int):
    """x [..., K] -> fp32 [..., ceil(K/group), group], the last group zero-padded."""
    return F.pad(x.float(), (0, (-x.shape[-1]) % group)).unflatten(-1, (-1, group))


def quantize_activations(x, group: int = BLOCK):
    """x [..., K] -> (xq float8_e4m3fn [..., K], scales fp32 [..., ceil(K/group)]): each token's channels in groups of
    `group`, scale = amax / 448, xq = clamp(x / scale) rounded to e4m3 (x ~= xq * scale)."""
    xf = _groups(x, group)
    s = xf.abs().amax(-1).clamp(min=MIN_AMAX) / E4M3_MAX
    xq = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq.flatten(-2)[..., :x.shape[-1]], s


def dequantize_activations(xq, s, group: int = BLOCK):
    """fp32 xq * its group's scale: the activations W8A8 multiplies."""
    return (_groups(xq, group) * s[..., None]).flatten(-2)[..., :xq.shape[-1]]


def w8a8_reference(x, w, scale_inv, fp32_out: bool = False):
    """The W8A8 product in fp32: quantized activations and block-scaled weights, both dequantized, x @ W.T, rounded
    once to x's dtype unless fp32_out."""
    xq, s = quantize_activations(x)
    y = F.linear(dequantize_activations(xq, s), dequantize_blockwise(w, scale_inv, (BLOCK, BLOCK)))
    return y if fp32_out else y.to(x.dtype)


def _scaled_mm(x, w, scale_inv, fp32_out: bool):
    """scaled_mm's block-scaled FP8 GEMM. Layouts it requires: A [M, K] row-major with scales [M, K/128] of
    strides (1, M); B = W.T [K, N] (column-major) with scales [round_up(K/128, 4), N/128] of strides (1, rows)."""
    K, N = x.shape[-1], w.shape[0]
    xq, s = quantize_activations(x.reshape(-1, K))
    kb = scale_inv.shape[1]
    sb = F.pad(scale_inv.float(), (0, (-kb) % 4)).t()
    y = F.scaled_mm(xq, w.t(), s.t().contiguous().t(), F.ScalingType.BlockWise1x128, sb,
                    F.ScalingType.BlockWise128x128, output_dtype=torch.float32 if fp32_out else x.dtype)
    return y.reshape(*x.shape[:-1], N)


def w8a8_takes(x, w, block=(BLOCK, BLOCK)) -> bool:
    """Whether an FP8 projection of weight w [N, K] with scale blocks `block` runs x as W8A8: the mode is w8a8, the
    blocks are 128x128, x has more rows than the W8A16 kernel takes, K is whole 128-blocks, no autograd, not an ONNX
    export (graphs carry the W8A16 reference); on CUDA where scaled_mm's block scaling runs (sm_90)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (MODE != "w8a8" or tuple(block) != (BLOCK, BLOCK) or rows <= MAX_ROWS or x.shape[-1] % BLOCK
            or torch.is_grad_enabled() or torch.onnx.is_in_onnx_export()):
        return False
    if not x.is_cuda:
        return True
    return (hasattr(F, "scaled_mm") and w.shape[0] % 16 == 0 and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device) == (9, 0))


def w8a8(x, w, scale_inv, fp32_out: bool = False):
    """x [..., K] @ (w [N, K] with scale_inv [ceil(N/128), K/128]).T as W8A8 (w8a8_takes(x, w) holds)."""
    if x.is_cuda:
        return _scaled_mm(x, w, scale_inv, fp32_out)
    return w8a8_reference(x, w, scale_inv, fp32_out)


if MODE not in MODES:
    raise ConfigError(f"DFLASH_TRT_FP8_GEMM={MODE!r}: one of {', '.join(MODES)}")
