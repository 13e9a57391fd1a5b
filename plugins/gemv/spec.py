"""The spec of the GEMV of decode steps (a torch-only op: exported graphs keep MatMul). Math: reference.py.

gemv(x [*, K], w [N, K], fp32_out) -> y [*, N] = x @ w.T, fp32 accumulation, y in x's dtype or fp32 (fp32_out: logits);
x has one row (MAX_ROWS).
Why our own kernel: at one row a projection is a pure weight stream, and cuBLAS's kernels for these
shapes read the weights at 40-80% of the copy bandwidth on the H200 (a [1 x 4096] x [4096 x 2048] bf16 out_proj:
~10 us for 16.8 MB). kernel.cu keeps 8-16 loads of 16 bytes in flight per lane instead. At four rows the same
kernel measured slower than cuBLAS (12352 x 2048: 21.7 vs 15.7 us), so more rows stay cuBLAS.
"""
from __future__ import annotations

from dflash_trt.plugins.opspec import OpSpec, Port, kernel_need, need

MAX_ROWS = 1        # rows of x per call; more rows go to cuBLAS
CHUNK = 8           # 16-bit elements per 16-byte load: K must be a multiple
MAX_K = 16384       # x is staged in shared memory: MAX_ROWS * MAX_K * 2 bytes
WARPS = 8           # warps per CTA
ROWS_PER_WARP = 2   # weight rows a warp streams together
DTYPES = ("bfloat16", "float16")


def usable(rows: int, K: int, dtype: str) -> bool:
    """Whether the kernel takes this call (the dispatcher's test: otherwise cuBLAS)."""
    return 1 <= rows <= MAX_ROWS and K % CHUNK == 0 and 0 < K <= MAX_K and dtype in DTYPES


def check(rows: int, N: int, K: int, dtype: str) -> None:
    kernel_need(usable(rows, K, dtype) and N >= 1,
                f"gemv: needs {MAX_ROWS} row of x, K a multiple of {CHUNK} up to {MAX_K}, N >= 1 and a 16-bit dtype "
                f"(got rows={rows}, N={N}, K={K}, {dtype})")


def kernel_name(rows: int, K: int, dtype: str) -> str:
    """The kernel.cu entry: 16 loads a lane per row when K > 2048, else 8."""
    return f"gemv_u{16 if K > 2048 else 8}_{'bf16' if dtype == 'bfloat16' else 'f16'}"


def smem_bytes(rows: int, K: int) -> int:
    return rows * K * 2



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
    doc="x @ w.T for one row of x (decode-step projections)",
    cuda_defines={"GEMV_WARPS": WARPS, "GEMV_RPW": ROWS_PER_WARP},
)
