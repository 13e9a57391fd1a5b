"""The ONNX function body of PagedAttention in standard ONNX ops: reference.paged_attention_ref — gather the pages
of the block table up to the longest kv_len (O(context)), mask rows outside [kv_start, kv_len) (+ causal), softmax
in float32; o in q's dtype."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from dflash_trt.plugins.onnx_builder import F32, Body
from dflash_trt.plugins.paged_attention.spec import SPEC


def body(b: Body):
    """PagedAttention -> [o]."""
    q_in, k_in, v_in, pool_in, bt_in, ks_in, kl_in = SPEC.input_names
    q, kn, vn = (b.op("Cast", x, to=F32) for x in (q_in, k_in, v_in))
    pool = b.op("Gather", pool_in, b.attr("layer", "int"), axis=0)  # [2,NB,bs,Hkv,hd]
    rows_shape = b.op("Concat", b.const([0, -1]), b.dims(kn, 2, 4), axis=0)

    # only the pages up to the longest kv_len: every later row is masked, so the cost follows the context, not
    # the table's width (max_seq_len)
    bs = b.dims(pool, 2, 3)
    longest = b.op("ReduceMax", b.op("Cast", kl_in, to=TensorProto.INT64), keepdims=1)  # [1]
    used = b.op("Min", b.op("Div", b.op("Add", longest, b.op("Sub", bs, b.const([1]))), bs), b.dims(bt_in, 1, 2))
    bt = b.op("Slice", bt_in, b.const([0]), used, b.const([1]))

    def cached(i):  # the used pages of the block table -> [B, used*bs, Hkv, hd]
        pages = b.op("Gather", b.op("Gather", pool, b.const(i), axis=0), bt, axis=0)
        return b.op("Cast", b.op("Reshape", pages, rows_shape), to=F32)

    Kc, Vc = cached(0), cached(1)
    K, V = b.op("Concat", Kc, kn, axis=1), b.op("Concat", Vc, vn, axis=1)  # [B,S,Hkv,hd]
    # mask [B,T,S]: cached row j visible iff kv_start <= j < kv_len; new row s <= t when causal
    Sc = b.dims(Kc, 1, 2)
    T = b.dims(q, 1, 2)
    j = b.unsq(b.arange(Sc), 0)
    ks, kl = (b.unsq(b.op("Cast", x, to=TensorProto.INT64), 1) for x in (ks_in, kl_in))
    vis = b.op("And", b.op("GreaterOrEqual", j, ks), b.op("Less", j, kl))  # [B,Sc]
    vis = b.op("Expand", b.unsq(vis, 1), b.op("Concat", b.dims(q, 0, 2), Sc, axis=0))
    t = b.arange(T)
    causal = b.op("LessOrEqual", b.unsq(t, 0), b.unsq(t, 1))  # [T,T]: s <= t
    new = b.op("Or", causal, b.op("Equal", b.attr("causal", "int"), b.const(0)))
    new = b.op("Expand", b.unsq(new, 0), b.op("Concat", b.dims(q, 0, 2), T, axis=0))
    mask = b.op("Concat", vis, new, axis=2)  # [B,T,S]
    # window W > 0: key index s (cached rows counted from kv_start, then the new rows) visible to row t iff
    # (kv_len - kv_start) + t - s < W. Cached column j is key index j - kv_start; new column Sc + u is
    # key index Lc + u. Written as one distance per column: window 0 keeps every column.
    Lc = b.op("Sub", kl, ks)  # [B,1]
    qi = b.op("Add", Lc, b.unsq(t, 0))  # [B,T] key index of row t
    kidx = b.op("Concat", b.op("Sub", j, ks), b.op("Add", Lc, b.unsq(t, 0)), axis=1)  # [B,S]
    dist = b.op("Sub", b.unsq(qi, 2), b.unsq(kidx, 1))  # [B,T,S]
    W = b.attr("window", "int")
    inwin = b.op("Or", b.op("Less", dist, W), b.op("LessOrEqual", W, b.const(0)))
    mask = b.unsq(b.op("And", mask, inwin), 1, 2)  # [B,1,1,T,S]
    # GQA: q-head h = kv-head h // r -> q as [B,Hkv,r,T,hd]
    q5 = b.op("Reshape", q, b.op("Concat", b.const([0, 0]), b.dims(kn, 2, 3), b.const([-1]), b.dims(q, 3, 4), axis=0))
    q5 = b.t(q5, 0, 2, 3, 1, 4)
    K5 = b.unsq(b.t(K, 0, 2, 3, 1), 2)  # [B,Hkv,1,hd,S]
    s = b.op("Mul", b.op("MatMul", q5, K5), b.scale(q))
    p = b.op("Softmax", b.op("Where", mask, s, b.const(-np.inf, np.float32)), axis=-1)
    o = b.op("MatMul", p, b.unsq(b.t(V, 0, 2, 1, 3), 2))  # [B,Hkv,r,T,hd]
    o = b.op("Reshape", b.t(o, 0, 3, 1, 2, 4), b.op("Shape", q_in))
    return [b.op("CastLike", o, q_in)]
