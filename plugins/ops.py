"""The custom ops as the models call them: the one seam between the model math and its backends.

The torch modules (export/target.py, export/drafter.py) call only these functions. Under
`torch.onnx.export` each becomes one `dflash::<Op>` node whose name, attributes, output dtypes and shapes
come from the op's spec (plugins/<op>/spec.py; its semantics are the FunctionProto of the same name,
plugins/<op>/onnx_body.py). On CUDA tensors they call the dflash:: torch ops (our kernels); otherwise the
reference math (plugins/<op>/reference.py).
"""
from __future__ import annotations

import torch

from dflash_trt.plugins.conv import reference as conv_ref
from dflash_trt.plugins.conv.spec import SPEC as CONV
from dflash_trt.plugins.gdn import reference as gdn_ref
from dflash_trt.plugins.gdn.spec import IDENTITY_GATE
from dflash_trt.plugins.gdn.spec import SPEC as GDN
from dflash_trt.plugins.moe import reference as moe_ref
from dflash_trt.plugins.moe.spec import SPEC as MOE
from dflash_trt.plugins.opspec import OP_VERSION, PLUGIN_ATTRS
from dflash_trt.plugins.paged_attention import reference as attention_ref
from dflash_trt.plugins.paged_attention.spec import SPEC as ATTENTION
from dflash_trt.plugins.torch_util import dname, torch_dtype


def _exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def _cuda_ops(t):
    """torch.ops.dflash (our NVRTC kernels) for CUDA tensors, else None (reference math).
    Imported lazily: CPU-only installs never load cuda-python."""
    if not t.is_cuda:
        return None
    from dflash_trt.plugins import torch_ops  # noqa: F401  registers torch.ops.dflash.*

    return torch.ops.dflash


def _i32(t):
    """An index tensor as the kernels read it (int32). Nothing to do for the GPU step, which hands the model int32
    tensors cast once a step (torch_fused_step._index; opaque_ops.as_int32 says why a cast here would not do: under
    torch.compile it becomes one cast kernel per op call); other callers pay one cast per call."""
    return None if t is None else t.to(torch.int32)


def _rows_of(pool, slot):
    """pool[slot] (the reference and export read of a per-sequence state slot)."""
    return pool if slot is None else pool[slot]


def _node(spec, inputs, attrs: dict):
    """The `dflash::<Op>` node of `spec` on `inputs` (attributes by spec name; outputs typed by the spec)."""
    unknown = set(attrs) - set(spec.attr_kinds)
    if unknown:
        raise ValueError(f"{spec.name}: unknown attribute(s) {sorted(unknown)}")
    attrs = {k: (float(v) if spec.attr_kinds[k] == "float" else int(v)) for k, v in attrs.items()}
    dtypes = [torch_dtype(d) for d in spec.output_dtypes([dname(t) for t in inputs])]
    shapes = spec.output_shapes([list(t.shape) for t in inputs])
    return torch.onnx.ops.symbolic_multi_out(f"dflash::{spec.name}", list(inputs), {**attrs, **PLUGIN_ATTRS},
                                             dtypes=dtypes, shapes=shapes, version=OP_VERSION)


