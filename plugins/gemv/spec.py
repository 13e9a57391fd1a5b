"""The spec of the projections of decode and verify steps (a torch-only op: exported graphs keep MatMul).
Math: reference.py.

gemv(x [*, K], w [N, K], fp32_out) -> y [*, N] = x @ w.T, fp32 accumulation, y in x's dtype or fp32 (fp32_out: logits);
x has 1 to MAX_ROWS rows.
gemv_swiglu(x [*, K], w [2I, K]) -> y [*, I] = silu(x @ gate.T) * (x @ up.T) for w = [gate; up] (the SwiGLU MLP's fused
gate/up projection, each output rounded as eager torch rounds the unfused MLP): the same kernel body, its tile the
gate rows and their up rows, silu * up made in the epilogue (mma.cuh SWIGLU); same limits on (rows, K), I >= 1.
Why our own kernel: at 1-16 rows a projection is a pure weight stream, and cuBLAS's kernels for these shapes
read the weights well below the copy bandwidth; gemv/mma.cuh keeps 8-16 weight loads of 16 bytes in flight per
lane and multiplies on tensor cores (figures: docs/PERF.md).
Why ONE kernel for every row count: a verify step (K rows) and the decode step of the same token (1 row) then
add the same products in the same order, so their projections agree bit for bit, and the bf16 KL between verify
and decode logits is left to the ops that really differ (the GDN chunk form vs its recurrence). The price: a lane
of a tensor-core fragment reads 64 bytes of 8 rows per load instruction, not 512 bytes of one.
"""
from __future__ import annotations

import os

from dflash_trt.plugins.opspec import OpSpec, Port, kernel_need, need

# rows of x per call (two 8-row n-tiles of mma.m16n8k16); more rows go to cuBLAS, which beats re-reading the
# weights once per 16-row group (figures: docs/PERF.md).
MAX_ROWS = 16
CHUNK = 8           # 16-bit elements per 16-byte load: K must be a multiple
MAX_K = 1 << 20     # int32 column indexing with margin
WARPS = 8           # warps per CTA, splitting K (rows.cuh / moe: always; mma: warps())
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
    a 132-SM GPU has SMs, one CTA (8 warps) per SM streaming. There 16 warps (U = 4) keep twice the loads in flight
    per SM once K >= 2048 gives them work. Wider N stays at 8 (figures: docs/PERF.md)."""
    return NARROW_WARPS if N <= 2048 and K >= 2048 else WARPS


def chunks_per_pass(N: int, K: int) -> int:
    """U: 32-column chunks a warp loads per pass (U * (2 + tiles of x) loads of 16 bytes in flight per lane):
    4 at 16 warps (warps()); at 8, one pass over K when K <= 1024 (all warps busy at small K), at most 8 (the
    16-row kernel then takes 170 registers), and 4 for N >= 4096 at K = 2048 (faster at 1 and 16 rows; docs/PERF.md)."""
    if warps(N, K) == NARROW_WARPS:
        return 4
    for u in (1, 2, 4):
        if K <= WARPS * 32 * u:
            return u
    return 4 if K <= WARPS * 32 * 8 and N >= 4096 else 8


def kernel_name(rows: int, N: int, K: int, dtype: str, swiglu: bool = False, bulk_stream: bool = False) -> str:
    """The kernel.cu entry: mma[b]_n{8-row tiles of x}_u{chunks per pass}_w{warps}_{dtype}[_swiglu] (b: bulk.cuh's
    stream, the same sums). U and the warps depend on (N, K) alone (N: all rows of w, also for swiglu, so its sums are
    the plain kernel's), and rows 1-8 of a 16-row call run the same mma sequence as an 8-row call: a row's result
    does not depend on M."""
    return (f"mma{'b' if bulk_stream else ''}_n{1 if rows <= 8 else 2}_u{chunks_per_pass(N, K)}_w{warps(N, K)}_"
            f"{'bf16' if dtype == 'bfloat16' else 'f16'}{'_swiglu' if swiglu else ''}")


BULK_MAJORS = (9, 10)  # cp.async.bulk, mbarrier transaction counts and 228 KB of shared memory an SM (12.x: 100 KB)
BULK_RING_BYTES = 128 << 10  # shared memory of bulk.cuh's weight ring: as many passes as fit, 2 to 8 (BulkRing)


BULK_DEFAULT = "0"  # DFLASH_TRT_BULK_STREAM when unset: opt-in until measured against the register stream


def bulk(arch: tuple) -> bool:
    """Whether the weight stream goes through shared memory (bulk.cuh) on a device of compute capability `arch`:
    DFLASH_TRT_BULK_STREAM=1 (the register stream otherwise; the sums are the same, a same-run A/B)."""
    return tuple(arch)[0] in BULK_MAJORS and os.environ.get("DFLASH_TRT_BULK_STREAM", BULK_DEFAULT) != "0"


def bulk_smem(pass_bytes: int) -> int:
    """Dynamic shared memory of bulk.cuh's kernel whose pass reads pass_bytes of each of a tile's 16 rows: its
    stages (16 rows of a pass, + 64 bytes a row) and two 8-byte barriers a stage (BulkRing says the same)."""
    stage = 16 * (pass_bytes + 64)
    stages = min(8, max(2, BULK_RING_BYTES // stage))
    return stages * stage + 2 * stages * 8


def pass_bytes(N: int, K: int) -> int:
    """Bytes of a row of w one pass of the kernel reads: W warps x U chunks of 32 16-bit columns."""
    return warps(N, K) * chunks_per_pass(N, K) * 64


def tiles(N: int, swiglu: bool = False) -> int:
    """CTA tiles of w: TILE_N rows each; swiglu: TILE_N / 2 gate rows and their up rows (mma.cuh mma_rows)."""
    return -(-N // 2 // (TILE_N // 2)) if swiglu else -(-N // TILE_N)


def _output_shapes(ins):
    return [[*ins[0][:-1], ins[1][0]]]


def _check_shapes(d, attrs=None):
    x, w = (tuple(v) for v in d)
    need(len(w) == 2 and len(x) >= 1 and x[-1] == w[1], f"Gemv: x {x} [*,K] and w {w} [N,K] must share K")


def rows_of(x) -> int:
    """Rows of x [*, K]: the product of its leading dims."""
    rows = 1
    for v in x[:-1]:
        rows *= v
    return rows


def _check_kernel(d, dtypes):
    x, w = d
    check(rows_of(x), w[0], w[1], dtypes[0])


SPEC = OpSpec(
    name="Gemv",
    inputs=(Port("x", "x", "[*,K]"), Port("w", "x", "[N,K]")),
    outputs=(Port("y", "x", "[*,N]"),),
    attrs=(),
    groups={"x": DTYPES},
    output_shapes=_output_shapes, check_shapes=_check_shapes, check_kernel=_check_kernel,
    doc="x @ w.T for 1-16 rows of x (decode and verify projections)",
    cuda_defines={"GEMV_WARPS": WARPS, "GEMV_NARROW_WARPS": NARROW_WARPS, "BULK_RING_BYTES": BULK_RING_BYTES},
)
