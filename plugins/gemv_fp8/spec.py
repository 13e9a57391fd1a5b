"""The spec of the FP8 (W8A16) projections of decode and verify steps (a torch-only op). Math: reference.py.

gemv_fp8(x [*, K], w [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] fp32, fp32_out) -> y [*, N]:
y = x @ W.T with W[n, k] = fp32(w[n, k]) * scale_inv[n // 128, k // 128] (the block-wise checkpoint layout,
modeling/fp8.py), fp32 accumulation, y in x's dtype or fp32 (fp32_out); x bf16 or f16 with 1 to MAX_CALL_ROWS rows
(past MAX_ROWS, launched as slices of MAX_ROWS rows: each streams the weights again, each row's sums unchanged).
gemv_fp8_swiglu(x, w [2I, K], scale_inv [2I/128, ceil(K/128)]) -> y [*, I] = silu(x @ gate.T) * (x @ up.T) for
w = [gate; up] stacked with their scales: needs I % 128 == 0 (swiglu_usable), so every scale row belongs to gate
or to up; rounded as gemv_swiglu rounds.
Why: at 1-16 rows a projection streams its weights once, and FP8 halves those bytes; dequantizing the weight per
call (modeling/fp8.py's reference path) reads it in fp8, writes it in 16 bits and reads that again. The kernel is
gemv's (gemv/mma.cuh: the same tile walk, warps splitting K, fixed reduction order, so a row's result does not depend
on the rows beside it) with an FP8 weight stream (mma_fp8.cuh): e4m3 -> bf16/f16 in registers (exact), the mma on
the unscaled values, each 64-column chunk's fp32 partial times its block's scale added to the sum.
Limits: K a multiple of 16 (one 16-byte load is 16 fp8 columns, paired with two 16-byte loads of x); N any.
"""
from __future__ import annotations

from dflash_trt.plugins.gemv import spec as gemv_spec
from dflash_trt.plugins.opspec import OpSpec, Port, kernel_need, need

MAX_ROWS = gemv_spec.MAX_ROWS  # rows of x one launch takes
# Rows of one call (launch.gemv_fp8 runs them as MAX_ROWS-row slices): a verify block of 2-4 sequences or a plain
# step of up to 64 streams the fp8 bytes once a slice (<= 4 bytes a weight) where dequantizing the weight to 16 bits
# reads and writes 5, and its rows get the same sums as a plain decode's (the kernel's sums do not depend on M).
MAX_CALL_ROWS = 4 * MAX_ROWS
CHUNK = 16          # fp8 columns per 16-byte load of w: K must be a multiple
MAX_K = gemv_spec.MAX_K
BLOCK = 128         # rows and columns of one scale block (dflash_trt.quant.BLOCK)
DTYPES = gemv_spec.DTYPES
W_DTYPES = ("float8_e4m3fn",)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def usable(rows: int, K: int, dtype: str) -> bool:
    """Whether the kernel takes this call (the dispatcher's test: otherwise the dequantizing reference path)."""
    return 1 <= rows <= MAX_CALL_ROWS and K % CHUNK == 0 and 0 < K <= MAX_K and dtype in DTYPES


def swiglu_usable(N: int) -> bool:
    """w = [gate; up] of I rows each fuses only when I % 128 == 0: the scale rows then stack gate's, then up's."""
    return N % (2 * BLOCK) == 0


def check(rows: int, N: int, K: int, dtype: str) -> None:
    kernel_need(usable(rows, K, dtype) and N >= 1,
                f"gemv_fp8: needs 1 to {MAX_CALL_ROWS} rows of x, K a multiple of {CHUNK} up to {MAX_K}, N >= 1 and a "
                f"16-bit x (got rows={rows}, N={N}, K={K}, {dtype})")


def scale_shape(N: int, K: int) -> tuple[int, int]:
    return _cdiv(N, BLOCK), _cdiv(K, BLOCK)


NARROW_N = 16384  # up to this many rows of w (and K >= NARROW_K) a CTA runs 16 warps (warps())
NARROW_K = 4096


