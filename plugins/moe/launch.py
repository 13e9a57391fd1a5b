"""Launchers of the MoE kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int).

One call = four launches on `stream` with grids fixed by the shapes alone (CUDA-graph safe, no host sync):
plan (1 CTA) -> gate_up (I/16 x M) -> down (H/32 x M) -> combine (H/256 x N), M = min(E, N*k) expert slots
of which the unused ones exit at once. Workspace (caller-allocated): plan ints [3M + P], h [P, I] in x's dtype
(fp32 for fp32), y_pair [P, H] fp32, P = N*k. The router's top-k (moe_route) is one launch of N CTAs, no
workspace. Every check reads spec.py and runs before any launch.
"""
from __future__ import annotations

from dflash_trt.plugins.cuda_launch import I as INT, P, get_function, launch
from dflash_trt.plugins.gemv import spec as gemv_spec
from dflash_trt.plugins.moe import spec
from dflash_trt.plugins.opspec import dtype_code, dtype_name, kernel_need

_SUFFIX = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def slots(N: int, k: int, E: int) -> int:
    """Expert slots of the GEMM grids: at most one per (token, k) pair and one per expert."""
    return min(E, N * k)


def workspace_ints(N: int, k: int, E: int) -> int:
    return 3 * slots(N, k, E) + N * k


