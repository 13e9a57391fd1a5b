"""torch custom ops dflash::moe_experts and dflash::moe_route: CUDA -> kernel.cu via launch.py on torch's current
stream, CPU -> the reference math (reference.py), plus fake impls (torch.compile / export). Registered through
dflash_trt.plugins.torch_ops.

  moe_experts(x [N,H], topk_idx [N,k] int, topk_w [N,k], gate_up [E,2I,H], down [E,H,I]) -> y [N,H] (x's dtype)
  moe_experts_fp8(x, topk_idx, topk_w, gate_up e4m3 [E,2I,H], gate_up_scale [E,2I/128,H/128] fp32, down e4m3
    [E,H,I], down_scale [E,H/128,I/128]) -> y: the same on W = fp8 * scale of its 128x128 block (W8A16, x 16-bit,
    H and I multiples of 128); CUDA: the decode or grouped kernels streaming the selected experts' fp8 bytes; CPU:
    the weights dequantized in fp32, then the reference
  moe_experts_shared(x, topk_idx, topk_w, gate_up, down, shared_gate_up [2I,H], shared_down [H,I], shared_logit
    [N,1], scales: [] or the four FP8 scales) -> routed + sigmoid(shared_logit) * shared expert(x), the sparse MoE
    block's experts in one op; CUDA: the decode path only (<= spec.DECODE_TOKENS tokens), two launches; CPU: the
    reference (reference.moe_experts_shared)
  moe_route(logits [N,E], k, norm) -> (topk_idx [N,k] int64, topk_w [N,k] in logits' dtype)   (reference.route)
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.gemv_fp8 import spec as gemv_fp8_spec
from dflash_trt.plugins.moe import launch, reference, spec
from dflash_trt.plugins.opspec import KernelError, need


@torch.library.custom_op("dflash::moe_experts", mutates_args=())
def moe_experts(x: Tensor, topk_idx: Tensor, topk_w: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    raise NotImplementedError("dflash::moe_experts: no kernel for this device")


def _check(x, topk_idx, topk_w, gate_up, down):
    spec.SPEC.check_shapes([tuple(t.shape) for t in (x, topk_idx, topk_w, gate_up, down)])


@moe_experts.register_kernel("cpu")
def _moe_experts_cpu(x, topk_idx, topk_w, gate_up, down):
    _check(x, topk_idx, topk_w, gate_up, down)
    return reference.moe_experts(x, topk_idx, topk_w, gate_up, down)


@moe_experts.register_kernel("cuda")
def _moe_experts_cuda(x, topk_idx, topk_w, gate_up, down):
    _check(x, topk_idx, topk_w, gate_up, down)
    U.check_groups(spec.SPEC, (x, topk_idx, topk_w, gate_up, down))
    N, H = x.shape
    k, E, I = topk_idx.shape[1], gate_up.shape[0], down.shape[2]  # noqa: E741
    spec.check_dims(N, k, E, H, I)
    if gate_up.stride(-1) != 1 or not gate_up.is_contiguous() or not down.is_contiguous():
        raise KernelError("moe_experts: expert weights must be contiguous (copying them per call would defeat it)")
    x, topk_idx, topk_w = x.contiguous(), topk_idx.contiguous(), topk_w.contiguous()
    return _run(x, topk_idx, topk_w, gate_up, down, E, I)


def _run(x, topk_idx, topk_w, gate_up, down, E, I, scales=None):  # noqa: E741
    """The decode path (per-pair streaming) for a few tokens, else the grouped one; contiguous inputs."""
    N, k = x.shape[0], topk_idx.shape[1]
    if launch.takes_decode_path(N, k, I, U.dname(x)) and x.data_ptr() % 16 == 0:
        out = torch.empty_like(x)
        h = torch.empty(N * k, I, device=x.device, dtype=x.dtype)
        launch.moe_experts_decode(x.data_ptr(), topk_idx.data_ptr(), topk_w.data_ptr(), gate_up.data_ptr(),
                                  down.data_ptr(), out.data_ptr(), h.data_ptr(), scales=_ptrs(scales),
                                  **_launch_args(x, topk_idx, topk_w, E, I))
        return out
    return _grouped(x, topk_idx, topk_w, gate_up, down, E, I, scales)


def _ptrs(scales):
    return None if scales is None else tuple(s.data_ptr() for s in scales)


def _launch_args(x, topk_idx, topk_w, E, I):  # noqa: E741
    (N, H), k = x.shape, topk_idx.shape[1]
    return dict(N=N, k=k, E=E, H=H, I=I, dtype=U.dname(x), idx_dtype=U.dname(topk_idx), w_dtype=U.dname(topk_w),
                stream=U.stream(x))


def _grouped(x, topk_idx, topk_w, gate_up, down, E, I, scales=None):  # noqa: E741
    """The grouped path (plan, gate_up, down, combine) on contiguous inputs; scales: FP8 weights' (launch.py)."""
    (N, H), k, dev = x.shape, topk_idx.shape[1], x.device
    out = torch.empty_like(x)
    y_pair = torch.empty(N * k, H, device=dev, dtype=torch.float32)
    plan = torch.empty(launch.workspace_ints(N, k, E), device=dev, dtype=torch.int32)
    h = torch.empty(N * k, I, device=dev, dtype=x.dtype)
    launch.moe_experts(x.data_ptr(), topk_idx.data_ptr(), topk_w.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                       out.data_ptr(), plan.data_ptr(), h.data_ptr(), y_pair.data_ptr(),
                       scales=_ptrs(scales),
                       **_launch_args(x, topk_idx, topk_w, E, I))
    return out