def warps(N: int, K: int) -> int:
    """16 warps (U = 2) for projections of up to NARROW_N rows and NARROW_K columns: at 16 rows 4-11% faster than
    8 warps (U = 4) on the 27B shapes' projections and within 2% at 1 row (H200, docs/PERF.md); wider ones (the fused
    gate/up of 34816 rows: 33% slower at 1 row) keep gemv's choice for the same bytes a row (an fp8 row of K columns
    streams as a 16-bit row of K/2). Both depend on (N, K) only: a row's sums do not depend on M."""
    if N <= NARROW_N and K >= NARROW_K:
        return gemv_spec.NARROW_WARPS
    return gemv_spec.warps(N, K // 2)


def chunks_per_pass(N: int, K: int) -> int:
    """U: 64-column chunks a warp loads per pass; a slot holds 2 + 2 * (tiles of x) loads of 16 bytes (twice gemv's x
    loads), so U stops at 4 (2 at 16 warps: 128 registers a thread), else gemv's choice for a row of K/2."""
    if warps(N, K) == gemv_spec.NARROW_WARPS:
        return 2
    return min(4, gemv_spec.chunks_per_pass(N, K // 2))


def bulk(arch: tuple) -> bool:
    """Whether the weights stream through shared memory (gemv/bulk.cuh) on compute capability `arch` (as gemv's)."""
    return gemv_spec.bulk(arch)


def bulk_smem(N: int, K: int) -> int:
    """Dynamic shared memory of gemv/bulk.cuh's kernel for (N, K): a pass reads W warps x U chunks of 64 fp8 columns."""
    return gemv_spec.bulk_smem(warps(N, K) * chunks_per_pass(N, K) * 64)


def kernel_name(rows: int, N: int, K: int, dtype: str, swiglu: bool = False, bulk_stream: bool = False) -> str:
    """The kernel.cu entry: fp8[b]_n{8-row tiles of x}_u{U}_w{warps}_{dtype of x}[_swiglu] (b: bulk.cuh's stream,
    the same sums); U and the warps depend on (N, K) alone, so a row's result does not depend on M (gemv/spec.py)."""
    return (f"fp8{'b' if bulk_stream else ''}_n{1 if rows <= 8 else 2}_u{chunks_per_pass(N, K)}_w{warps(N, K)}_"
            f"{'bf16' if dtype == 'bfloat16' else 'f16'}{'_swiglu' if swiglu else ''}")


def kernel_variants() -> list[str]:
    """Every entry kernel.cu instantiates for compute capability 9.0 (the NVRTC test checks the PTX against it)."""
    uw = [(1, gemv_spec.WARPS), (2, gemv_spec.WARPS), (4, gemv_spec.WARPS), (2, gemv_spec.NARROW_WARPS)]
    return [f"fp8{b}_n{n}_u{u}_w{w}_{d}{s}" for b in ("", "b") for n in (1, 2) for u, w in uw
            for d in ("bf16", "f16") for s in ("", "_swiglu")] + [quant_kernel_name(d) for d in DTYPES]


def quant_kernel_name(dtype: str) -> str:
    """quant.cuh's entry for x of `dtype`: W8A8's activation quantization."""
    return f"fp8_quant_groups_{'bf16' if dtype == 'bfloat16' else 'f16'}"


def tiles(N: int, swiglu: bool = False) -> int:
    return gemv_spec.tiles(N, swiglu)


def _output_shapes(ins):
    return [[*ins[0][:-1], ins[1][0]]]


def _check_shapes(d, attrs=None):
    x, w, s = (tuple(v) for v in d)
    need(len(w) == 2 and len(x) >= 1 and x[-1] == w[1], f"GemvFp8: x {x} [*,K] and w {w} [N,K] must share K")
    need(s == scale_shape(*w), f"GemvFp8: scale_inv {s} must be {scale_shape(*w)} for w {w} (128x128 blocks)")


def _check_kernel(d, dtypes):
    x, w, _ = d
    check(gemv_spec.rows_of(x), w[0], w[1], dtypes[0])


SPEC = OpSpec(
    name="GemvFp8",
    inputs=(Port("x", "x", "[*,K]"), Port("w", "w", "[N,K]"), Port("scale_inv", "s", "[ceil(N/128),ceil(K/128)]")),
    outputs=(Port("y", "x", "[*,N]"),),
    attrs=(),
    groups={"x": DTYPES, "w": W_DTYPES, "s": ("float32",)},
    output_shapes=_output_shapes, check_shapes=_check_shapes, check_kernel=_check_kernel,
    doc="x @ (fp8 w * block scales).T for 1-16 rows of x (FP8 decode and verify projections)",
    cuda_defines=gemv_spec.SPEC.cuda_defines,
)
