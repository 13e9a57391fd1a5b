"""Launcher of the FP8 gemv kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int)."""
from __future__ import annotations

from dflash_trt.plugins.cuda_launch import I, P, get_function, launch, resident_ctas
from dflash_trt.plugins.gemv_fp8 import spec
from dflash_trt.plugins.opspec import kernel_need


def gemv_fp8(w, scale, x, y, *, M, N, K, dtype="bfloat16", y_fp32=False, stream=0, swiglu=False):
    """y [M,N] <- x [M,K] @ (w [N,K] e4m3 * scale [ceil(N/128), ceil(K/128)] fp32)^T (M <= 16: spec.check); all
    contiguous; y x's dtype or fp32 (y_fp32). swiglu: w = [gate; up], (N/2) % 128 == 0, y [M,N/2] (spec.py)."""
    spec.check(M, N, K, dtype)
    kernel_need(not swiglu or spec.swiglu_usable(N),
                f"gemv_fp8_swiglu: w must be [gate; up] of I rows each with I % {spec.BLOCK} == 0 (got {N} rows)")
    fn = get_function("gemv_fp8", spec.kernel_name(M, N, K, dtype, swiglu))
    tiles = spec.tiles(N, swiglu)  # persistent CTAs walk the tiles (gemv/mma.cuh)
    threads = spec.warps(N, K) * 32
    launch(fn, (min(tiles, resident_ctas(fn, threads)), 1, 1), (threads, 1, 1), 0, stream,
           [(w, P), (scale, P), (x, P), (y, P), (M, I), (N, I), (K, I), (int(bool(y_fp32)), I)], pdl=True)
