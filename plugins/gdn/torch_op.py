"""torch custom ops dflash::gdn_wy16 and dflash::gdn_fold: CUDA -> kernel.cu via launch.py on torch's current
stream, CPU -> reference.py, plus fake impls (torch.compile / export). Register all ops through
dflash_trt.plugins.torch_ops. Index tensors may be int32 or int64; ``slot`` None means row b uses pool row b.

  gdn_wy16(q, k, v, g, beta, state, slot, scale, output_state, A_log, dt_bias)
      -> (o, k_hat, v_f32, g_f32, beta_f32, final_state)
      state is a pool read by slot (slot < 0 = zero state); final_state is [B,Hv,dk,dv] when output_state
      else an empty [0] tensor. With A_log and dt_bias [Hv], g and beta are the raw gate columns a, b and the
      op computes the gates (reference.gdn_gates; on CUDA inside the kernel) and g_f32, beta_f32 are those gates.
  gdn_fold(pool!, slot, k_hat, v, g, beta, n)  all layers: pool [L,slots,Hv,dk,dv], fold data [L,B,T,...]
  gdn_decode(q, k, v, g, beta, pool!, layer, slot, n, scale, A_log, dt_bias) -> o
      gdn_wy16 at T = 1 on pool[layer]'s rows slot[b], its row then committed in place (rows with n[b] > 0):
      the o and the state of gdn_wy16 followed by gdn_fold of n, one read and one write of the state on CUDA.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.gdn import launch, reference, spec
from dflash_trt.plugins.opspec import KernelError


def _sdt(state: Tensor):
    return torch.float64 if state.dtype == torch.float64 else torch.float32


def _shapes(q, k, v, g, beta):
    """(o, state_out, k_hat, v_f32, g_f32, beta_f32) shapes from the spec."""
    B, Hv, dk, dv = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    return spec.SPEC.output_shapes([q.shape, k.shape, v.shape, g.shape, beta.shape, (B, Hv, dk, dv)])


@torch.library.custom_op("dflash::gdn_wy16", mutates_args=())
def gdn_wy16(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slot: Optional[Tensor] = None,
             scale: Optional[float] = None, output_state: bool = False, A_log: Optional[Tensor] = None,
             dt_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    raise NotImplementedError("dflash::gdn_wy16: no kernel for this device")


def _check_gates(v, A_log, dt_bias) -> bool:
    """True when the op computes the gates (A_log and dt_bias both given, each [Hv])."""
    if (A_log is None) != (dt_bias is None):
        raise KernelError("gdn_wy16: A_log and dt_bias come together (in-op gates) or not at all")
    if A_log is not None and not (A_log.shape == dt_bias.shape == (v.shape[2],)):
        raise KernelError(f"gdn_wy16: A_log {tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} must be "
                          f"[Hv] = [{v.shape[2]}]")
    return A_log is not None


def _kernel_rows(q, k, v, g, beta, A_log, dt_bias):
    """The kernels' row views: ((q, k, v, g, beta), (rs_qk, rs_v, rs_gb), gates, A_log, dt_bias). Rows are read in
    place at their stride (q/k/v slices of the conv output, g/beta or the raw a/b of the projection); q and k, g and
    beta share a stride (else made contiguous). gates: the kernel computes them (A_log and dt_bias given, one dtype)."""
    gates = _check_gates(v, A_log, dt_bias)
    if gates and A_log.dtype != dt_bias.dtype:
        A_log, dt_bias = A_log.float(), dt_bias.float()
    (q, rq), (k, rk), (v, rv) = U.rows(q), U.rows(k), U.rows(v)
    (g, rg), (beta, rb) = U.rows(g, align=4), U.rows(beta, align=4)
    if rq != rk:
        (q, rq), (k, rk) = U.rows(q.contiguous()), U.rows(k.contiguous())
    if rg != rb:
        (g, rg), (beta, rb) = U.rows(g.contiguous()), U.rows(beta.contiguous())
    return (q, k, v, g, beta), (rq, rv, rg), gates, A_log, dt_bias


@gdn_wy16.register_kernel("cpu")
def _gdn_wy16_cpu(q, k, v, g, beta, state, slot=None, scale=None, output_state=False, A_log=None, dt_bias=None):
    if _check_gates(v, A_log, dt_bias):
        g, beta = reference.gdn_gates(g, beta, A_log, dt_bias)
    r = reference.gdn_chunk_wy16(q, k, v, g, beta, U.gather(state, slot, q.shape[0]), scale=scale)
    dt = _sdt(state)
    fs = r.state.to(dt) if output_state else state.new_empty(0, dtype=dt)
    # contiguous, as the fake impl (and the CUDA kernel) lays them out: the reference's o, v, g and beta are
    # transposed views at T > 1, and a traced graph views the outputs by the fake's strides
    new = lambda t, dtype=None: t.to(dtype or t.dtype).clone(memory_format=torch.contiguous_format)  # noqa: E731
    return new(r.o), new(r.k_hat, dt), new(r.v, dt), new(r.g, dt), new(r.beta, dt), fs


@gdn_wy16.register_kernel("cuda")
def _gdn_wy16_cuda(q, k, v, g, beta, state, slot=None, scale=None, output_state=False, A_log=None, dt_bias=None):
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    (q, k, v, g, beta), (rq, rv, rg), gates, A_log, dt_bias = _kernel_rows(q, k, v, g, beta, A_log, dt_bias)
    state = state.contiguous()
    U.check_groups(spec.SPEC, (q, k, v, g, beta, state))
    slot = U.i32(slot)
    so, ss, sk, sv, sg, sb = _shapes(q, k, v, g, beta)
    f32 = dict(device=q.device, dtype=torch.float32)
    o = torch.empty(so, device=q.device, dtype=q.dtype)
    k_hat, v_f, g_f, b_f = (torch.empty(x, **f32) for x in (sk, sv, sg, sb))
    fs = torch.empty(ss, **f32) if output_state else torch.empty(0, **f32)
    launch.gdn_wy16(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(),
                    U.ptr(slot), o.data_ptr(), k_hat.data_ptr(), v_f.data_ptr(), g_f.data_ptr(), b_f.data_ptr(),
                    fs.data_ptr() if output_state else 0, B=B, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv,
                    in_dtype=U.dname(q), gb_dtype=U.dname(g), o_dtype=U.dname(o), state_dtype=U.dname(state),
                    scale=scale, stream=U.stream(q), rs_qk=rq, rs_v=rv, rs_gb=rg,
                    A_log=A_log.contiguous().data_ptr() if gates else 0,
                    dt_bias=dt_bias.contiguous().data_ptr() if gates else 0,
                    p_dtype=U.dname(A_log) if gates else "float32")
    return o, k_hat, v_f, g_f, b_f, fs


@gdn_wy16.register_fake
def _gdn_wy16_fake(q, k, v, g, beta, state, slot=None, scale=None, output_state=False, A_log=None, dt_bias=None):
    so, ss, sk, sv, sg, sb = _shapes(q, k, v, g, beta)
    dt = _sdt(state)
    fs = q.new_empty(ss, dtype=dt) if output_state else q.new_empty(0, dtype=dt)
    return (q.new_empty(so), q.new_empty(sk, dtype=dt), q.new_empty(sv, dtype=dt), q.new_empty(sg, dtype=dt),
            q.new_empty(sb, dtype=dt), fs)


@torch.library.custom_op("dflash::gdn_fold", mutates_args=("pool",))
def gdn_fold(pool: Tensor, slot: Optional[Tensor], k_hat: Tensor, v: Tensor, g: Tensor, beta: Tensor,
             n: Tensor) -> None:
    raise NotImplementedError("dflash::gdn_fold: no kernel for this device")


def _check(pool, slot, k_hat, v, g, beta, n) -> bool:
    """ShapeError unless the shapes fit; False when there is nothing to fold (no layers, sequences or rows)."""
    spec.check_fold_shapes(U.shape(pool), U.shape(k_hat), U.shape(v), U.shape(g), U.shape(beta),
                           U.shape(None if slot is None else slot.reshape(-1)), tuple(n.reshape(-1).shape))
    return min(k_hat.shape[:3]) > 0


@gdn_fold.register_kernel("cpu")
def _gdn_fold_cpu(pool, slot, k_hat, v, g, beta, n):
    if not _check(pool, slot, k_hat, v, g, beta, n):
        return
    B, T = v.shape[1:3]
    nn = n.reshape(-1).long().cpu().clamp(0, T)
    slot = None if slot is None else slot.reshape(-1)
    new = reference.gdn_fold_layers(U.gather(pool, slot, B, dim=1), k_hat, v, g, beta, nn)
    U.scatter_kept(pool, slot, nn, new)


@gdn_fold.register_kernel("cuda")
def _gdn_fold_cuda(pool, slot, k_hat, v, g, beta, n):
    if not _check(pool, slot, k_hat, v, g, beta, n):
        return
    L, S, Hv, dk, dv = pool.shape
    B, T, Hk = k_hat.shape[1:4]
    if not pool.is_contiguous():
        raise KernelError("gdn_fold: state pool must be contiguous (updated in place)")
    for name, t in (("k_hat", k_hat), ("v", v), ("g", g), ("beta", beta)):
        if U.dname(t) not in spec.STATE_DTYPES:
            raise KernelError(f"gdn_fold: {name} must be float32, got {t.dtype}")
    k_hat, v, g, beta = k_hat.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous()
    slot, n = U.i32(slot), U.i32(n.reshape(-1))
    launch.gdn_fold(pool.data_ptr(), U.ptr(slot), k_hat.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                    n.data_ptr(), B=B, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv, L=L, num_slots=S,
                    state_dtype=U.dname(pool), stream=U.stream(pool))


@gdn_fold.register_fake
def _gdn_fold_fake(pool, slot, k_hat, v, g, beta, n):
    return None


@torch.library.custom_op("dflash::gdn_decode", mutates_args=("pool",))
def gdn_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, layer: int,
               slot: Optional[Tensor], n: Tensor, scale: Optional[float] = None, A_log: Optional[Tensor] = None,
               dt_bias: Optional[Tensor] = None) -> Tensor:
    raise NotImplementedError("dflash::gdn_decode: no kernel for this device")


def _check_decode(q, v, pool, layer, slot, n) -> None:
    B, T, _, dk = q.shape
    if T != 1:
        raise KernelError(f"gdn_decode: one row per sequence (T = 1), got q {tuple(q.shape)}")
    if pool.dim() != 5 or tuple(pool.shape[2:]) != (v.shape[2], dk, v.shape[3]) or not 0 <= layer < pool.shape[0]:
        raise KernelError(f"gdn_decode: pool {tuple(pool.shape)} must be [L,slots,Hv,dk,dv] = [L,slots,{v.shape[2]},"
                          f"{dk},{v.shape[3]}] with layer {layer} < L")
    if tuple(n.reshape(-1).shape) != (B,) or (slot is not None and tuple(slot.reshape(-1).shape) != (B,)):
        raise KernelError(f"gdn_decode: n {tuple(n.shape)} and slot must be [B] = [{B}]")


@gdn_decode.register_kernel("cpu")
def _gdn_decode_cpu(q, k, v, g, beta, pool, layer, slot=None, n=None, scale=None, A_log=None, dt_bias=None):
    _check_decode(q, v, pool, layer, slot, n)
    o, k_hat, v_f, g_f, b_f, _ = _gdn_wy16_cpu(q, k, v, g, beta, pool[layer], slot, scale, False, A_log, dt_bias)
    _gdn_fold_cpu(pool.narrow(0, layer, 1), slot, k_hat[None], v_f[None], g_f[None], b_f[None], n)
    return o


@gdn_decode.register_kernel("cuda")
def _gdn_decode_cuda(q, k, v, g, beta, pool, layer, slot=None, n=None, scale=None, A_log=None, dt_bias=None):
    _check_decode(q, v, pool, layer, slot, n)
    if not pool.is_contiguous():
        raise KernelError("gdn_decode: state pool must be contiguous (updated in place)")
    B, _, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    (q, k, v, g, beta), (rq, rv, rg), gates, A_log, dt_bias = _kernel_rows(q, k, v, g, beta, A_log, dt_bias)
    slot, n = U.i32(slot), U.i32(n.reshape(-1))
    o = torch.empty((B, 1, Hv, dv), device=q.device, dtype=q.dtype)
    launch.gdn_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                      pool[layer].data_ptr(), U.ptr(slot), n.data_ptr(), o.data_ptr(), B=B, Hk=Hk, Hv=Hv, dk=dk,
                      dv=dv, num_slots=pool.shape[1], in_dtype=U.dname(q), gb_dtype=U.dname(g), o_dtype=U.dname(o),
                      state_dtype=U.dname(pool), scale=scale, stream=U.stream(q), rs_qk=rq, rs_v=rv, rs_gb=rg,
                      A_log=A_log.contiguous().data_ptr() if gates else 0,
                      dt_bias=dt_bias.contiguous().data_ptr() if gates else 0,
                      p_dtype=U.dname(A_log) if gates else "float32")
    return o


@gdn_decode.register_fake
def _gdn_decode_fake(q, k, v, g, beta, pool, layer, slot=None, n=None, scale=None, A_log=None, dt_bias=None):
    return q.new_empty((q.shape[0], 1, v.shape[2], v.shape[3]))
