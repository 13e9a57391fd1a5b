"""Launcher of the gemv kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int)."""
from __future__ import annotations

from dflash_trt.plugins.cuda_launch import I, P, get_function, launch
from dflash_trt.plugins.gemv import spec


def gemv(w, x, y, *, M, N, K, dtype="bfloat16", y_fp32=False, stream=0):
    """y [M,N] <- x [M,K] @ w[N,K]^T (M = 1: spec.check); all contiguous; x and w one 16-bit dtype, y the same
    or fp32 (y_fp32)."""
    spec.check(M, N, K, dtype)
    rows = spec.WARPS * spec.ROWS_PER_WARP
    smem = spec.smem_bytes(M, K)
    fn = get_function("gemv", spec.kernel_name(M, K, dtype), max_dynamic_smem=spec.smem_bytes(spec.MAX_ROWS, spec.MAX_K))
    launch(fn, ((N + rows - 1) // rows, 1, 1), (spec.WARPS * 32, 1, 1), smem, stream,
           [(w, P), (x, P), (y, P), (M, I), (N, I), (K, I), (int(bool(y_fp32)), I)])
