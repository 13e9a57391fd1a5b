"""Implementation of the dflash:: torch custom ops (import dflash_trt.plugins.torch_ops, not this module).
CUDA impl -> our NVRTC kernels (launch.py) on torch's current stream; CPU impl -> the reference math (export/gdn_ref.py, export/attention_ref.py).

Ops (index tensors may be int32 or int64; ``slot`` None means row b uses pool row b):
  gdn_wy16(q, k, v, g, beta, state, slot, scale, output_state) -> (o, k_hat, v_new, gamma, final_state)
      final_state is [B,Hv,dk,dv] when output_state else an empty [0] tensor; slot < 0 = zero state.
  gdn_fold(pool!, slot, k_hat, v_new, gamma, n)             in place, n[b] = 0 allowed
  conv_verify(x, conv_state, weight, slot) -> y
  conv_roll(pool!, slot, x, n)                              in place
  paged_attention(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale) -> o
  kv_write(kv_pool!, layer, k_new, v_new, block_table, pos, n)   in place
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from dflash_trt.export import attention_ref, gdn_ref

from dflash_trt.plugins import launch


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _i32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(torch.int32).contiguous()


def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _dn(t: Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _sdt(state: Tensor):
    return torch.float64 if state.dtype == torch.float64 else torch.float32


def _gather(pool: Tensor, slot: Optional[Tensor], B: int) -> Tensor:
    if slot is None:
        return pool[:B]
    s = slot.long()
    out = pool[s.clamp(min=0)].clone()
    out[s < 0] = 0
    return out


# ---------------------------------------------------------------------------------------- GDN
@torch.library.custom_op("dflash::gdn_wy16", mutates_args=())
def gdn_wy16(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slot: Optional[Tensor] = None,
             scale: Optional[float] = None, output_state: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    raise NotImplementedError("dflash::gdn_wy16: no kernel for this device")


@gdn_wy16.register_kernel("cpu")
def _gdn_wy16_cpu(q, k, v, g, beta, state, slot=None, scale=None, output_state=False):
    r = gdn_ref.gdn_chunk_wy16(q, k, v, g, beta, _gather(state, slot, q.shape[0]), scale=scale)
    dt = _sdt(state)
    fs = r.state.to(dt) if output_state else state.new_empty(0, dtype=dt)
    return r.o.clone(), r.k_hat.to(dt), r.v_new.to(dt), r.gamma.to(dt), fs


@gdn_wy16.register_kernel("cuda")
def _gdn_wy16_cuda(q, k, v, g, beta, state, slot=None, scale=None, output_state=False):
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    q, k, v, g, beta, state = (t.contiguous() for t in (q, k, v, g, beta, state))
    if not (q.dtype == k.dtype == v.dtype):
        raise launch.KernelError(f"gdn_wy16: q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if g.dtype != beta.dtype:
        raise launch.KernelError(f"gdn_wy16: g/beta dtypes differ ({g.dtype}, {beta.dtype})")
    slot = _i32(slot)
    f32 = dict(device=q.device, dtype=torch.float32)
    o = torch.empty(B, T, Hv, dv, device=q.device, dtype=q.dtype)
    k_hat = torch.empty(B, T, Hk, dk, **f32)
    v_new = torch.empty(B, T, Hv, dv, **f32)
    gamma = torch.empty(B, T, Hv, **f32)
    fs = torch.empty(B, Hv, dk, dv, **f32) if output_state else torch.empty(0, **f32)
    launch.gdn_wy16(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(),
                    _ptr(slot), o.data_ptr(), k_hat.data_ptr(), v_new.data_ptr(), gamma.data_ptr(),
                    fs.data_ptr() if output_state else 0, B=B, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv,
                    in_dtype=_dn(q), gb_dtype=_dn(g), o_dtype=_dn(o), state_dtype=_dn(state), scale=scale,
                    stream=_stream(q))
    return o, k_hat, v_new, gamma, fs


@gdn_wy16.register_fake
def _gdn_wy16_fake(q, k, v, g, beta, state, slot=None, scale=None, output_state=False):
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    dt = _sdt(state)
    fs = q.new_empty(B, Hv, dk, dv, dtype=dt) if output_state else q.new_empty(0, dtype=dt)
    return (q.new_empty(B, T, Hv, dv), q.new_empty(B, T, Hk, dk, dtype=dt), q.new_empty(B, T, Hv, dv, dtype=dt),
            q.new_empty(B, T, Hv, dtype=dt), fs)


@torch.library.custom_op("dflash::gdn_fold", mutates_args=("pool",))
def gdn_fold(pool: Tensor, slot: Optional[Tensor], k_hat: Tensor, v_new: Tensor, gamma: Tensor, n: Tensor) -> None:
    raise NotImplementedError("dflash::gdn_fold: no kernel for this device")


@gdn_fold.register_kernel("cpu")
def _gdn_fold_cpu(pool, slot, k_hat, v_new, gamma, n):
    B, T = v_new.shape[:2]
    idx = torch.arange(B) if slot is None else slot.long().cpu()
    nn = n.long().cpu().clamp(0, T)
    keep = (nn > 0) & (idx >= 0)
    if not bool(keep.any()):
        return
    new = gdn_ref.gdn_fold(_gather(pool, slot, B), k_hat, v_new, gamma, nn)
    pool[idx[keep]] = new[keep].to(pool.dtype)


@gdn_fold.register_kernel("cuda")
def _gdn_fold_cuda(pool, slot, k_hat, v_new, gamma, n):
    B, T, Hk, dk = k_hat.shape
    Hv, dv = v_new.shape[2], v_new.shape[3]
    if not pool.is_contiguous():
        raise launch.KernelError("gdn_fold: state pool must be contiguous (updated in place)")
    for name, t in (("k_hat", k_hat), ("v_new", v_new), ("gamma", gamma)):
        if t.dtype != torch.float32:
            raise launch.KernelError(f"gdn_fold: {name} must be float32, got {t.dtype}")
    k_hat, v_new, gamma = k_hat.contiguous(), v_new.contiguous(), gamma.contiguous()
    slot, n = _i32(slot), _i32(n)
    launch.gdn_fold(pool.data_ptr(), _ptr(slot), k_hat.data_ptr(), v_new.data_ptr(), gamma.data_ptr(), n.data_ptr(),
                    B=B, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv, state_dtype=_dn(pool), stream=_stream(pool))


@gdn_fold.register_fake
def _gdn_fold_fake(pool, slot, k_hat, v_new, gamma, n):
    return None


# --------------------------------------------------------------------------------------- conv
def _conv_dtype(x, s, w):
    return torch.promote_types(torch.promote_types(x.dtype, s.dtype), w.dtype)


@torch.library.custom_op("dflash::conv_verify", mutates_args=())
def conv_verify(x: Tensor, conv_state: Tensor, weight: Tensor, slot: Optional[Tensor] = None) -> Tensor:
    raise NotImplementedError("dflash::conv_verify: no kernel for this device")


@conv_verify.register_kernel("cpu")
def _conv_verify_cpu(x, conv_state, weight, slot=None):
    return gdn_ref.conv_verify(x, _gather(conv_state, slot, x.shape[0]), weight).contiguous()


@conv_verify.register_kernel("cuda")
def _conv_verify_cuda(x, conv_state, weight, slot=None):
    B, T, C = x.shape
    W = weight.shape[-1]
    x, conv_state, weight = x.contiguous(), conv_state.contiguous(), weight.contiguous()
    slot = _i32(slot)
    y = torch.empty(B, T, C, device=x.device, dtype=_conv_dtype(x, conv_state, weight))
    launch.conv_verify(x.data_ptr(), conv_state.data_ptr(), _ptr(slot), weight.data_ptr(), y.data_ptr(), B=B, T=T,
                       C=C, W=W, x_dtype=_dn(x), s_dtype=_dn(conv_state), w_dtype=_dn(weight), y_dtype=_dn(y),
                       stream=_stream(x))
    return y


@conv_verify.register_fake
def _conv_verify_fake(x, conv_state, weight, slot=None):
    return x.new_empty(x.shape, dtype=_conv_dtype(x, conv_state, weight))


@torch.library.custom_op("dflash::conv_roll", mutates_args=("pool",))
def conv_roll(pool: Tensor, slot: Optional[Tensor], x: Tensor, n: Tensor) -> None:
    raise NotImplementedError("dflash::conv_roll: no kernel for this device")


@conv_roll.register_kernel("cpu")
def _conv_roll_cpu(pool, slot, x, n):
    B, T = x.shape[:2]
    idx = torch.arange(B) if slot is None else slot.long().cpu()
    nn = n.long().cpu().clamp(0, T)
    keep = (nn > 0) & (idx >= 0)
    if not bool(keep.any()):
        return
    new = gdn_ref.conv_roll(_gather(pool, slot, B), x, nn)
    pool[idx[keep]] = new[keep].to(pool.dtype)


@conv_roll.register_kernel("cuda")
def _conv_roll_cuda(pool, slot, x, n):
    B, T, C = x.shape
    if not pool.is_contiguous():
        raise launch.KernelError("conv_roll: conv pool must be contiguous (updated in place)")
    x, slot, n = x.contiguous(), _i32(slot), _i32(n)
    launch.conv_roll(pool.data_ptr(), _ptr(slot), x.data_ptr(), n.data_ptr(), B=B, T=T, C=C, W=pool.shape[-1] + 1,
                     s_dtype=_dn(pool), x_dtype=_dn(x), stream=_stream(x))


@conv_roll.register_fake
def _conv_roll_fake(pool, slot, x, n):
    return None


# ---------------------------------------------------------------------------------- attention
@torch.library.custom_op("dflash::paged_attention", mutates_args=())
def paged_attention(q: Tensor, k_new: Tensor, v_new: Tensor, kv_pool: Tensor, layer: int, block_table: Tensor,
                    kv_start: Tensor, kv_len: Tensor, causal: bool, scale: float) -> Tensor:
    raise NotImplementedError("dflash::paged_attention: no kernel for this device")


@paged_attention.register_kernel("cpu")
def _paged_attention_cpu(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale):
    return attention_ref.paged_attention_ref(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len,
                                             causal, scale).contiguous()


@paged_attention.register_kernel("cuda")
def _paged_attention_cuda(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale):
    B, T, Hq, hd = q.shape
    Hkv = k_new.shape[2]
    L, _, NB, BS = kv_pool.shape[:4]
    if not 0 <= layer < L:
        raise launch.KernelError(f"paged_attention: layer {layer} out of range [0, {L})")
    q, k_new, v_new, kv_pool = (t.contiguous() for t in (q, k_new, v_new, kv_pool))
    bt, ks, kl = _i32(block_table), _i32(kv_start.reshape(B)), _i32(kv_len.reshape(B))
    o = torch.empty_like(q)
    launch.paged_attention(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), kv_pool.data_ptr(), bt.data_ptr(),
                           ks.data_ptr(), kl.data_ptr(), o.data_ptr(), B=B, T=T, Hq=Hq, Hkv=Hkv, hd=hd, layer=layer,
                           num_blocks=NB, block_size=BS, max_blocks=bt.shape[1], causal=causal, scale=scale,
                           q_dtype=_dn(q), n_dtype=_dn(k_new), p_dtype=_dn(kv_pool), o_dtype=_dn(o), stream=_stream(q))
    return o


@paged_attention.register_fake
def _paged_attention_fake(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale):
    return torch.empty_like(q)


@torch.library.custom_op("dflash::kv_write", mutates_args=("kv_pool",))
def kv_write(kv_pool: Tensor, layer: int, k_new: Tensor, v_new: Tensor, block_table: Tensor, pos: Tensor,
             n: Tensor) -> None:
    raise NotImplementedError("dflash::kv_write: no kernel for this device")


@kv_write.register_kernel("cpu")
def _kv_write_cpu(kv_pool, layer, k_new, v_new, block_table, pos, n):
    BS = kv_pool.shape[3]
    for b in range(k_new.shape[0]):
        for t in range(min(int(n[b]), k_new.shape[1])):
            p = int(pos[b]) + t
            blk = int(block_table[b, p // BS])
            if blk >= 0:
                kv_pool[layer, 0, blk, p % BS] = k_new[b, t].to(kv_pool.dtype)
                kv_pool[layer, 1, blk, p % BS] = v_new[b, t].to(kv_pool.dtype)


@kv_write.register_kernel("cuda")
def _kv_write_cuda(kv_pool, layer, k_new, v_new, block_table, pos, n):
    B, T, Hkv, hd = k_new.shape
    L, _, NB, BS = kv_pool.shape[:4]
    if not kv_pool.is_contiguous():
        raise launch.KernelError("kv_write: kv pool must be contiguous (updated in place)")
    if not 0 <= layer < L:
        raise launch.KernelError(f"kv_write: layer {layer} out of range [0, {L})")
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    bt, pos, n = _i32(block_table), _i32(pos.reshape(B)), _i32(n.reshape(B))
    launch.kv_write(kv_pool.data_ptr(), bt.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), pos.data_ptr(), n.data_ptr(),
                    B=B, T=T, Hkv=Hkv, hd=hd, layer=layer, num_blocks=NB, block_size=BS, max_blocks=bt.shape[1],
                    p_dtype=_dn(kv_pool), n_dtype=_dn(k_new), stream=_stream(k_new))


@kv_write.register_fake
def _kv_write_fake(kv_pool, layer, k_new, v_new, block_table, pos, n):
    return None