@moe_experts.register_fake
def _moe_experts_fake(x, topk_idx, topk_w, gate_up, down):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(x: Tensor, topk_idx: Tensor, topk_w: Tensor, gate_up: Tensor, gate_up_scale: Tensor,
                    down: Tensor, down_scale: Tensor) -> Tensor:
    raise NotImplementedError("dflash::moe_experts_fp8: no kernel for this device")


def _check_fp8(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale):
    """Shapes as moe_experts takes them, e4m3 weights, and the scales' [E, rows/128, cols/128] blocks."""
    _check(x, topk_idx, topk_w, gate_up, down)
    need(gate_up.dtype == down.dtype == torch.float8_e4m3fn,
         f"moe_experts_fp8: weights must be float8_e4m3fn, got {gate_up.dtype} / {down.dtype}")
    _check_scales("moe_experts_fp8", (("gate_up", gate_up, gate_up_scale), ("down", down, down_scale)))


def _check_scales(op, named):
    """Each (name, e4m3 weight [..., rows, cols], scale): fp32 scales of its 128x128 blocks."""
    for name, w, s in named:
        want = (*w.shape[:-2], *gemv_fp8_spec.scale_shape(*w.shape[-2:]))
        need(s.dtype == torch.float32 and tuple(s.shape) == want,
             f"{op}: {name}_scale {tuple(s.shape)} {s.dtype} must be float32 {want} (128x128 blocks)")


@moe_experts_fp8.register_kernel("cpu")
def _moe_experts_fp8_cpu(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale):
    _check_fp8(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale)
    return reference.moe_experts_fp8(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale)


@moe_experts_fp8.register_kernel("cuda")
def _moe_experts_fp8_cuda(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale):
    _check_fp8(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale)
    (N, H), k, E, I = x.shape, topk_idx.shape[1], gate_up.shape[0], down.shape[2]  # noqa: E741
    spec.check_dims(N, k, E, H, I)
    spec.check_fp8(H, I, U.dname(x))
    if not all(t.is_contiguous() for t in (gate_up, gate_up_scale, down, down_scale)):
        raise KernelError("moe_experts_fp8: expert weights and scales must be contiguous (a copy per call would "
                          "defeat the kernel)")
    x, topk_idx, topk_w = x.contiguous(), topk_idx.contiguous(), topk_w.contiguous()
    return _run(x, topk_idx, topk_w, gate_up, down, E, I, scales=(gate_up_scale, down_scale))


@moe_experts_fp8.register_fake
def _moe_experts_fp8_fake(x, topk_idx, topk_w, gate_up, gate_up_scale, down, down_scale):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::moe_experts_shared", mutates_args=())
def moe_experts_shared(x: Tensor, topk_idx: Tensor, topk_w: Tensor, gate_up: Tensor, down: Tensor,
                       shared_gate_up: Tensor, shared_down: Tensor, shared_logit: Tensor,
                       scales: list[Tensor]) -> Tensor:
    raise NotImplementedError("dflash::moe_experts_shared: no kernel for this device")


