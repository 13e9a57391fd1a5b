"""The spec of MoeExperts: the routed SwiGLU experts of a sparse MoE block, given the routing. Math: reference.py.

MoeExperts(x, topk_idx, topk_w, gate_up, down) -> y
  x [N,H] (float dtype); topk_idx [N,k] int32/int64 expert ids (distinct per row; ids outside [0,E) drop the pair);
  topk_w [N,k] float routing weights; gate_up [E,2I,H] (gate rows first), down [E,H,I] in x's dtype.
  y[n] = sum_j topk_w[n,j] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])), e = topk_idx[n,j]; y in x's dtype.
Under ONNX export it is one `dflash::MoeExperts` node whose function body (onnx_body.py) is the dense combine, so
ORT runs it anywhere; TensorRT runs the plugin (trt_plugin.py: these kernels, scratch in its workspace).

The CUDA kernels (kernel.cu), all launched on one stream, static grids (CUDA-graph safe, no host sync):
  moe_plan       one CTA: per-expert counts -> offsets, the list of active experts (slot j -> expert, offset,
                 count; count 0 for slots past the active ones) and the (token, k) pairs grouped by expert.
  moe_gate_up_*  grid (I/16, M = min(E, N*k)): CTA (i-tile, slot j) streams its 16 gate + 16 up rows of expert
                 act_e[j] once and applies them to every pair routed there (tensor-core mma for bf16/fp16,
                 fp32 FMA for fp32); h = silu(g)*u in x's dtype. Empty slots exit at once.
  moe_down_*     grid (H/32, M): the same over down rows -> y_pair [N*k, H] fp32.
  moe_combine    y[n] = sum_j topk_w[n,j] y_pair[n*k+j] in a fixed order (deterministic, no atomics).
The router's top-k (modeling/mlp.py SparseMoE.route, the torch op dflash::moe_route; not part of this node) has one
kernel here too: moe_route, one CTA per token row: softmax in fp32, k rounds of a block-wide argmax, renormalise
(math: reference.route).
"""
from __future__ import annotations

from dflash_trt.plugins.gemv import spec as gemv_spec
from dflash_trt.plugins.gemv_fp8 import spec as gemv_fp8_spec
from dflash_trt.plugins.opspec import FLOATS, INTS, OpSpec, Port, check_float_dtypes, kernel_need, need

# kernel limits (kernel.cu reads the -D macros; launch.py these)
WARPS = 8          # warps per GEMM CTA: split the reduction dim K between them, then reduce in shared memory
ROWS = 32          # weight rows per GEMM CTA (two 16-row mma tiles)
PASS_TOKENS = 32   # pairs per pass of a CTA (four 8-column mma tiles); more re-read its rows
MAX_EXPERTS = 4096  # moe_plan: two ints per expert, moe_route: E + k floats, in smem
K_ALIGN = 32       # H and I must be multiples of this (32-column chunks of the mma k loop)
PLAN_THREADS = 1024
DECODE_ROWS_PER_WARP = 2  # gemv/rows.cuh: weight rows a warp of the decode path streams together
DECODE_TOKENS = 4   # at most this many tokens (16-bit): the per-pair GEMV path of decode.cuh
ROUTE_THREADS = 256  # moe_route's CTA (fewer, a multiple of 32, for a small E); docs/PERF.md


def check_dims(N, k, E, H, I) -> None:  # noqa: E741
    kernel_need(N >= 1 and k >= 1, f"moe_experts: need N >= 1 tokens and top_k >= 1 (got N={N}, k={k})")
    kernel_need(1 <= E <= MAX_EXPERTS, f"moe_experts: {E} experts; the kernel takes 1..{MAX_EXPERTS}")
    kernel_need(H % K_ALIGN == 0 and I % K_ALIGN == 0 and H > 0 and I > 0,
                f"moe_experts: hidden {H} and expert intermediate {I} must be positive multiples of {K_ALIGN}")


FP8_BLOCK = gemv_fp8_spec.BLOCK  # the FP8 experts' scale blocks (rows x columns): Qwen's release layout


def check_fp8(H, I, dtype) -> None:  # noqa: E741
    """The FP8 (W8A16) experts kernels: 16-bit activations, H and I whole 128-blocks (an up row block then starts
    where the gate's end, and a 32-column chunk never straddles two scale blocks)."""
    kernel_need(str(dtype) in ("bfloat16", "float16"), f"moe_experts_fp8: activations must be bf16 or f16, got {dtype}")
    kernel_need(H % FP8_BLOCK == 0 and I % FP8_BLOCK == 0,
                f"moe_experts_fp8: hidden {H} and expert intermediate {I} must be multiples of {FP8_BLOCK}")


def check_route(N, E, k) -> None:
    kernel_need(N >= 1, f"moe_route: need N >= 1 token rows (got N={N})")
    kernel_need(1 <= E <= MAX_EXPERTS, f"moe_route: {E} experts; the kernel takes 1..{MAX_EXPERTS}")
    kernel_need(1 <= k <= E, f"moe_route: top_k {k} must be in 1..{E} (the number of experts)")


def route_threads(E: int) -> int:
    """moe_route's CTA size: one thread per expert up to ROUTE_THREADS, whole warps."""
    return min(ROUTE_THREADS, 32 * -(-E // 32))


def _output_shapes(ins):
    return [list(ins[0])]


def _check_shapes(d, attrs=None):
    x, idx, w, gu, dn = (tuple(s) for s in d)
    need(len(x) == 2, f"MoeExperts: x {x} must be [N,H]")
    need(len(idx) == 2 and idx[0] == x[0] and w == idx, f"MoeExperts: topk_idx {idx} and topk_w {w} must be [N={x[0]},k]")
    need(len(gu) == 3 and gu[2] == x[1] and gu[1] % 2 == 0, f"MoeExperts: gate_up {gu} must be [E,2I,H={x[1]}]")
    need(dn == (gu[0], x[1], gu[1] // 2), f"MoeExperts: down {dn} must be [E,H,I] = {(gu[0], x[1], gu[1] // 2)}")


def _check_kernel(d, dtypes):
    check_float_dtypes("MoeExperts", [dtypes[0], dtypes[2], dtypes[3], dtypes[4]])
    (N, H), (_, k), (E, I2, _) = d[0], d[1], d[3]
    check_dims(N, k, E, H, I2 // 2)


SPEC = OpSpec(
    name="MoeExperts",
    inputs=(Port("x", "x", "[N,H]"), Port("topk_idx", "i", "[N,k]"), Port("topk_w", "w", "[N,k]"),
            Port("gate_up", "x", "[E,2I,H]"), Port("down", "x", "[E,H,I]")),
    outputs=(Port("y", "x", "[N,H]"),),
    attrs=(),
    groups={"x": FLOATS, "i": INTS, "w": FLOATS},
    output_shapes=_output_shapes, check_shapes=_check_shapes, check_kernel=_check_kernel,
    doc="routed SwiGLU experts as a grouped GEMM (each selected expert's weights read once per call)",
    cuda_defines={"MOE_WARPS": WARPS, "MOE_PASS": PASS_TOKENS, "MOE_ROUTE_THREADS": ROUTE_THREADS,
                  "GEMV_WARPS": gemv_spec.WARPS, "GEMV_RPW": DECODE_ROWS_PER_WARP},
)
