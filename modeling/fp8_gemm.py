"""W8A8 for FP8 projections at prefill widths: the activations quantized to float8_e4m3fn per token and group of 128
channels (dynamic scales, the checkpoints' `activation_scheme: "dynamic"`), times the FP8 weights and their 128x128
block scales, accumulated in fp32 (the op dflash::w8a8_gemm, plugins/gemv_fp8; its math: reference.w8a8_gemm).

Why: past the 1-16 rows of the W8A16 kernel (plugins/gemv_fp8), an FP8 layer otherwise dequantizes its whole weight
to 16 bits per call (read fp8, write and read 16-bit) and runs a 16-bit GEMM, so an FP8 prefill chunk costs more
than a bf16 one. A block-scaled FP8 GEMM reads the fp8 bytes once and runs on the FP8 tensor cores.

The mode is DFLASH_TRT_FP8_GEMM: "auto" (default: W8A8 on a GPU where the block-scaled FP8 GEMM runs, compute
capability 9.0; W8A16 elsewhere, where W8A8 would only be its reference math), "w8a16" (dequantize: the exact
reference of the checkpoint's weights, what the CPU and the ONNX graphs compute) or "w8a8" (everywhere).
Measured (H100, 16 of Qwen3.5-27B's 64 layers, 2k-token prompt, chunk 512): W8A8 prefill 1.58x W8A16's and 1.09x
bf16's; its logits against W8A16's: docs/PERF.md.
"""
from __future__ import annotations

import os

import torch

from dflash_trt.config import ConfigError
from dflash_trt.abi import MAX_K
from dflash_trt.plugins.gemv_fp8.spec import BLOCK

MODES = ("auto", "w8a16", "w8a8")
MODE = os.environ.get("DFLASH_TRT_FP8_GEMM", "auto")


@torch.compiler.assume_constant_result
def _fast_on(device_index: int) -> bool:
    """Whether the block-scaled FP8 GEMM runs on this GPU (a constant to torch.compile, decided once)."""
    from dflash_trt.plugins.gemv_fp8.torch_op import block_scaled_mm_runs

    return block_scaled_mm_runs(device_index)


def _mode_takes(x) -> bool:
    if MODE == "auto":
        return x.is_cuda and _fast_on(x.device.index or 0)
    return MODE == "w8a8"


def w8a8_takes(x, w, block=(BLOCK, BLOCK)) -> bool:
    """Whether an FP8 projection of weight w [N, K] with scale blocks `block` runs x [..., T, K] as W8A8: the mode
    takes it (auto: on a Hopper GPU), the blocks are 128x128, T (rows of one sequence) is wider than any verify step
    (abi.MAX_K), K is whole 128-blocks, no autograd, not an ONNX export (graphs carry the W8A16 reference).
    Why T and not all rows: decode and verify steps then never run W8A8 at any batch size, so a verify computes
    the rows a plain decode would (spec == plain greedy); only prefill chunks take it."""
    return not (not _mode_takes(x) or tuple(block) != (BLOCK, BLOCK) or x.dim() < 2 or x.shape[-2] <= MAX_K
                or x.shape[-1] % BLOCK or torch.is_grad_enabled() or torch.onnx.is_in_onnx_export())


def w8a8(x, w, scale_inv, fp32_out: bool = False):
    """x [..., K] @ (w [N, K] with scale_inv [ceil(N/128), K/128]).T as W8A8 (w8a8_takes(x, w) holds)."""
    return torch.ops.dflash.w8a8_gemm(x, w, scale_inv, fp32_out)


if MODE not in MODES:
    raise ConfigError(f"DFLASH_TRT_FP8_GEMM={MODE!r}: one of {', '.join(MODES)}")
