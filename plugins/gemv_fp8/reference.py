"""The math of gemv_fp8 (spec.py), the op's CPU kernel, and the block-wise dequantisation the models share
(modeling/fp8.py imports it from here: plugins do not import modeling).

gemv_fp8: W = dequantize_blockwise(w, scale_inv) in fp32 (one fp32 product per weight), then x @ W.T in fp32,
rounded once to x's dtype unless fp32_out. gemv_fp8_swiglu: gate and up rounded to x's dtype, then silu(gate) * up as
eager torch rounds the unfused MLP (gemv/reference.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trt.plugins.gemv_fp8.spec import BLOCK


def scale_rows(scale_inv, bn: int, N: int):
    """scale_inv [..., nb, kb] -> [..., N, kb]: each block row's scales repeated over its bn rows. An expand, not
    repeat_interleave: no host sync, so a CUDA graph can capture it."""
    s = scale_inv.unsqueeze(-2).expand(*scale_inv.shape[:-1], bn, scale_inv.shape[-1])
    return s.flatten(-3, -2)[..., :N, :]


def dequantize_blockwise(w, scale_inv, block: tuple[int, int], dtype=torch.float32):
    """w float8_e4m3fn [..., N, K], scale_inv fp32 [..., ceil(N/bn), ceil(K/bk)] -> W [..., N, K] in `dtype`:
    W[n,k] = fp32(w[n,k]) * scale_inv[n // bn, k // bk] (one fp32 rounding), then cast to dtype. The scales are
    repeated over rows only and broadcast over a view of the columns, so no weight-sized scale tensor is made."""
    bn, bk = block
    N, K = w.shape[-2:]
    rows = scale_rows(scale_inv.float(), bn, N)  # [..., N, ceil(K/bk)]
    wf = w.float()
    full = K // bk
    out = (wf[..., :full * bk].unflatten(-1, (full, bk)) * rows[..., :full, None]).flatten(-2)
    if K % bk:  # the last, narrower column block
        out = torch.cat([out, wf[..., full * bk:] * rows[..., full:]], dim=-1)
    return out.to(dtype)


def gemv_fp8(x, w, scale_inv, fp32_out=False):
    y = F.linear(x.float(), dequantize_blockwise(w, scale_inv, (BLOCK, BLOCK)))
    return y if fp32_out else y.to(x.dtype)


def gemv_fp8_swiglu(x, w, scale_inv):
    gate, up = gemv_fp8(x, w, scale_inv).chunk(2, dim=-1)
    return F.silu(gate) * up
