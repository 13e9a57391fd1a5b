"""The spec of the projections of decode and verify steps (a torch-only op: exported graphs keep MatMul).
Math: reference.py.

gemv(x [*, K], w [N, K], fp32_out) -> y [*, N] = x @ w.T, fp32 accumulation, y in x's dtype or fp32 (fp32_out: logits);
x has 1 to MAX_ROWS rows.
gemv_swiglu(x [*, K], w [2I, K]) -> y [*, I] = silu(x @ gate.T) * (x @ up.T) for w = [gate; up] (the SwiGLU MLP's fused
gate/up projection, each output rounded as eager torch rounds the unfused MLP): the same kernel body, its tile the
gate rows and their up rows, silu * up made in the epilogue (mma.cuh SWIGLU); same limits on (rows, K), I >= 1.
Why our own kernel: at 1-16 rows a projection is a pure weight stream, and cuBLAS's kernels for these shapes
read the weights at 40-80% of the copy bandwidth on the H200 (a [1 x 4096] x [4096 x 2048] bf16 out_proj: ~10 us
for 16.8 MB). gemv/mma.cuh keeps 8-16 weight loads of 16 bytes in flight per lane and multiplies on tensor
cores; it reads 3.3-3.4 TB/s on the widest decode shapes (~80% of the copy rate; the CUDA-core 1-row kernel it
replaced read 3.7, cuBLAS 3.2).
Why ONE kernel for every row count: a verify step (K rows) and the decode step of the same token (1 row) then
add the same products in the same order, so their projections agree bit for bit, and the bf16 KL between verify
and decode logits is left to the ops that really differ (the GDN chunk form vs its recurrence). On the H200 the
top-10 KL max over the trained pair's 24 bf16 prompts went from 1.26e-3 (cuBLAS verify, 1-row decode kernel) to
3.1e-4, for ~8% of decode GEMV time on the widest shapes (the price of tensor-core fragments: a lane reads 64
bytes of 8 rows per load instruction, not 512 bytes of one).
"""
from __future__ import annotations

from dflash_trt.plugins.opspec import OpSpec, Port, kernel_need, need

# rows of x per call (two 8-row n-tiles of mma.m16n8k16); more rows go to cuBLAS. Running this kernel once per 16-row
# group of a wider call (grid.y, weights re-read per group) lost to cuBLAS at 256 rows on the H200 (bf16, cold
# weights, us ours / cuBLAS: 768x256 5.26 / 3.32, 1536x256 7.32 / 3.59; won only for 256x256 2.66 / 3.05) and made
# the trained pair's batch-16 spec step slower (0.463 vs 0.406 ms busy).
MAX_ROWS = 16
CHUNK = 8           # 16-bit elements per 16-byte load: K must be a multiple
MAX_K = 1 << 20     # int32 column indexing with margin
WARPS = 8           # warps per CTA: they split K and meet in shared memory (rows.cuh / moe: always; mma: warps())
NARROW_WARPS = 16   # mma warps per CTA for narrow, deep projections (warps())
TILE_N = 16         # rows of w per CTA (the mma's m16)
DTYPES = ("bfloat16", "float16")


def usable(rows: int, K: int, dtype: str) -> bool:
    """Whether the kernel takes this call (the dispatcher's test: otherwise cuBLAS)."""
    return 1 <= rows <= MAX_ROWS and K % CHUNK == 0 and 0 < K <= MAX_K and dtype in DTYPES


def check(rows: int, N: int, K: int, dtype: str) -> None:
    kernel_need(usable(rows, K, dtype) and N >= 1,
                f"gemv: needs 1 to {MAX_ROWS} rows of x, K a multiple of {CHUNK} up to {MAX_K}, N >= 1 and a 16-bit "
                f"dtype (got rows={rows}, N={N}, K={K}, {dtype})")


def warps(N: int, K: int) -> int:
    """Warps per CTA of the mma kernel. A CTA takes 16 rows of w, so N <= 2048 makes at most 128 CTAs: fewer than
    the H200's 132 SMs, one CTA (8 warps) per SM streaming. There 16 warps (U = 4) keep twice the loads in flight
    per SM once K >= 2048 gives them work; H200, cold weights, us per call at 1 / 16 rows, 8 warps (U = 8) -> 16:
    2048 x 2048 3.95 / 4.78 -> 3.80 / 4.43, 2048 x 4096 6.85 / 8.36 -> 6.21 / 7.46, 2048 x 6144 8.64 / 10.77 ->
    8.08 / 10.10. Wider N stays at 8 (12352 x 2048 at 16 rows: 14.56 at 8 warps, 18.56 at 16)."""
    return NARROW_WARPS if N <= 2048 and K >= 2048 else WARPS


def chunks_per_pass(N: int, K: int) -> int:
    """U: 32-column chunks a warp loads per pass (U * (2 + tiles of x) loads of 16 bytes in flight per lane):
    4 at 16 warps (warps()); at 8, one pass over K when K <= 1024 (all warps busy at small K), at most 8 (the
    16-row kernel then takes 170 registers), and 4 for N >= 4096 at K = 2048, which measured faster at 1 and 16 rows
    on the H200 (in_proj 12352 x 2048: 14.8 / 15.6 us at U = 4, 16.3 / 18.2 at U = 8)."""
    if warps(N, K) == NARROW_WARPS:
        return 4
    for u in (1, 2, 4):
        if K <= WARPS * 32 * u:
            return u
    return 4 if K <= WARPS * 32 * 8 and N >= 4096 else 8


def kernel_name(rows: int, N: int, K: int, dtype: str, swiglu: bool = False) -> str:
    """The kernel.cu entry: mma_n{8-row tiles of x}_u{chunks per pass}_w{warps}_{dtype}[_swiglu]. U and the warps
    depend on (N, K) alone (N: all rows of w, also for swiglu, so its sums are the plain kernel's), and rows 1-8 of a
    16-row call run the same mma sequence as an 8-row call: a row's result does not depend on M."""
    return (f"mma_n{1 if rows <= 8 else 2}_u{chunks_per_pass(N, K)}_w{warps(N, K)}_"
            f"{'bf16' if dtype == 'bfloat16' else 'f16'}{'_swiglu' if swiglu else ''}")


def tiles(N: int, swiglu: bool = False) -> int:
    """CTA tiles of w: TILE_N rows each; swiglu: TILE_N / 2 gate rows and their up rows (mma.cuh mma_rows)."""
    return -(-N // 2 // (TILE_N // 2)) if swiglu else -(-N // TILE_N)


def _output_shapes(ins):
    return [[*ins[0][:-1], ins[1][0]]]


def _check_shapes(d, attrs=None):
    x, w = (tuple(v) for v in d)
    need(len(w) == 2 and len(x) >= 1 and x[-1] == w[1], f"Gemv: x {x} [*,K] and w {w} [N,K] must share K")


def _check_kernel(d, dtypes):
    x, w = d
    rows = 1
    for v in x[:-1]:
        rows *= v
    check(rows, w[0], w[1], dtypes[0])


SPEC = OpSpec(
    name="Gemv",
    inputs=(Port("x", "x", "[*,K]"), Port("w", "x", "[N,K]")),
    outputs=(Port("y", "x", "[*,N]"),),
    attrs=(),
    groups={"x": DTYPES},
    output_shapes=_output_shapes,
    check_shapes=_check_shapes,
    check_kernel=_check_kernel,
    doc="x @ w.T for 1-16 rows of x (decode and verify projections)",
    cuda_defines={"GEMV_WARPS": WARPS, "GEMV_NARROW_WARPS": NARROW_WARPS},
)
