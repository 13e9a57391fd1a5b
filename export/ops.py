"""The three custom ops as the models call them: one seam between the model math and its backends.

The torch modules (target.py, drafter.py) call only these functions. Today each runs the reference
math; the ONNX exporter and the CUDA torch ops hook in here (and nowhere else), so the model file
never changes when a backend is added.
"""
from __future__ import annotations

from . import attention_ref, gdn_ref


def gdn_chunk(q, k, v, g, beta, state, scale=None):
    """GdnChunkWY16: returns GdnOut(o, state, k_hat, v_new, gamma); `state` is read-only."""
    return gdn_ref.gdn_chunk_wy16(q, k, v, g, beta, state, scale=scale)


def gdn_fold(state, k_hat, v_new, gamma, n):
    return gdn_ref.gdn_fold(state, k_hat, v_new, gamma, n)


def conv_verify(x, conv_state, weight):
    """CausalConvVerify: silu(depthwise causal conv over [conv_state | x]); conv_state read-only."""
    return gdn_ref.conv_verify(x, conv_state, weight)


def paged_attention(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale):
    """PagedAttention over cached rows [kv_start, kv_len) in pages plus the T new rows."""
    return attention_ref.paged_attention_ref(
        q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale
    )
