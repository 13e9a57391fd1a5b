"""torch custom op dflash::gemv: CUDA -> kernel.cu via launch.py on torch's current stream, CPU -> reference.py,
plus a fake impl (torch.compile). Registered through dflash_trt.plugins.torch_ops; models reach it through
dflash_trt.export.fuse.linear, which sends only the calls the kernel takes (spec.usable) here.

  gemv(x [*,K], w [N,K]) -> y [*,N]
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.gemv import launch, reference, spec


@torch.library.custom_op("dflash::gemv", mutates_args=())
def gemv(x: Tensor, w: Tensor) -> Tensor:
    raise NotImplementedError("dflash::gemv: no kernel for this device")


@gemv.register_kernel("cpu")
def _gemv_cpu(x, w):
    return reference.gemv(x, w)


@gemv.register_kernel("cuda")
def _gemv_cuda(x, w):
    spec.SPEC.check_shapes([tuple(x.shape), tuple(w.shape)])
    U.check_groups(spec.SPEC, (x, w))
    x, w = x.contiguous(), w.contiguous()
    if x.data_ptr() % 16 or w.data_ptr() % 16:  # a view at an odd offset: the kernel's 16-byte loads cannot read it
        return reference.gemv(x, w)
    N, K = w.shape
    M = x.numel() // K
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    launch.gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), M=M, N=N, K=K, dtype=U.dname(x), stream=U.stream(x))
    return y


@gemv.register_fake
def _gemv_fake(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])
