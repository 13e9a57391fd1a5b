"""The math of gemv (spec.py): a plain linear layer without bias; fp32_out: the fp32 sums, not rounded to x's dtype.
gemv_swiglu: the SwiGLU MLP's gate/up projection with w = [gate; up], rounded as the unfused eager MLP rounds."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv(x, w, fp32_out=False):
    if fp32_out and x.dtype != torch.float32:
        if x.is_cuda:  # cuBLAS with fp32 output: the same fp32 accumulation, no rounding of the sums
            return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).reshape(*x.shape[:-1], -1)
        return F.linear(x.float(), w.float())
    return F.linear(x, w)


def gemv_swiglu(x, w):
    gate, up = gemv(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up
