"""torch ops that Inductor must see as one opaque call: today only the sampling math's cumsum.

Why: on the H200 (torch 2.x, Triton) Inductor turns a cumsum over a vocabulary row into a split scan and then fails
to generate the kernels it fuses around it ("NYI TritonSplitDimKernel reductions" at batch 1, "TypeError: list
indices must be integers or slices" otherwise), for every sampled decode and spec step. The compiled step then
fell back to eager for good (torch_compile.CompiledStep). As an opaque op the cumsum is ATen's own kernel and the
rest of the step still compiles. Same values as torch.cumsum (it is torch.cumsum).
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
