"""torch ops that Inductor must see as one opaque call: the sampling math's cumsum and the step's int32 index casts.

cumsum_last. Why: Inductor (torch 2.x, Triton) turns a cumsum over a vocabulary row into a split scan
and then fails to generate the kernels it fuses around it ("NYI TritonSplitDimKernel reductions" at batch 1,
"TypeError: list indices must be integers or slices" otherwise), for every sampled decode and spec step. The
compiled step then fell back to eager for good (torch_compile.CompiledStep). As an opaque op the cumsum is ATen's own
kernel and the rest of the step still compiles. Same values as torch.cumsum (it is torch.cumsum).

as_int32. Why: the kernels read index tensors (slot, block tables, lengths, n) as int32 and the step buffers hold
int64. Inductor inlines a plain cast into every kernel that reads it, and an opaque kernel (each of our ops) needs
its own realized copy: one cast kernel per op call (figures: docs/PERF.md). As an opaque
op the cast is one realized buffer that every call reads.
"""
from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("dflash::cumsum_last", mutates_args=())
def cumsum_last(x: Tensor) -> Tensor:
    """torch.cumsum(x, -1)."""
    return torch.cumsum(x, -1)


@cumsum_last.register_fake
def _cumsum_last_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::as_int32", mutates_args=())
def as_int32(x: Tensor) -> Tensor:
    """x.to(torch.int32), always a new tensor."""
    return x.to(torch.int32, copy=True)


@as_int32.register_fake
def _as_int32_fake(x):
    return torch.empty_like(x, dtype=torch.int32)
