"""The math of gemv_fp8 (spec.py), the op's CPU kernel, and the block-wise dequantisation the models share
(modeling/fp8.py imports it from here: plugins do not import modeling).

gemv_fp8: W = dequantize_blockwise(w, scale_inv) in fp32 (one fp32 product per weight), then x @ W.T in fp32,
rounded once to x's dtype unless fp32_out. gemv_fp8_swiglu: gate and up rounded to x's dtype, then silu(gate) * up as
eager torch rounds the unfused MLP (gemv/reference.py). w8a8_gemm: the activations quantized to e4m3 per token and
group of 128 channels (quantize_activations), both operands dequantized, x @ W.T in fp32 (the W8A8 op's math)."""
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


E4M3_MAX = 448.0
MIN_AMAX = 1e-10  # a group of zeros: scale from this, not 0 (its values quantize to 0 either way)


def _groups(x, group: int):
    """x [..., K] -> fp32 [..., ceil(K/group), group], the last group zero-padded."""
    return F.pad(x.float(), (0, (-x.shape[-1]) % group)).unflatten(-1, (-1, group))


def quantize_activations(x, group: int = BLOCK):
    """x [..., K] -> (xq float8_e4m3fn [..., K], scales fp32 [..., ceil(K/group)]): each token's channels in groups of
    `group`, scale = amax / 448, xq = clamp(x / scale) rounded to e4m3 (x ~= xq * scale)."""
    xf = _groups(x, group)
    s = xf.abs().amax(-1).clamp(min=MIN_AMAX) / E4M3_MAX
    xq = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq.flatten(-2)[..., :x.shape[-1]], s


def dequantize_activations(xq, s, group: int = BLOCK):
    """fp32 xq * its group's scale: the activations W8A8 multiplies."""
    return (_groups(xq, group) * s[..., None]).flatten(-2)[..., :xq.shape[-1]]


def w8a8_gemm(x, w, scale_inv, fp32_out=False):
    xq, s = quantize_activations(x)
    y = F.linear(dequantize_activations(xq, s), dequantize_blockwise(w, scale_inv, (BLOCK, BLOCK)))
    return y if fp32_out else y.to(x.dtype)