def _check_shared(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down, shared_logit, scales):
    """The routed experts as moe_experts (or moe_experts_fp8 with four scales) takes them, and the shared expert
    in their format and width: gate_up [2I,H], down [H,I]; its gate logit [N,1] in x's dtype."""
    need(len(scales) in (0, 4), f"moe_experts_shared: scales must be [] or the four FP8 block scales, got {len(scales)}")
    if scales:
        _check_fp8(x, topk_idx, topk_w, gate_up, scales[0], down, scales[1])
        _check_scales("moe_experts_shared", (("shared_gate_up", shared_gate_up, scales[2]),
                                             ("shared_down", shared_down, scales[3])))
    else:
        _check(x, topk_idx, topk_w, gate_up, down)
    (N, H), I = x.shape, down.shape[2]  # noqa: E741
    need(tuple(shared_gate_up.shape) == (2 * I, H) and tuple(shared_down.shape) == (H, I)
         and shared_gate_up.dtype == shared_down.dtype == gate_up.dtype,
         f"moe_experts_shared: the shared expert {tuple(shared_gate_up.shape)} / {tuple(shared_down.shape)} "
         f"{shared_gate_up.dtype} must be [2I,H] = {(2 * I, H)} / [H,I] = {(H, I)} in the experts' {gate_up.dtype}")
    need(tuple(shared_logit.shape) == (N, 1) and shared_logit.dtype == x.dtype,
         f"moe_experts_shared: shared_logit {tuple(shared_logit.shape)} {shared_logit.dtype} must be [{N},1] {x.dtype}")


@moe_experts_shared.register_kernel("cpu")
def _moe_experts_shared_cpu(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down, shared_logit, scales):
    _check_shared(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down, shared_logit, scales)
    return reference.moe_experts_shared(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down,
                                        shared_logit, tuple(scales))


@moe_experts_shared.register_kernel("cuda")
def _moe_experts_shared_cuda(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down, shared_logit, scales):
    """The decode path only (launch.takes_decode_path with shared=True): SparseMoE asks for it where it runs."""
    _check_shared(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down, shared_logit, scales)
    (N, H), k, E, I = x.shape, topk_idx.shape[1], gate_up.shape[0], down.shape[2]  # noqa: E741
    spec.check_dims(N, k, E, H, I)
    weights = (gate_up, down, shared_gate_up, shared_down, *scales)
    if not all(t.is_contiguous() for t in weights):
        raise KernelError("moe_experts_shared: expert weights and scales must be contiguous (a copy per call would "
                          "defeat the kernel)")
    x, topk_idx, topk_w = x.contiguous(), topk_idx.contiguous(), topk_w.contiguous()
    x = x if x.data_ptr() % 16 == 0 else x.clone()  # the kernels read x in 16-byte words
    out = torch.empty_like(x)
    h = torch.empty(N * (k + 1), I, device=x.device, dtype=x.dtype)
    shared = (shared_gate_up.data_ptr(), shared_down.data_ptr(), shared_logit.data_ptr(), shared_logit.stride(0),
              *(s.data_ptr() for s in scales[2:]))
    launch.moe_experts_decode(x.data_ptr(), topk_idx.data_ptr(), topk_w.data_ptr(), gate_up.data_ptr(),
                              down.data_ptr(), out.data_ptr(), h.data_ptr(), scales=_ptrs(scales[:2] or None),
                              shared=shared, **_launch_args(x, topk_idx, topk_w, E, I))
    return out


@moe_experts_shared.register_fake
def _moe_experts_shared_fake(x, topk_idx, topk_w, gate_up, down, shared_gate_up, shared_down, shared_logit, scales):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::moe_route", mutates_args=())
def moe_route(logits: Tensor, k: int, norm: bool) -> tuple[Tensor, Tensor]:
    raise NotImplementedError("dflash::moe_route: no kernel for this device")


def _check_route(logits, k):
    need(logits.dim() == 2, f"moe_route: logits {tuple(logits.shape)} must be [N,E]")
    spec.check_route(logits.shape[0], logits.shape[1], k)


@moe_route.register_kernel("cpu")
def _moe_route_cpu(logits, k, norm):
    _check_route(logits, k)
    return reference.route(logits, k, norm)


@moe_route.register_kernel("cuda")
def _moe_route_cuda(logits, k, norm):
    _check_route(logits, k)
    logits = logits.contiguous()
    N, E = logits.shape
    idx = torch.empty(N, k, device=logits.device, dtype=torch.int64)
    w = torch.empty(N, k, device=logits.device, dtype=logits.dtype)
    launch.moe_route(logits.data_ptr(), idx.data_ptr(), w.data_ptr(), N=N, E=E, k=k, norm=norm,
                     l_dtype=U.dname(logits), w_dtype=U.dname(w), stream=U.stream(logits))
    return idx, w


@moe_route.register_fake
def _moe_route_fake(logits, k, norm):
    N = logits.shape[0]
    return logits.new_empty(N, k, dtype=torch.int64), logits.new_empty(N, k)