def moe_experts(x, topk_idx, topk_w, gate_up, down, out, plan, h, y_pair, *, N, k, E, H, I,  # noqa: E741
                dtype="bfloat16", idx_dtype="int64", w_dtype="bfloat16", stream=0, scales=None):
    """out [N,H] <- MoeExperts(x, topk_idx, topk_w, gate_up, down); all contiguous, weights in x's dtype, or with
    scales = (gate_up scale, down scale) e4m3 weights and their fp32 128x128 block scales (W8A16, x 16-bit)."""
    spec.check_dims(N, k, E, H, I)
    if scales is not None:
        spec.check_fp8(H, I, dtype_name(dtype))
    dt, wdt, idx64 = _codes(dtype, w_dtype, idx_dtype)
    M, Pn = slots(N, k, E), N * k
    act_e, act_off, act_cnt, entries = plan, plan + 4 * M, plan + 8 * M, plan + 12 * M  # int32 byte offsets
    plan_args = [(act_e, P), (act_off, P), (act_cnt, P), (entries, P)]
    launch(get_function("moe", "moe_plan"), (1, 1, 1), (spec.PLAN_THREADS, 1, 1), 8 * E, stream,
           [(topk_idx, P), (idx64, INT), (Pn, INT), (E, INT), (M, INT), *plan_args])
    sfx = ("fp8_" if scales is not None else "") + _SUFFIX[dtype_name(dtype)]
    gu_w, dn_w = ([(gate_up, P)], [(down, P)]) if scales is None else \
        ([(gate_up, P), (scales[0], P)], [(down, P), (scales[1], P)])
    block = (spec.WARPS * 32, 1, 1)
    launch(get_function("moe", f"moe_gate_up_{sfx}"), (I // 16, M, 1), block, 0, stream,
           [*gu_w, (x, P), (H, INT), (I, INT), (k, INT), *plan_args, (h, P)])
    launch(get_function("moe", f"moe_down_{sfx}"), (H // spec.ROWS, M, 1), block, 0, stream,
           [*dn_w, (h, P), (H, INT), (I, INT), (k, INT), *plan_args, (y_pair, P)])
    _combine(y_pair, topk_idx, idx64, topk_w, wdt, out, dt, N=N, k=k, E=E, H=H, stream=stream)


DEC_ROWS = 8  # rows of y per moe_dec_down CTA (decode.cuh)


DEC_SMEM = 48 * 1024  # moe_dec_down's dynamic shared memory stays within the default limit


def decode_smem(k: int, I: int) -> int:  # noqa: E741
    """moe_dec_down's dynamic shared memory for k pairs a token: h [k, I] 16-bit + partial sums [k, DEC_ROWS]
    fp32 (k + 1 with a shared expert)."""
    return k * I * 2 + k * DEC_ROWS * 4


def takes_decode_path(N: int, k: int, I: int, dtype: str, shared: bool = False) -> bool:  # noqa: E741
    """Whether moe_experts_decode runs this call (the torch op's choice; otherwise the grouped path). shared: a
    shared expert fused in (one more pair a token)."""
    return (N <= spec.DECODE_TOKENS and str(dtype) in ("bfloat16", "float16")
            and decode_smem(k + int(shared), I) <= DEC_SMEM)


def _codes(dtype, w_dtype, idx_dtype):
    """(x dtype code, topk_w dtype code, idx64) of one moe_experts call; KernelError for a bad index dtype."""
    kernel_need(dtype_name(idx_dtype) in ("int32", "int64"),
                f"moe_experts: topk_idx must be int32 or int64, got {idx_dtype}")
    return (dtype_code(dtype, "moe_experts x / weights"), dtype_code(w_dtype, "moe_experts topk_w"),
            int(dtype_name(idx_dtype) == "int64"))


def moe_experts_decode(x, topk_idx, topk_w, gate_up, down, out, h, *, N, k, E, H, I,  # noqa: E741
                       dtype="bfloat16", idx_dtype="int64", w_dtype="bfloat16", stream=0, scales=None, shared=None):
    """The decode path of moe_experts (spec.DECODE_TOKENS, decode.cuh): two launches, no plan. Workspace: h
    [N*k, I] in x's dtype ([N*(k+1), I] with a shared expert). scales: as moe_experts (e4m3 weights, W8A16).
    shared: (gate_up [2I, H], down [H, I], gate logit pointer in x's dtype, its row stride in elements) of a
    shared expert added as y += sigmoid(logit) * expert(x), plus (gate_up scale, down scale) with scales."""
    spec.check_dims(N, k, E, H, I)
    w8, sh = scales is not None, shared is not None
    kernel_need(takes_decode_path(N, k, I, dtype, sh),
                f"moe_experts decode path: at most {spec.DECODE_TOKENS} tokens of a 16-bit dtype and "
                f"{DEC_SMEM} bytes of shared memory (got N={N}, {dtype}, k={k}, I={I}"
                f"{', a shared expert' if sh else ''}: {decode_smem(k + sh, I)})")
    if w8:
        spec.check_fp8(H, I, dtype_name(dtype))
    dt, wdt, idx64 = _codes(dtype, w_dtype, idx_dtype)
    sfx, block = ("fp8_" if w8 else "") + _SUFFIX[dtype], (gemv_spec.WARPS * 32, 1, 1)
    sgu, sdn, logit, stride, *sscales = shared if sh else (0, 0, 0, 0)
    (gs, ds), (sgs, sds) = scales or (0, 0), sscales or (0, 0)

    def weight(w, s):  # FP8 entries take each weight's scale after it
        return [(w, P), (s, P)] if w8 else [(w, P)]

    launch(get_function("moe", f"moe_dec_gate_up_{sfx}"), (I // gemv_spec.WARPS, N * (k + sh), 1), block, 2 * H,
           stream, [*weight(gate_up, gs), (x, P), (topk_idx, P), (idx64, INT), (N, INT), (k, INT), (E, INT), (H, INT),
                    (I, INT), (h, P), *weight(sgu, sgs)])
    launch(get_function("moe", f"moe_dec_down_{sfx}"), (-(-H // DEC_ROWS), N, 1), block, decode_smem(k + sh, I),
           stream, [*weight(down, ds), (h, P), (topk_idx, P), (idx64, INT), (topk_w, P), (wdt, INT), (N, INT),
                    (k, INT), (E, INT), (H, INT), (I, INT), (out, P), (dt, INT), *weight(sdn, sds), (logit, P),
                    (stride, INT)])


def _combine(y_pair, topk_idx, idx64, topk_w, wdt, out, dt, *, N, k, E, H, stream):
    launch(get_function("moe", "moe_combine"), ((H + 255) // 256, N, 1), (256, 1, 1), 0, stream,
           [(y_pair, P), (topk_idx, P), (idx64, INT), (topk_w, P), (wdt, INT), (H, INT), (k, INT), (E, INT), (out, P), (dt, INT)])


def moe_route(logits, idx, w, *, N, E, k, norm, l_dtype, w_dtype, stream=0):
    """idx [N,k] int64, w [N,k] <- reference.route(logits [N,E], k, norm); all contiguous."""
    spec.check_route(N, E, k)
    ldt = dtype_code(l_dtype, "moe_route logits")
    wdt = dtype_code(w_dtype, "moe_route topk_w")
    launch(get_function("moe", "moe_route"), (N, 1, 1), (spec.route_threads(E), 1, 1), 4 * (E + k), stream,
           [(logits, P), (ldt, INT), (N, INT), (E, INT), (k, INT), (int(bool(norm)), INT), (idx, P), (w, P),
            (wdt, INT)])
