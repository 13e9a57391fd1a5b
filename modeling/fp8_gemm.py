"""W8A8 for FP8 projections at prefill widths: the activations quantized to float8_e4m3fn per token and group of 128
channels (dynamic scales, the checkpoints' `activation_scheme: "dynamic"`), times the FP8 weights and their 128x128
block scales, accumulated in fp32 (the op dflash::w8a8_gemm, plugins/gemv_fp8; its math: reference.w8a8_gemm).

Why: past the 1-16 rows of the W8A16 kernel (plugins/gemv_fp8), an FP8 layer otherwise dequantizes its whole weight
to 16 bits per call (read fp8, write and read 16-bit) and runs a 16-bit GEMM, so an FP8 prefill chunk costs more
than a bf16 one. A block-scaled FP8 GEMM reads the fp8 bytes once and runs on the FP8 tensor cores.

The mode is DFLASH_TRT_FP8_GEMM: "w8a16" (default: dequantize, the exact reference of the checkpoint's weights) or
"w8a8" (rows beyond gemv_fp8's go to dflash::w8a8_gemm).
"""
from __future__ import annotations

import os

import torch

from dflash_trt.config import ConfigError
from dflash_trt.abi import MAX_K
from dflash_trt.plugins.gemv_fp8.spec import BLOCK

MODES = ("w8a16", "w8a8")
MODE = os.environ.get("DFLASH_TRT_FP8_GEMM", "w8a16")


def w8a8_takes(x, w, block=(BLOCK, BLOCK)) -> bool:
    """Whether an FP8 projection of weight w [N, K] with scale blocks `block` runs x [..., T, K] as W8A8: the mode is
    w8a8, the blocks are 128x128, T (rows of one sequence) is wider than any verify step (abi.MAX_K), K is whole
    128-blocks, no autograd, not an ONNX export (graphs carry the W8A16 reference).
    Why T and not all rows: decode and verify steps then never run W8A8 at any batch size, so a verify computes
    the rows a plain decode would (spec == plain greedy); only prefill chunks take it."""
    return not (MODE != "w8a8" or tuple(block) != (BLOCK, BLOCK) or x.dim() < 2 or x.shape[-2] <= MAX_K
                or x.shape[-1] % BLOCK or torch.is_grad_enabled() or torch.onnx.is_in_onnx_export())


def w8a8(x, w, scale_inv, fp32_out: bool = False):
    """x [..., K] @ (w [N, K] with scale_inv [ceil(N/128), K/128]).T as W8A8 (w8a8_takes(x, w) holds)."""
    return torch.ops.dflash.w8a8_gemm(x, w, scale_inv, fp32_out)


if MODE not in MODES:
    raise ConfigError(f"DFLASH_TRT_FP8_GEMM={MODE!r}: one of {', '.join(MODES)}")
