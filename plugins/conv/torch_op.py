"""torch custom ops dflash::conv_verify and dflash::conv_roll: CUDA -> kernel.cu via launch.py on torch's current
stream, CPU -> reference.py, plus fake impls. Register all ops through dflash_trt.plugins.torch_ops.
Index tensors may be int32 or int64; ``slot`` None means row b uses pool row b.

  conv_verify(x, conv_state, weight, slot) -> y      conv_state is a pool read by slot (slot < 0: zeros)
  conv_roll(pool!, slot, x, n)                       all layers: pool [L,slots,C,W-1], x [L,B,T,C]
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.conv import launch, reference, spec
from dflash_trt.plugins.opspec import KernelError


def _conv_dtype(x, s, w):
    return torch.promote_types(torch.promote_types(x.dtype, s.dtype), w.dtype)


@torch.library.custom_op("dflash::conv_verify", mutates_args=())
def conv_verify(x: Tensor, conv_state: Tensor, weight: Tensor, slot: Optional[Tensor] = None) -> Tensor:
    raise NotImplementedError("dflash::conv_verify: no kernel for this device")


@conv_verify.register_kernel("cpu")
def _conv_verify_cpu(x, conv_state, weight, slot=None):
    return reference.conv_verify(x, U.gather(conv_state, slot, x.shape[0]), weight).contiguous()


@conv_verify.register_kernel("cuda")
def _conv_verify_cuda(x, conv_state, weight, slot=None):
    B, T, C = x.shape
    W = weight.shape[-1]
    (x, x_rs), conv_state, weight = U.rows(x, align=x.element_size()), conv_state.contiguous(), weight.contiguous()
    U.check_groups(spec.SPEC, (x, conv_state, weight))
    slot = U.i32(slot)
    (shape,) = spec.SPEC.output_shapes([x.shape, (B, C, W - 1), weight.shape])
    y = torch.empty(shape, device=x.device, dtype=_conv_dtype(x, conv_state, weight))
    launch.conv_verify(x.data_ptr(), conv_state.data_ptr(), U.ptr(slot), weight.data_ptr(), y.data_ptr(), B=B, T=T,
                       C=C, W=W, x_dtype=U.dname(x), s_dtype=U.dname(conv_state), w_dtype=U.dname(weight),
                       y_dtype=U.dname(y), stream=U.stream(x), x_rs=x_rs)
    return y


@conv_verify.register_fake
def _conv_verify_fake(x, conv_state, weight, slot=None):
    return x.new_empty(x.shape, dtype=_conv_dtype(x, conv_state, weight))


@torch.library.custom_op("dflash::conv_roll", mutates_args=("pool",))
def conv_roll(pool: Tensor, slot: Optional[Tensor], x: Tensor, n: Tensor) -> None:
    raise NotImplementedError("dflash::conv_roll: no kernel for this device")


def _check(pool, slot, x, n) -> bool:
    """ShapeError unless the shapes fit; False when there is nothing to roll (no layers, sequences or rows)."""
    spec.check_roll_shapes(U.shape(pool), U.shape(x), U.shape(None if slot is None else slot.reshape(-1)),
                           tuple(n.reshape(-1).shape))
    return min(x.shape[:3]) > 0


@conv_roll.register_kernel("cpu")
def _conv_roll_cpu(pool, slot, x, n):
    if not _check(pool, slot, x, n):
        return
    B, T = x.shape[1:3]
    nn = n.reshape(-1).long().cpu().clamp(0, T)
    slot = None if slot is None else slot.reshape(-1)
    U.scatter_kept(pool, slot, nn, reference.conv_roll_layers(U.gather(pool, slot, B, dim=1), x, nn))


@conv_roll.register_kernel("cuda")
def _conv_roll_cuda(pool, slot, x, n):
    if not _check(pool, slot, x, n):
        return
    L, S, C, Wm1 = pool.shape
    B, T = x.shape[1:3]
    if not pool.is_contiguous():
        raise KernelError("conv_roll: conv pool must be contiguous (updated in place)")
    x, slot, n = x.contiguous(), U.i32(slot), U.i32(n.reshape(-1))
    launch.conv_roll(pool.data_ptr(), U.ptr(slot), x.data_ptr(), n.data_ptr(), B=B, T=T, C=C, W=Wm1 + 1, L=L,
                     num_slots=S, s_dtype=U.dname(pool), x_dtype=U.dname(x), stream=U.stream(x))


@conv_roll.register_fake
def _conv_roll_fake(pool, slot, x, n):
    return None
