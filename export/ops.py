"""The three custom ops as the models call them: one seam between the model math and its backends.

The torch modules (target.py, drafter.py) call only these functions. Eagerly each runs the reference
math; under `torch.onnx.export` each becomes one `dflash::<Op>` node (DESIGN §3, §6) whose semantics
are given by the model-local FunctionProto of the same name (export/onnx_functions.py). The node
signatures below are the contract the ONNX function bodies and the TensorRT plugins implement:

  GdnChunkWY16(q, k, v, g, beta, state; scale)            -> o, state_out, k_hat, v_new, gamma
  CausalConvVerify(x, conv_state, weight)                  -> y
  PagedAttention(q, k_new, v_new, kv_pool, block_table, kv_start, kv_len; layer, causal, scale) -> o
"""
from __future__ import annotations

import torch

from dflash_trt.export import attention_ref, gdn_ref

PLUGIN_ATTRS = {"plugin_namespace": "dflash", "plugin_version": "1"}


def _exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def _cuda_ops(t):
    """torch.ops.dflash (our NVRTC kernels) for CUDA tensors, else None (reference math).
    Imported lazily: CPU-only installs never load cuda-python."""
    if not t.is_cuda:
        return None
    from dflash_trt.plugins import torch_ops  # noqa: F401  registers torch.ops.dflash.*

    return torch.ops.dflash


def _node(op: str, inputs, attrs: dict, dtypes, shapes):
    return torch.onnx.ops.symbolic_multi_out(
        f"dflash::{op}", list(inputs), {**attrs, **PLUGIN_ATTRS}, dtypes=list(dtypes), shapes=list(shapes), version=1
    )


def gdn_chunk(q, k, v, g, beta, state, scale=None):
    """GdnChunkWY16: returns GdnOut(o, state, k_hat, v_new, gamma); `state` is read-only."""
    if _exporting():
        B, T, Hk, dk = q.shape
        Hv, dv = v.shape[2], v.shape[3]
        f = torch.float32
        outs = _node("GdnChunkWY16", (q, k, v, g, beta, state), {"scale": float(dk ** -0.5 if scale is None else scale)},
                     (q.dtype, f, f, f, f),
                     ([B, T, Hv, dv], [B, Hv, dk, dv], [B, T, Hk, dk], [B, T, Hv, dv], [B, T, Hv]))
        return gdn_ref.GdnOut(*outs)
    dflash = _cuda_ops(q)
    if dflash is not None:
        o, k_hat, v_new, gamma, _ = dflash.gdn_wy16(q, k, v, g, beta, state, None, scale, False)
        return gdn_ref.GdnOut(o, None, k_hat, v_new, gamma)
    return gdn_ref.gdn_chunk_wy16(q, k, v, g, beta, state, scale=scale)


def gdn_fold(state, k_hat, v_new, gamma, n):
    """State after the first n[b] rows of fold data (a new tensor; `state` is not modified)."""
    dflash = _cuda_ops(state)
    if dflash is not None:
        out = state.float().clone()
        dflash.gdn_fold(out, None, k_hat, v_new, gamma, n)
        return out
    return gdn_ref.gdn_fold(state, k_hat, v_new, gamma, n)


def conv_verify(x, conv_state, weight):
    """CausalConvVerify: silu(depthwise causal conv over [conv_state | x]); conv_state read-only."""
    if _exporting():
        return _node("CausalConvVerify", (x, conv_state, weight), {}, (x.dtype,), (x.shape,))[0]
    dflash = _cuda_ops(x)
    if dflash is not None:
        return dflash.conv_verify(x, conv_state, weight, None)
    return gdn_ref.conv_verify(x, conv_state, weight)


def paged_attention(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale):
    """PagedAttention over cached rows [kv_start, kv_len) in pages plus the T new rows."""
    if _exporting():
        attrs = {"layer": int(layer), "causal": int(bool(causal)), "scale": float(scale)}
        return _node("PagedAttention", (q, k_new, v_new, kv_pool, block_table, kv_start, kv_len), attrs,
                     (q.dtype,), (q.shape,))[0]
    dflash = _cuda_ops(q)
    if dflash is not None:
        return dflash.paged_attention(q, k_new, v_new, kv_pool, int(layer), block_table, kv_start, kv_len,
                                      bool(causal), float(scale))
    return attention_ref.paged_attention_ref(
        q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale
    )
