"""Projections that share an input as ONE GEMM: q/k/v, gate/up, the GDN in-projections.

`fuse_linears(owner, names)` concatenates the weights of owner's Linear layers `names` into one non-persistent
buffer and makes each layer's weight a view of its rows, so memory is not doubled and state_dict / parameter
names stay the checkpoint's. `linears(owner, names, x)` is the forward every module calls: one F.linear over the
buffer split by output width when the layers were fused, else each layer on its own (what ONNX export traces,
so exported graphs keep the checkpoint's separate MatMuls). Same math either way: each output element is the
same dot product; only the GEMM the library picks may differ. Fuse after the model is on its device (a later
.to() copies the views apart: still correct, but the memory is then held twice).

`linear(x, w)` is every projection's GEMM: on CUDA, a 16-bit x of 1-16 rows (a batch-1 decode or verify step, a
drafter block) goes to our weight-streaming kernel (plugins/gemv: one kernel for every row count, so a token's
projections in a verify step and in its decode step agree bit for bit), the rest to F.linear (cuBLAS; what ONNX
export traces on the CPU).
`Linear` is nn.Linear through it (same parameters and state_dict names). `swiglu(owner, (gate, up), x)`: the SwiGLU
MLP's activation of its two projections, one kernel launch when fused on CUDA (plugins/gemv gemv_swiglu).
FP8 layers (modeling/fp8.py: `weight` e4m3 + `weight_scale_inv`) take the same routes through plugins/gemv_fp8
(`fp8_takes` is the test): a group fuses when every layer is FP8 and all but the last have whole 128-row scale
blocks (weights and scales then stack row for row); calls the kernel cannot take run each layer on its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.abi import MAX_K
from dflash_trt.modeling.fp8_gemm import w8a8, w8a8_takes
from dflash_trt.plugins import torch_ops  # noqa: F401  (registers torch.ops.dflash.gemv)
from dflash_trt.plugins.gemv import reference as gemv_reference
from dflash_trt.plugins.gemv import spec as gemv_spec
from dflash_trt.plugins.gemv_fp8 import spec as fp8_spec
from dflash_trt.plugins.torch_util import dname

BUFFER = "_fused_"  # buffer name prefix on the owner: _fused_<first layer name>
SCALES = "_scale_inv"  # FP8 groups: the stacked scales are buffer _fused_<first layer name>_scale_inv
FP8 = torch.float8_e4m3fn


def _infer(x, w) -> bool:
    """CUDA inference with one dtype: where our kernels may run (no autograd through them)."""
    return x.is_cuda and not torch.is_grad_enabled() and w.dtype == x.dtype


def _gemv_takes(x) -> bool:
    return gemv_spec.usable(x.numel() // max(x.shape[-1], 1), x.shape[-1], dname(x))


def fp8_takes(x, block=(fp8_spec.BLOCK, fp8_spec.BLOCK)) -> bool:
    """Whether dflash::gemv_fp8 takes x against an FP8 weight of scale blocks `block` (CUDA inference, 16-bit x,
    K % 16 == 0): 1-16 rows, or up to fp8_spec.MAX_CALL_ROWS rows of decode / verify steps (x [..., T, K] with T <=
    abi.MAX_K; the kernel runs them as 16-row slices with a plain decode's sums); otherwise the FP8 layer runs W8A8
    (prefill chunks on Hopper) or dequantizes its weight and runs `linear`."""
    rows = x.numel() // max(x.shape[-1], 1)
    step = rows <= fp8_spec.MAX_ROWS or (x.dim() >= 2 and x.shape[-2] <= MAX_K)
    return (x.is_cuda and not torch.is_grad_enabled() and tuple(block) == (fp8_spec.BLOCK, fp8_spec.BLOCK)
            and step and fp8_spec.usable(rows, x.shape[-1], dname(x)))


def linear(x, w, fp32_out: bool = False):
    """x @ w.T. Inference only (no autograd through the kernel): training steps keep F.linear.
    fp32_out (logits): an fp32 y. CUDA inference takes the GEMM's fp32 sums, not rounded to 16 bits first (one bf16
    ulp at a logit of 16 is 0.125: enough to move a near-tie between the verify and the decode step); elsewhere
    F.linear then a cast (what ONNX export traces, unchanged)."""
    infer = _infer(x, w)
    if infer and _gemv_takes(x):
        return torch.ops.dflash.gemv(x, w, fp32_out)
    if infer and fp32_out and x.dtype != torch.float32:
        return gemv_reference.gemv(x, w, fp32_out=True)  # cuBLAS, fp32 output
    y = F.linear(x, w)
    return y.float() if fp32_out else y


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (bias-free, as every projection of these models)."""

    def forward(self, x):
        if self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight)

    def fp32(self, x):
        """This layer's output in fp32 (`linear(..., fp32_out=True)`): the lm_head's logits."""
        if self.bias is not None:
            return F.linear(x, self.weight, self.bias).float()
        return linear(x, self.weight, fp32_out=True)


