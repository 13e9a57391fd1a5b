"""Launchers of the GDN kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int).

Used by the torch ops (torch_op.py), the TensorRT plugin (trt_plugin.py) and tools/bench_kernels.py.
Every check reads spec.py and runs before any launch (KernelError). Index tensors (slot, n) are int32;
a null pointer (0) for ``slot`` means "row b uses slot b".
"""
from __future__ import annotations

import os

from dflash_trt.plugins.cuda_launch import F, I, P, get_function, launch
from dflash_trt.plugins.gdn import spec
from dflash_trt.plugins.opspec import KernelError, dtype_code, kernel_need

MAX_GRID_Z = 65535


def _gdn_cg(B, Hv, dk, dv, cg, allowed, variants=spec.WY16_CG):
    """Column-group factor: a CTA owns 32*cg state columns of one head; `variants` (dk -> cgs) are the
    instantiated kernels. 0/None = auto: the largest allowed cg that still gives >= spec.AUTO_CG_MIN_CTAS
    CTAs; DFLASH_GDN_CG overrides; a cg the shape cannot use is halved."""
    if cg is None:
        cg = int(os.environ.get("DFLASH_GDN_CG", "0"))
    if cg not in (0, 1, 2, 4):
        raise KernelError(f"gdn: column-group factor cg={cg} must be 0 (auto), 1, 2 or 4")
    allowed = [c for c in allowed if c in variants.get(dk, (1,))]
    if cg == 0:
        cg = next((c for c in sorted(allowed, reverse=True)
                   if dv % (32 * c) == 0 and B * Hv * dv // (32 * c) >= spec.AUTO_CG_MIN_CTAS), 1)
    while cg > 1 and (cg not in allowed or dv % (32 * cg)):
        cg //= 2
    return cg


def _gdn_rpt(ctas: int, cg: int, dk: int = 128) -> int:
    """State rows per thread: spec.auto_rpt of the grid and dk at cg 1 (DFLASH_GDN_RPT overrides); 32 at cg > 1 (a wide
    grid: only that form is instantiated there)."""
    if cg > 1:
        return 32
    rpt = int(os.environ.get("DFLASH_GDN_RPT", "0"))
    if rpt and rpt not in spec.WY16_RPT:
        raise KernelError(f"gdn: DFLASH_GDN_RPT={rpt} must be one of {spec.WY16_RPT} (state rows per thread)")
    return rpt or spec.auto_rpt(ctas, dk)


def _row_codes(state_dtype, in_dtype, gb_dtype, o_dtype, p_dtype, A_log, dt_bias) -> tuple:
    """The dtype codes (q/k/v, g/beta, o, A_log/dt_bias) of a gdn_wy16 / gdn_decode call, its state dtype checked."""
    dtype_code(state_dtype, "gdn state", spec.STATE_DTYPES)
    kernel_need(bool(A_log) == bool(dt_bias), "gdn: A_log and dt_bias come together (in-kernel gates) or not at all")
    return (dtype_code(in_dtype, "gdn q/k/v"), dtype_code(gb_dtype, "gdn g/beta"),
            dtype_code(o_dtype or in_dtype, "gdn o"), dtype_code(p_dtype, "gdn A_log/dt_bias"))


def _row_strides(rs_qk, rs_v, rs_gb, Hk, Hv, dk, dv) -> tuple:
    """Elements between (b, t) rows of q/k, v and g/beta (None: packed), none narrower than a row."""
    rs_qk, rs_v, rs_gb = rs_qk or Hk * dk, rs_v or Hv * dv, rs_gb or Hv
    kernel_need(rs_qk >= Hk * dk and rs_v >= Hv * dv and rs_gb >= Hv,
                f"gdn: row strides ({rs_qk}, {rs_v}, {rs_gb}) narrower than a row ({Hk * dk}, {Hv * dv}, {Hv})")
    return rs_qk, rs_v, rs_gb


def gdn_wy16(q, k, v, g, beta, state, slot, o, k_hat, v_f, g_f, b_f, state_out, *, B, T, Hk, Hv, dk, dv,
             in_dtype="bfloat16", gb_dtype="float32", o_dtype=None, state_dtype="float32", scale=None,
             stream=0, cg=None, rs_qk=None, rs_v=None, rs_gb=None, A_log=0, dt_bias=0, p_dtype="float32"):
    """GdnChunkWY16. q,k [B,T,Hk,dk], v [B,T,Hv,dv] (in_dtype); g,beta [B,T,Hv]; state fp32
    [*,Hv,dk,dv] (pool rows by slot[B] if slot else [B,...]; slot < 0 = zero state). Outputs: o
    [B,T,Hv,dv] (o_dtype), optional fold data (k_hat [B,T,Hk,dk], v_f [B,T,Hv,dv], g_f, b_f [B,T,Hv]: fp32,
    the gates computed when A_log is given; all or none) and optional
    final state (state_out [B,Hv,dk,dv], indexed by b).
    rs_qk / rs_v / rs_gb: elements between consecutive (b, t) rows of q and k / v / g and beta (each row packed;
    None: contiguous). q and k at a wider stride must be 16-byte aligned (the kernel's vector loads).
    A_log, dt_bias [Hv] (p_dtype; both or neither): g and beta are the raw gate columns a, b and the kernel computes
    the gates (reference.gdn_gates)."""
    cg = _gdn_cg(B, Hv, dk, dv, cg, (1, 2, 4))
    spec.check_dims(B, T, Hk, Hv, dk, dv, cg)
    idt, gdt, odt, pdt = _row_codes(state_dtype, in_dtype, gb_dtype, o_dtype, p_dtype, A_log, dt_bias)
    kernel_need(bool(k_hat) == bool(v_f) == bool(g_f) == bool(b_f), "gdn: the fold data outputs come all or none")
    scale = dk ** -0.5 if scale is None else scale
    rs_qk, rs_v, rs_gb = _row_strides(rs_qk, rs_v, rs_gb, Hk, Hv, dk, dv)
    ctas = dv // (32 * cg) * Hv * B
    rpt = _gdn_rpt(ctas, cg, dk)
    smem = spec.wy16_dyn_smem(dk, cg, rpt, T)
    fn = get_function("gdn", spec.wy16_name(dk, cg, rpt, T), max_dynamic_smem=smem)
    args = [(q, P), (k, P), (v, P), (idt, I), (g, P), (beta, P), (gdt, I), (A_log, P), (dt_bias, P), (pdt, I),
            (state, P), (slot or 0, P),
            (o, P), (odt, I), (k_hat or 0, P), (v_f or 0, P), (g_f or 0, P), (b_f or 0, P), (state_out or 0, P),
            (T, I), (Hk, I), (Hv, I), (dv, I), (scale, F), (rs_qk, I), (rs_v, I), (rs_gb, I)]
    launch(fn, (dv // (32 * cg), Hv, B), (32 * (dk // rpt) * cg, 1, 1), smem, stream, args, pdl=True)


def gdn_fold(pool, slot, k_hat, v, g, beta, n, *, B, T, Hk, Hv, dk, dv, L=1, num_slots=0,
             state_dtype="float32", stream=0, cg=None):
    """In place, all L layers in one launch: pool[l, slot[b]] <- state after the first n[b] rows, one at a time.
    pool [L,num_slots,Hv,dk,dv] fp32; fold data (from gdn_wy16) [L,B,T,...] fp32; n, slot [B] on the device."""
    cg = _gdn_cg(B, Hv, dk, dv, cg, (1, 2, 4), spec.FOLD_CG)
    spec.check_dims(B, T, Hk, Hv, dk, dv, cg)
    dtype_code(state_dtype, "gdn state", spec.STATE_DTYPES)
    kernel_need(L >= 1 and (L == 1 or num_slots >= 1), f"gdn_fold: need L >= 1 and num_slots >= 1 (L={L}, "
                f"num_slots={num_slots})")
    kernel_need(L * B <= MAX_GRID_Z, f"gdn_fold: L*B = {L * B} exceeds the grid limit {MAX_GRID_Z}")
    fn = get_function("gdn", f"gdn_fold_dk{dk}_cg{cg}")
    args = [(pool, P), (slot or 0, P), (k_hat, P), (v, P), (g, P), (beta, P), (n, P), (B, I), (num_slots, I), (T, I),
            (Hk, I), (Hv, I), (dv, I)]
    launch(fn, (dv // (32 * cg), Hv, L * B), (dk * cg, 1, 1), 0, stream, args, pdl=True)


def gdn_decode(q, k, v, g, beta, pool, slot, n, o, *, B, Hk, Hv, dk, dv, num_slots, in_dtype="bfloat16",
               gb_dtype="float32", o_dtype=None, state_dtype="float32", scale=None, stream=0, cg=None, rs_qk=None,
               rs_v=None, rs_gb=None, A_log=0, dt_bias=0, p_dtype="float32"):
    """GdnChunkWY16 at T = 1 that commits its row in place (decode.cuh): o [B,1,Hv,dv] as gdn_wy16's; pool (one
    layer, [num_slots,Hv,dk,dv] fp32) rows slot[b] <- the state gdn_fold of the row leaves, where n[b] > 0 and
    slot[b] >= 0 (slot < 0: a zero state, nothing written). q, k [B,1,Hk,dk], v [B,1,Hv,dv], g, beta [B,1,Hv], row
    strides and in-kernel gates as gdn_wy16's; slot and n [B] int32 on the device."""
    cg = _gdn_cg(B, Hv, dk, dv, cg, (1, 2), spec.DECODE_CG)
    spec.check_dims(B, 1, Hk, Hv, dk, dv, cg)
    idt, gdt, odt, pdt = _row_codes(state_dtype, in_dtype, gb_dtype, o_dtype, p_dtype, A_log, dt_bias)
    kernel_need(num_slots >= 1 and bool(n), f"gdn_decode: need a pool of >= 1 slot and n (num_slots={num_slots})")
    kernel_need(B <= MAX_GRID_Z, f"gdn_decode: B = {B} exceeds the grid limit {MAX_GRID_Z}")
    scale = dk ** -0.5 if scale is None else scale
    rs_qk, rs_v, rs_gb = _row_strides(rs_qk, rs_v, rs_gb, Hk, Hv, dk, dv)
    fn = get_function("gdn", f"gdn_decode_dk{dk}_cg{cg}")
    args = [(q, P), (k, P), (v, P), (idt, I), (g, P), (beta, P), (gdt, I), (A_log, P), (dt_bias, P), (pdt, I),
            (pool, P), (slot or 0, P), (n, P), (o, P), (odt, I), (Hk, I), (Hv, I), (dv, I), (scale, F), (rs_qk, I),
            (rs_v, I), (rs_gb, I)]
    launch(fn, (dv // (32 * cg), Hv, B), (dk * cg, 1, 1), 0, stream, args, pdl=True)
