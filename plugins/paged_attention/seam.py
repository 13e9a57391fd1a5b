"""paged_attention, as the models call it through plugins.ops."""
from __future__ import annotations

from dflash_trt.plugins import seam_base as S
from dflash_trt.plugins.paged_attention import reference as attention_ref
from dflash_trt.plugins.paged_attention.spec import SPEC


def paged_attention(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale, window=0):
    """PagedAttention over cached rows [kv_start, kv_len) in pages plus the T new rows (window > 0: sliding)."""
    if S.exporting():
        attrs = {"layer": layer, "causal": bool(causal), "scale": scale, "window": int(window)}
        return S.node(SPEC, (q, k_new, v_new, kv_pool, block_table, kv_start, kv_len), attrs)[0]
    dflash = S.cuda_ops(q)
    if dflash is not None:
        return dflash.paged_attention(q, k_new, v_new, kv_pool, int(layer), S.i32(block_table), S.i32(kv_start),
                                      S.i32(kv_len), bool(causal), float(scale), int(window))
    return attention_ref.paged_attention_ref(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len,
                                             causal, scale, window)
