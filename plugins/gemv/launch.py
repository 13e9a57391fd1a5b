"""Launcher of the gemv kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int)."""
from __future__ import annotations

from dflash_trt.plugins.cuda_launch import I, P, device_arch, get_function, launch, resident_ctas
from dflash_trt.plugins.gemv import spec
from dflash_trt.plugins.opspec import kernel_need


def gemv(w, x, y, *, M, N, K, dtype="bfloat16", y_fp32=False, stream=0, swiglu=False):
    """y [M,N] <- x [M,K] @ w[N,K]^T (M <= 16: spec.check); all contiguous; x and w one 16-bit dtype, y the same
    or fp32 (y_fp32). swiglu: w = [gate; up] (N even) and y [M,N/2] <- silu(x @ gate^T) * (x @ up^T) (spec.py)."""
    spec.check(M, N, K, dtype)
    kernel_need(not swiglu or N % 2 == 0, f"gemv_swiglu: w must be [gate; up], an even number of rows (got {N})")
    bulk = spec.bulk(device_arch())
    smem = spec.bulk_smem(spec.pass_bytes(N, K)) if bulk else 0
    fn = get_function("gemv", spec.kernel_name(M, N, K, dtype, swiglu, bulk), max_dynamic_smem=smem)
    tiles = spec.tiles(N, swiglu)  # persistent CTAs walk the tiles (gemv/mma.cuh)
    threads = (spec.warps(N, K) + bulk) * 32  # bulk: the producer warp beside the consumers (bulk.cuh)
    launch(fn, (min(tiles, resident_ctas(fn, threads, smem)), 1, 1), (threads, 1, 1), smem, stream,
           [(w, P), (x, P), (y, P), (M, I), (N, I), (K, I), (int(bool(y_fp32)), I)], pdl=True)
