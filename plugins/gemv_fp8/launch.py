"""Launcher of the FP8 gemv kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int)."""
from __future__ import annotations

from dflash_trt.plugins.cuda_launch import I, P, device_arch, get_function, launch, resident_ctas
from dflash_trt.plugins.gemv_fp8 import spec
from dflash_trt.plugins.opspec import kernel_need


def gemv_fp8(w, scale, x, y, *, M, N, K, dtype="bfloat16", y_fp32=False, stream=0, swiglu=False):
    """y [M,N] <- x [M,K] @ (w [N,K] e4m3 * scale [ceil(N/128), ceil(K/128)] fp32)^T (M <= spec.MAX_CALL_ROWS:
    spec.check); all contiguous; y x's dtype or fp32 (y_fp32). swiglu: w = [gate; up], (N/2) % 128 == 0, y [M,N/2]
    (spec.py). More than spec.MAX_ROWS rows: one launch per MAX_ROWS-row slice of x and y."""
    spec.check(M, N, K, dtype)
    kernel_need(not swiglu or spec.swiglu_usable(N),
                f"gemv_fp8_swiglu: w must be [gate; up] of I rows each with I % {spec.BLOCK} == 0 (got {N} rows)")
    y_row = (N // 2 if swiglu else N) * (4 if y_fp32 else 2)  # bytes of a row of y; x rows are K 16-bit values
    for r0 in range(0, M, spec.MAX_ROWS):
        _launch(w, scale, x + r0 * K * 2, y + r0 * y_row, min(spec.MAX_ROWS, M - r0), N, K, dtype, y_fp32, stream,
                swiglu)


def _launch(w, scale, x, y, M, N, K, dtype, y_fp32, stream, swiglu):
    """One launch over at most spec.MAX_ROWS rows."""
    bulk = spec.bulk(device_arch())
    smem = spec.bulk_smem(N, K) if bulk else 0
    fn = get_function("gemv_fp8", spec.kernel_name(M, N, K, dtype, swiglu, bulk), max_dynamic_smem=smem)
    tiles = spec.tiles(N, swiglu)  # persistent CTAs walk the tiles (gemv/mma.cuh)
    threads = (spec.warps(N, K) + bulk) * 32  # bulk: the producer warp beside the consumers
    launch(fn, (min(tiles, resident_ctas(fn, threads, smem)), 1, 1), (threads, 1, 1), smem, stream,
           [(w, P), (scale, P), (x, P), (y, P), (M, I), (N, I), (K, I), (int(bool(y_fp32)), I)], pdl=True)


QUANT_WARPS = 8  # warps per CTA of the quantization kernel: one warp per (row, 128-channel group)


def quantize_groups(x, xq, s, *, M, K, ld_s, dtype="bfloat16", stream=0):
    """xq [M,K] e4m3, s [K/128][ld_s] fp32 <- x [M,K] 16-bit (K % 128 == 0; quant.cuh), all contiguous."""
    kernel_need(K % spec.BLOCK == 0 and ld_s >= M and dtype in spec.DTYPES,
                f"fp8_quant_groups: needs K a multiple of {spec.BLOCK}, ld_s >= M and a 16-bit x "
                f"(got M={M}, K={K}, ld_s={ld_s}, {dtype})")
    fn = get_function("gemv_fp8", spec.quant_kernel_name(dtype))
    warps = M * (K // spec.BLOCK)
    launch(fn, (-(-warps // QUANT_WARPS), 1, 1), (QUANT_WARPS * 32, 1, 1), 0, stream,
           [(x, P), (xq, P), (s, P), (M, I), (K, I), (ld_s, I)])