def gdn_chunk(q, k, v, a, b, A_log, dt_bias, state, scale=None, slot=None, valid_len=None):
    """The model's gates (reference.gdn_gates of the raw columns a, b [B,T,Hv] with A_log, dt_bias [Hv]), then
    GdnChunkWY16: returns GdnOut(o, state, k_hat, v, g, beta); `state` is read-only: [B,Hv,dk,dv], or with `slot`
    [B] a pool layer [slots,Hv,dk,dv] whose rows slot[b] are the states. q, k, v in the model's dtype. The op computes
    in fp32 (q, k, v cast as the spec's reference does); o comes back in q's dtype on CUDA (the kernel rounds its
    fp32 sums once, as the cast of an fp32 o would) and fp32 elsewhere.
    valid_len [B] (prefill): rows t >= valid_len[b] are padding; their raw gates become spec.IDENTITY_GATE (g = 0,
    beta = 0: the row leaves the state as it is), so GdnOut.state is the state after the valid rows.
    CUDA: one kernel, gates included: it reads q, k, v in place (slices of the conv output), a and b in place
    (columns of the input projection) and the state straight from the pool slot: no gate, cast, gather or copy
    kernel before it. Export keeps the gates as plain ops before the GdnChunkWY16 node (the op's spec)."""
    if valid_len is not None:
        pad = (torch.arange(a.shape[1], device=a.device)[None, :] >= valid_len.reshape(-1, 1))[..., None]
        a, b = a.masked_fill(pad, IDENTITY_GATE), b.masked_fill(pad, IDENTITY_GATE)
    dflash = None if _exporting() else _cuda_ops(q)
    if dflash is not None:
        o, k_hat, v_f, g_f, b_f, fs = dflash.gdn_wy16(q, k, v, a, b, state.float(), _i32(slot), scale,
                                                      valid_len is not None, A_log, dt_bias)
        return gdn_ref.GdnOut(o, fs if valid_len is not None else None, k_hat, v_f, g_f, b_f)
    g, beta = gdn_ref.gdn_gates(a, b, A_log, dt_bias)
    q, k, v, g, beta, state = (t.float() for t in (q, k, v, g, beta, _rows_of(state, slot)))
    if _exporting():
        dk = q.shape[3]
        return gdn_ref.GdnOut(*_node(GDN, (q, k, v, g, beta, state), {"scale": dk ** -0.5 if scale is None else scale}))
    return gdn_ref.gdn_chunk_wy16(q, k, v, g, beta, state, scale=scale)


def conv_verify(x, conv_state, weight, slot=None):
    """CausalConvVerify: silu(depthwise causal conv over [conv_state | x]); conv_state read-only: [B,C,W-1], or with
    `slot` [B] a pool layer [slots,C,W-1] whose rows slot[b] are the states (CUDA reads them in place)."""
    dflash = None if _exporting() else _cuda_ops(x)
    if dflash is not None:
        if conv_state.dtype != x.dtype:  # the kernel's output dtype follows its inputs': cast the rows first
            conv_state, slot = _rows_of(conv_state, slot).to(x.dtype), None
        return dflash.conv_verify(x, conv_state, weight, _i32(slot))
    conv_state = _rows_of(conv_state, slot).to(x.dtype)
    if _exporting():
        return _node(CONV, (x, conv_state, weight), {})[0]
    return conv_ref.conv_verify(x, conv_state, weight)


def paged_attention(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale, window=0):
    """PagedAttention over cached rows [kv_start, kv_len) in pages plus the T new rows (window > 0: sliding)."""
    if _exporting():
        attrs = {"layer": layer, "causal": bool(causal), "scale": scale, "window": int(window)}
        return _node(ATTENTION, (q, k_new, v_new, kv_pool, block_table, kv_start, kv_len), attrs)[0]
    dflash = _cuda_ops(q)
    if dflash is not None:
        return dflash.paged_attention(q, k_new, v_new, kv_pool, int(layer), _i32(block_table), _i32(kv_start),
                                      _i32(kv_len), bool(causal), float(scale), int(window))
    return attention_ref.paged_attention_ref(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len,
                                             causal, scale, window)


def moe_experts(x, topk_idx, topk_w, gate_up, down):
    """MoeExperts: routed SwiGLU experts given the routing (plugins/moe/spec.py). CUDA tensors: the grouped-GEMM
    kernels (each selected expert's weights read once per call). Under export: one dflash::MoeExperts node (its
    body the dense combine for ORT; the same kernels as a TensorRT plugin). CPU: the dense-combine reference."""
    if _exporting():
        return _node(MOE, (x, topk_idx, topk_w, gate_up, down), {})[0]
    dflash = _cuda_ops(x)
    if dflash is not None:
        return dflash.moe_experts(x, topk_idx, topk_w, gate_up, down)
    return moe_ref.moe_experts(x, topk_idx, topk_w, gate_up, down)
