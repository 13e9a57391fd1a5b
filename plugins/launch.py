"""Launchers for the plugin kernels: raw device pointers (ints) + a CUstream handle (int).

Used by the runtime commit path, by the torch custom ops (torch_ops.py) and by TensorRT plugin
``enqueue``. Every launcher validates head dims / dtypes / the device arch *before* launching and
raises ``KernelError`` (a ValueError) with a clear message. Index tensors (slot, n, block_table,
kv_start, kv_len, pos) are int32; a null pointer (0) for ``slot`` means "row b uses slot b".
Modules are NVRTC-compiled for the current device's exact arch (cubin) and cached per context.
"""
from __future__ import annotations

import ctypes
import os
import threading

from dflash_trt.plugins import nvrtc as _nv

DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}
MIN_ARCH = (8, 0)
GDN_DK = (64, 128)
ATTN_HD = (64, 128, 256)
CONV_MAX_W = 8
ATTN_NWARP, ATTN_KT = 8, 32

P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class KernelError(ValueError):
    """Unsupported shape / dtype / arch for a plugin kernel (raised before any launch)."""


def _cu():
    from cuda.bindings import driver
    return driver


def _ck(res, what):
    cu = _cu()
    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


_lock = threading.Lock()
_modules: dict = {}


def _context():
    """The current CUDA context; retains + sets device 0's primary context if none is current."""
    cu = _cu()
    _ck(cu.cuInit(0), "cuInit")
    ctx = _ck(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        dev = _ck(cu.cuDeviceGet(0), "cuDeviceGet")
        ctx = _ck(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def device_arch() -> tuple:
    cu = _cu()
    _context()
    dev = _ck(cu.cuCtxGetDevice(), "cuCtxGetDevice")
    A = cu.CUdevice_attribute
    major = _ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attr")
    minor = _ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attr")
    return int(major), int(minor)


def check_arch(arch) -> None:
    if tuple(arch) < MIN_ARCH:
        raise KernelError(f"dflash kernels need compute capability >= 8.0 (bf16 cvt); device is sm_{arch[0]}{arch[1]}")


def get_function(family: str, name: str):
    """CUfunction ``name`` from ``plugins/<family>.cu`` built for the current device."""
    ctx = _context()
    key = (int(ctx), family)
    with _lock:
        entry = _modules.get(key)
        if entry is None:
            arch = device_arch()
            check_arch(arch)
            image = _nv.compile_source(family, f"sm_{arch[0]}{arch[1]}")
            mod = _ck(_cu().cuModuleLoadData(image), f"cuModuleLoadData({family})")
            entry = _modules[key] = (mod, {})
        mod, funcs = entry
        fn = funcs.get(name)
        if fn is None:
            fn = funcs[name] = _ck(_cu().cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
            if family == "attention" and name.startswith("paged_attention"):
                hd = int(name.rsplit("hd", 1)[1])
                A = _cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _ck(_cu().cuFuncSetAttribute(fn, A, _attn_smem(hd)), "cuFuncSetAttribute")
        return fn


def _launch(fn, grid, block, smem, stream, args):
    cu = _cu()
    vals = tuple(int(a) if t in (P, I) else float(a) for a, t in args)
    types = tuple(t for _, t in args)
    _ck(cu.cuLaunchKernel(fn, *grid, *block, smem, cu.CUstream(int(stream)), (vals, types), 0), "cuLaunchKernel")


def _dt(name, what, allowed=tuple(DTYPES)):
    name = str(name).replace("torch.", "")
    if name not in allowed:
        raise KernelError(f"{what}: unsupported dtype {name}; supported: {', '.join(allowed)}")
    return DTYPES[name]


def _gdn_checks(B, T, Hk, Hv, dk, dv, cg):
    if dk not in GDN_DK:
        raise KernelError(f"gdn: unsupported key head dim dk={dk}; supported: {GDN_DK}")
    if dv % (32 * cg) or dv <= 0:
        raise KernelError(f"gdn: value head dim dv={dv} must be a positive multiple of {32 * cg}")
    if Hk <= 0 or Hv % Hk:
        raise KernelError(f"gdn: Hv={Hv} must be a multiple of Hk={Hk}")
    if B <= 0 or T <= 0:
        raise KernelError(f"gdn: need B >= 1 and T >= 1 (got B={B}, T={T})")


def _gdn_cg(B, Hv, dk, dv, cg, allowed):
    """Column-group factor: a CTA owns 32*cg state columns of one head. 0/None = auto: the largest
    allowed cg that still gives >= 256 CTAs (H200 measurements: cg1 best at B=1, cg4 at B=8 and 64
    on Qwen3-Next shapes); DFLASH_GDN_CG overrides."""
    if cg is None:
        cg = int(os.environ.get("DFLASH_GDN_CG", "0"))
    if cg not in (0, 1, 2, 4):
        raise KernelError(f"gdn: column-group factor cg={cg} must be 0 (auto), 1, 2 or 4")
    allowed = [c for c in allowed if c != 4 or dk == 128]
    if cg == 0:
        cg = next((c for c in sorted(allowed, reverse=True) if dv % (32 * c) == 0 and B * Hv * dv // (32 * c) >= 256), 1)
    while cg > 1 and (cg not in allowed or dv % (32 * cg)):
        cg //= 2
    return cg


def gdn_wy16(q, k, v, g, beta, state, slot, o, k_hat, v_new, gamma, state_out, *, B, T, Hk, Hv, dk, dv,
             in_dtype="bfloat16", gb_dtype="float32", o_dtype=None, state_dtype="float32", scale=None,
             out_by_slot=False, stream=0, cg=None):
    """GdnChunkWY16. q,k [B,T,Hk,dk], v [B,T,Hv,dv] (in_dtype); g,beta [B,T,Hv]; state fp32
    [*,Hv,dk,dv] (pool rows by slot[B] if slot else [B,...]; slot < 0 = zero state). Outputs: o
    [B,T,Hv,dv] (o_dtype), optional fold data (k_hat [B,T,Hk,dk], v_new, gamma; fp32) and optional
    final state (state_out, indexed by b, or by slot when out_by_slot)."""
    cg = _gdn_cg(B, Hv, dk, dv, cg, (1, 2, 4))
    _gdn_checks(B, T, Hk, Hv, dk, dv, cg)
    _dt(state_dtype, "gdn state", ("float32",))
    idt = _dt(in_dtype, "gdn q/k/v")
    gdt = _dt(gb_dtype, "gdn g/beta")
    odt = _dt(o_dtype or in_dtype, "gdn o")
    scale = dk ** -0.5 if scale is None else scale
    rows = 4 if T <= 4 else 8 if T <= 8 else 16  # chunk rows: the math is exact for any chunk <= 16
    fn = get_function("gdn", f"gdn_wy16_dk{dk}_cg{cg}_r{rows}")
    args = [(q, P), (k, P), (v, P), (idt, I), (g, P), (beta, P), (gdt, I), (state, P), (slot or 0, P),
            (o, P), (odt, I), (k_hat or 0, P), (v_new or 0, P), (gamma or 0, P), (state_out or 0, P),
            (int(bool(out_by_slot)), I), (T, I), (Hk, I), (Hv, I), (dv, I), (scale, F)]
    _launch(fn, (dv // (32 * cg), Hv, B), (dk * cg, 1, 1), 0, stream, args)


def gdn_fold(pool, slot, k_hat, v_new, gamma, n, *, B, T, Hk, Hv, dk, dv, state_dtype="float32", stream=0, cg=None):
    """In place: pool[slot[b]] <- state after the first n[b] rows (fold data from gdn_wy16)."""
    cg = _gdn_cg(B, Hv, dk, dv, cg, (1, 2))
    _gdn_checks(B, T, Hk, Hv, dk, dv, cg)
    _dt(state_dtype, "gdn state", ("float32",))
    fn = get_function("gdn", f"gdn_fold_dk{dk}_cg{cg}")
    args = [(pool, P), (slot or 0, P), (k_hat, P), (v_new, P), (gamma, P), (n, P), (T, I), (Hk, I), (Hv, I), (dv, I)]
    _launch(fn, (dv // (32 * cg), Hv, B), (dk * cg, 1, 1), 0, stream, args)


def _conv_checks(B, T, C, W):
    if not 2 <= W <= CONV_MAX_W:
        raise KernelError(f"conv: kernel width W={W} not in [2, {CONV_MAX_W}]")
    if B <= 0 or T <= 0 or C <= 0:
        raise KernelError(f"conv: need B, T, C >= 1 (got {B}, {T}, {C})")


def conv_verify(x, state, slot, weight, y, *, B, T, C, W, x_dtype="bfloat16", s_dtype="bfloat16",
                w_dtype="bfloat16", y_dtype=None, stream=0):
    """y [B,T,C] = silu(depthwise causal conv of [state | x]); state [*,C,W-1] read-only."""
    _conv_checks(B, T, C, W)
    args = [(x, P), (_dt(x_dtype, "conv x"), I), (state, P), (_dt(s_dtype, "conv state"), I), (slot or 0, P),
            (weight, P), (_dt(w_dtype, "conv weight"), I), (y, P), (_dt(y_dtype or x_dtype, "conv y"), I),
            (T, I), (C, I), (W, I)]
    _launch(get_function("conv", "conv_verify"), ((C + 127) // 128, B, 1), (128, 1, 1), 0, stream, args)


def conv_roll(pool, slot, x, n, *, B, T, C, W, s_dtype="bfloat16", x_dtype="bfloat16", stream=0):
    """In place: pool[slot[b]] <- last W-1 columns of [pool[slot[b]] | x_1..x_n[b]]."""
    _conv_checks(B, T, C, W)
    args = [(pool, P), (_dt(s_dtype, "conv state"), I), (slot or 0, P), (x, P), (_dt(x_dtype, "conv x"), I),
            (n, P), (T, I), (C, I), (W, I)]
    _launch(get_function("conv", "conv_roll"), ((C + 127) // 128, B, 1), (128, 1, 1), 0, stream, args)


def _attn_smem(hd):
    return (ATTN_NWARP * hd + 2 * ATTN_KT * (hd + 1)) * 4


def _attn_checks(B, T, Hq, Hkv, hd, block_size):
    if hd not in ATTN_HD:
        raise KernelError(f"paged_attention: unsupported head dim {hd}; supported: {ATTN_HD}")
    if Hkv <= 0 or Hq % Hkv:
        raise KernelError(f"paged_attention: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if B <= 0 or T <= 0 or block_size <= 0:
        raise KernelError(f"paged_attention: need B, T, block_size >= 1 (got {B}, {T}, {block_size})")


def paged_attention(q, k_new, v_new, pool, block_table, kv_start, kv_len, o, *, B, T, Hq, Hkv, hd, layer,
                    num_blocks, block_size, max_blocks, causal, scale, q_dtype="bfloat16", n_dtype=None,
                    p_dtype=None, o_dtype=None, stream=0):
    """o [B,T,Hq,hd] = attention of q over cached rows [kv_start, kv_len) in pages + T new rows."""
    _attn_checks(B, T, Hq, Hkv, hd, block_size)
    args = [(q, P), (_dt(q_dtype, "attn q"), I), (k_new, P), (v_new, P), (_dt(n_dtype or q_dtype, "attn k/v"), I),
            (pool, P), (_dt(p_dtype or q_dtype, "attn kv pool"), I), (layer, I), (num_blocks, I), (block_size, I),
            (block_table, P), (max_blocks, I), (kv_start, P), (kv_len, P), (o, P),
            (_dt(o_dtype or q_dtype, "attn o"), I), (T, I), (Hq, I), (Hkv, I), (int(bool(causal)), I), (scale, F)]
    G = Hq // Hkv
    grid = ((G * T + ATTN_NWARP - 1) // ATTN_NWARP, Hkv, B)
    _launch(get_function("attention", f"paged_attention_hd{hd}"), grid, (ATTN_NWARP * 32, 1, 1), _attn_smem(hd),
            stream, args)


def kv_write(pool, block_table, k_new, v_new, pos, n, *, B, T, Hkv, hd, layer, num_blocks, block_size, max_blocks,
             p_dtype="bfloat16", n_dtype=None, stream=0):
    """In place: rows t < n[b] of k_new/v_new [B,T,Hkv,hd] -> pages at logical rows pos[b] + t."""
    if hd <= 0 or Hkv <= 0 or B <= 0 or T <= 0 or block_size <= 0:
        raise KernelError(f"kv_write: bad shape B={B} T={T} Hkv={Hkv} hd={hd} block_size={block_size}")
    args = [(pool, P), (_dt(p_dtype, "kv pool"), I), (layer, I), (num_blocks, I), (block_size, I), (block_table, P),
            (max_blocks, I), (k_new, P), (v_new, P), (_dt(n_dtype or p_dtype, "kv rows"), I), (pos, P), (n, P),
            (T, I), (Hkv, I), (hd, I)]
    _launch(get_function("attention", "kv_write"), (T * Hkv, B, 1), (128, 1, 1), 0, stream, args)
