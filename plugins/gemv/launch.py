"""Launcher of the gemv kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int)."""
from __future__ import annotations

from dflash_trt.plugins.cuda_launch import I, P, get_function, launch, resident_ctas
from dflash_trt.plugins.gemv import spec
from dflash_trt.plugins.opspec import kernel_need


def gemv(w, x, y, *, M, N, K, dtype="bfloat16", y_fp32=False, stream=0, swiglu=False):
    """y [M,N] <- x [M,K] @ w[N,K]^T (M <= 16: spec.check); all contiguous; x and w one 16-bit dtype, y the same
    or fp32 (y_fp32). swiglu: w = [gate; up] (N even) and y [M,N/2] <- silu(x @ gate^T) * (x @ up^T) (spec.py)."""
    spec.check(M, N, K, dtype)
    kernel_need(not swiglu or N % 2 == 0, f"gemv_swiglu: w must be [gate; up], an even number of rows (got {N})")
    fn = get_function("gemv", spec.kernel_name(M, N, K, dtype, swiglu))
    tiles = spec.tiles(N, swiglu)  # persistent CTAs walk the tiles (gemv/mma.cuh)
    threads = spec.warps(N, K) * 32
    launch(fn, (min(tiles, resident_ctas(fn, threads)), 1, 1), (threads, 1, 1), 0, stream,
           [(w, P), (x, P), (y, P), (M, I), (N, I), (K, I), (int(bool(y_fp32)), I)], pdl=True)