def _fuse_fp8(owner: nn.Module, attr: str, layers: list) -> None:
    """An all-FP8 group: weights and scales stacked into two buffers, each layer's weight and weight_scale_inv views
    of their rows. Left unfused unless every layer but the last ends on a scale-block boundary."""
    bn = fp8_spec.BLOCK
    if any(tuple(lin.block) != (bn, bn) for lin in layers) or any(lin.out_features % bn for lin in layers[:-1]):
        return
    w = torch.cat([lin.weight.detach() for lin in layers])
    s = torch.cat([lin.weight_scale_inv.detach() for lin in layers])
    owner.register_buffer(attr, w, persistent=False)
    owner.register_buffer(attr + SCALES, s, persistent=False)
    off = 0
    for lin in layers:
        rows = lin.out_features
        lin.weight = nn.Parameter(w[off:off + rows], requires_grad=False)
        lin.weight_scale_inv = nn.Parameter(s[off // bn:off // bn + lin.weight_scale_inv.shape[0]], requires_grad=False)
        off += rows


def fuse_linears(owner: nn.Module, names: tuple[str, ...]) -> None:
    """Idempotent; bias-free Linear layers only (every projection of these models), or FP8 layers only (_fuse_fp8);
    a group mixing the two is left unfused."""
    attr = BUFFER + names[0]
    if hasattr(owner, attr):
        return
    layers = [getattr(owner, n) for n in names]
    if all(getattr(lin, "weight", None) is not None and lin.weight.dtype == FP8 for lin in layers):
        return _fuse_fp8(owner, attr, layers)
    if not all(isinstance(lin, nn.Linear) for lin in layers):
        return
    if any(lin.bias is not None for lin in layers):
        raise ValueError(f"fuse_linears: {names} must be bias-free")
    w = torch.cat([lin.weight.detach() for lin in layers])
    owner.register_buffer(attr, w, persistent=False)
    off = 0
    for lin in layers:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(w[off:off + rows], requires_grad=lin.weight.requires_grad)
        off += rows


def linears(owner: nn.Module, names: tuple[str, ...], x) -> list:
    """[layer(x) for layer in names], as one GEMM when fuse_linears(owner, names) ran."""
    w = getattr(owner, BUFFER + names[0], None)
    if w is not None and w.dtype == FP8:  # one FP8 GEMM where the kernel or W8A8 takes x, else each layer dequantizes
        if fp8_takes(x):
            y = torch.ops.dflash.gemv_fp8(x, w, getattr(owner, BUFFER + names[0] + SCALES))
        elif w8a8_takes(x, w):
            y = w8a8(x, w, getattr(owner, BUFFER + names[0] + SCALES))
        else:
            return [getattr(owner, n)(x) for n in names]
    elif w is None:
        return [getattr(owner, n)(x) for n in names]
    else:
        y = linear(x, w)
    return list(torch.split(y, [getattr(owner, n).out_features for n in names], dim=-1))


def swiglu(owner: nn.Module, names: tuple[str, ...], x):
    """F.silu(gate(x)) * up(x) of owner's layers names = (gate, up). Fused (fuse_linears) on CUDA inference within the
    gemv kernel's limits: one launch, the activation in the projection's epilogue (dflash::gemv_swiglu, rounded as
    below); else the two projections (`linears`) and torch ops."""
    w = getattr(owner, BUFFER + names[0], None)
    if w is not None and w.dtype == FP8:
        same = len({getattr(owner, n).out_features for n in names}) == 1
        if same and fp8_takes(x) and fp8_spec.swiglu_usable(w.shape[0]):
            return torch.ops.dflash.gemv_fp8_swiglu(x, w, getattr(owner, BUFFER + names[0] + SCALES))
    elif w is not None and _infer(x, w) and _gemv_takes(x):
        return torch.ops.dflash.gemv_swiglu(x, w)
    gate, up = linears(owner, names, x)
    return F.silu(gate) * up
