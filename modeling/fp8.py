"""FP8 block-wise weights (dflash_trt.quant): the W8A16 reference linear and experts, and the swap that makes a
built TargetModel's projections FP8 where the checkpoint's quantization_config says so.

A converted projection holds `weight` float8_e4m3fn [N,K] and `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)]
under exactly those state_dict names (checkpoint names map 1:1), never a persistent 16/32-bit copy. On CUDA, a
16-bit x of a decode or verify step (1-16 rows, or up to 64 rows of several sequences' steps; fuse.fp8_takes) goes
to the W8A16 kernel dflash::gemv_fp8 (plugins/gemv_fp8: the fp8 bytes streamed once a 16-row slice, exact up to
fp32 accumulation). Any other call dequantizes
block-wise per call (dequantize_blockwise: one fp32 multiply per element) to the activation dtype and runs the
ordinary projection GEMM (fuse.linear) on it. Under ONNX export the dequantisation is one standard
DequantizeLinear node (opset 21, blocked along K with the scale repeated over each block's rows: the same fp32
products), so ORT runs the FP8 initializers on the CPU. Projection fusion (fuse.fuse_linears) stacks an all-FP8 group's
weights and scales when the scale blocks allow it (the gate/up pair: one gemv_fp8_swiglu launch).
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import ConfigError
from dflash_trt.modeling.fp8_gemm import w8a8, w8a8_takes
from dflash_trt.modeling.fuse import Linear, fp8_takes, linear
from dflash_trt.modeling.mlp import Experts, SparseMoE
from dflash_trt.plugins import ops, torch_ops  # noqa: F401  (torch_ops registers dflash::moe_experts_fp8)
from dflash_trt.plugins.moe.spec import FP8_BLOCK
from dflash_trt.plugins.gemv_fp8.reference import E4M3_MAX, MIN_AMAX, dequantize_blockwise, scale_rows as _rows  # noqa: F401
from dflash_trt.quant import Fp8Config

FP8 = torch.float8_e4m3fn
DQ_OPSET = 21  # DequantizeLinear with float8 inputs and a block_size attribute


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dequantize(w, scale_inv, block, dtype):
    """dequantize_blockwise, or under ONNX export one DequantizeLinear node on the FP8 initializer (axis K,
    block_size bk; the scale repeated over rows, which is exact: every row of a block row shares its scales)."""
    if not torch.onnx.is_in_onnx_export():
        return dequantize_blockwise(w, scale_inv, block, dtype)
    rows = _rows(scale_inv, block[0], w.shape[-2])
    out = torch.onnx.ops.symbolic("DequantizeLinear", [w, rows], {"axis": w.dim() - 1, "block_size": block[1]},
                                  dtype=torch.float32, shape=list(w.shape), version=DQ_OPSET)
    return out.to(dtype)


def _frozen(t):
    return nn.Parameter(t, requires_grad=False)


class Fp8Linear(nn.Module):
    """A bias-free projection with FP8 block-wise weights: weight float8_e4m3fn [out, in], weight_scale_inv fp32
    [ceil(out/bn), ceil(in/bk)]. forward(x [..., in]) -> [..., out] in x's dtype (W8A16: x is not quantized)."""

    bias = None

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=FP8))
        self.weight_scale_inv = _frozen(torch.ones(_cdiv(out_features, block[0]), _cdiv(in_features, block[1])))

    def dequantized(self, dtype):
        return _dequantize(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x):
        return self._project(x, False)

    def fp32(self, x):
        return self._project(x, True)

    def _project(self, x, fp32_out: bool):
        """Decode / verify rows on CUDA (fuse.fp8_takes): the W8A16 kernel; wider x: W8A8 where its mode is on
        (modeling/fp8_gemm.py), else the weight dequantized and a 16-bit GEMM."""
        if fp8_takes(x, self.block):
            return torch.ops.dflash.gemv_fp8(x, self.weight, self.weight_scale_inv, fp32_out)
        if w8a8_takes(x, self.weight, self.block):
            return w8a8(x, self.weight, self.weight_scale_inv, fp32_out)
        return linear(x, self.dequantized(x.dtype), fp32_out=fp32_out)


class Fp8Experts(nn.Module):
    """Experts (modeling/mlp.py) with FP8 weights: gate_up_proj [E,2I,H] and down_proj [E,H,I] float8_e4m3fn with
    gate_up_proj_scale_inv [E,2I/bn,ceil(H/bk)] and down_proj_scale_inv [E,ceil(H/bn),ceil(I/bk)] fp32 (transformers'
    FP8Experts names). I must be a multiple of bn, so gate and up rows stack block for block."""

    def __init__(self, n: int, hidden: int, inter: int, block: tuple[int, int]):
        super().__init__()
        bn, bk = self.block = tuple(block)
        self.gate_up_proj = _frozen(torch.zeros(n, 2 * inter, hidden, dtype=FP8))
        self.gate_up_proj_scale_inv = _frozen(torch.ones(n, 2 * inter // bn, _cdiv(hidden, bk)))
        self.down_proj = _frozen(torch.zeros(n, hidden, inter, dtype=FP8))
        self.down_proj_scale_inv = _frozen(torch.ones(n, _cdiv(hidden, bn), _cdiv(inter, bk)))

    def forward(self, x, topk_idx, topk_w):
        """As Experts.forward. CUDA inference with 16-bit x and 128x128 blocks: dflash::moe_experts_fp8, the grouped
        kernels streaming the selected experts' fp8 bytes (W8A16, plugins/moe); otherwise (CPU, ONNX export,
        autograd) the weights dequantized to x's dtype and the op seam's reference or kernels."""
        if experts_kernel_takes(x, self):
            return torch.ops.dflash.moe_experts_fp8(x, topk_idx, topk_w, self.gate_up_proj,
                                                    self.gate_up_proj_scale_inv, self.down_proj,
                                                    self.down_proj_scale_inv)
        gate_up = _dequantize(self.gate_up_proj, self.gate_up_proj_scale_inv, self.block, x.dtype)
        down = _dequantize(self.down_proj, self.down_proj_scale_inv, self.block, x.dtype)
        return ops.moe_experts(x, topk_idx, topk_w, gate_up, down)


def experts_kernel_takes(x, experts) -> bool:
    """Whether FP8 experts (Fp8Experts' weights, scales and block) run x through dflash::moe_experts_fp8: CUDA
    inference (no autograd, not an ONNX export), 16-bit x, 128x128 blocks, H and I whole blocks, contiguous
    tensors. A function, not a method: a tensor-parallel rank's LocalExperts runs Fp8Experts.forward on its slice."""
    H, I = experts.down_proj.shape[1:]  # noqa: E741
    tensors = (experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj, experts.down_proj_scale_inv)
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and tuple(experts.block) == (FP8_BLOCK, FP8_BLOCK)
            and H % FP8_BLOCK == 0 and I % FP8_BLOCK == 0 and all(t.is_contiguous() for t in tensors)
            and not torch.is_grad_enabled() and not torch.onnx.is_in_onnx_export())


def _fp8_twin(owner: nn.Module, child: str, mod: nn.Module, q: Fp8Config, path: str):
    """The FP8 module replacing owner.child, or None where transformers never converts it: the MoE router is
    HF's TopKRouter (not an nn.Linear); lm_head is always kept (get_keys_to_not_convert)."""
    if isinstance(mod, Linear) and not (isinstance(owner, SparseMoE) and child == "gate"):
        return Fp8Linear(mod.in_features, mod.out_features, q.block)
    if isinstance(mod, Experts):
        E, two_i, H = mod.gate_up_proj.shape
        if (two_i // 2) % q.block[0]:
            raise ConfigError(f"{path}: field 'moe_intermediate_size' {two_i // 2} is not a multiple of the FP8 "
                              f"block {q.block[0]} (gate and up blocks of an expert cannot be stacked)")
        return Fp8Experts(E, H, two_i // 2, q.block)
    return None


def quantize_modules(model: nn.Module, q: Fp8Config, prefix: str, path: str = "config.json") -> list[str]:
    """Swap model's projections (and routed experts) for FP8 ones where the checkpoint module prefix + name is
    converted by q's skip list (Fp8Config.converts); returns the checkpoint module names made FP8. Call before
    binding weights (export/checkpoint.py does). Only the names are listed up front: a replaced module is freed
    as soon as its twin is in place, so a model converted on the GPU peaks at its 16-bit size plus one twin."""
    done = []
    names = [(owner_name, child) for owner_name, owner in model.named_modules() for child, _ in owner.named_children()]
    for owner_name, child in names:
        full = f"{owner_name}.{child}" if owner_name else child
        if full == "lm_head" or not q.converts(prefix + full):
            continue
        owner = model.get_submodule(owner_name)
        twin = _fp8_twin(owner, child, getattr(owner, child), q, path)
        if twin is not None:
            setattr(owner, child, twin)
            done.append(prefix + full)
    return done


def quantize_weight(w, block=(128, 128)):
    """w [N, K] (any float dtype) -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]): each block
    divided by its amax / 448, as the FP8 releases quantize, so W ~= fp8 * scale_inv (dequantize_blockwise)."""
    (N, K), (bn, bk) = w.shape, block
    blocks = torch.nn.functional.pad(w.float(), (0, -K % bk, 0, -N % bn)).unflatten(1, (-1, bk)).unflatten(0, (-1, bn))
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / E4M3_MAX  # [N/bn, K/bk]
    q = (blocks / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.flatten(2).flatten(0, 1)[:N, :K].contiguous(), s


def quantize_projections(model: nn.Module, block=(128, 128)) -> list[str]:
    """Every projection of a built 16/32-bit module (its own Linear children: a drafter's fc, attention and MLP; not
    the target's embedding or lm_head it borrows) made FP8 as quantize_modules makes a checkpoint's, filled with its
    own weights quantized block-wise (quantize_weight): half the bytes a step streams, within FP8's rounding. Meant
    for a drafter, whose drafts may change (tau), never the tokens. Call before fuse_projections. Returns the module
    names converted."""
    weights = {n: m.weight.detach() for n, m in model.named_modules() if isinstance(m, Linear)}
    done = quantize_modules(model, Fp8Config(block=tuple(block)), "")
    for name in done:
        w8, scale_inv = quantize_weight(weights[name], block)
        mod = model.get_submodule(name)
        mod.weight, mod.weight_scale_inv = _frozen(w8), _frozen(scale_inv)
    return done
