"""The ONNX function body of GdnChunkWY16 in standard ONNX ops: reference.gdn_chunk_wy16.

Shape-generic (every graph, every K): T is padded to a multiple of 16 (padded rows have k̂ = v = β = g = 0,
so they change nothing), then a Loop over chunks carries S. Math in float32; o comes back in q's dtype.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from dflash_trt.plugins.gdn.spec import CHUNK, L2NORM_EPS, SPEC
from dflash_trt.plugins.onnx_builder import F32, Body


def l2norm(b: Body, x):
    """reference.l2norm: eps inside the rsqrt."""
    ss = b.op("ReduceSum", b.op("Mul", x, x), b.const([-1]), keepdims=1)
    return b.op("Mul", x, b.op("Reciprocal", b.op("Sqrt", b.op("Add", ss, b.const(L2NORM_EPS, np.float32)))))


def expand_heads(b: Body, x, hv, r):
    """[B,T,Hk,d] -> [B,T,Hv,d]: value head h reads key head h // r (repeat_interleave)."""
    shape5 = b.op("Concat", b.dims(x, 0, 3), r, b.dims(x, 3, 4), axis=0)
    x5 = b.op("Expand", b.unsq(x, 3), shape5)
    return b.op("Reshape", x5, b.op("Concat", b.dims(x, 0, 2), hv, b.dims(x, 3, 4), axis=0))


def body(b: Body):
    """GdnChunkWY16 -> [o, state_out, k_hat, v_f32, g_f32, beta_f32] (the spec's output order)."""
    q, k, v, g, beta, state = (b.op("Cast", x, to=F32) for x in SPEC.input_names)
    k_hat = l2norm(b, k)
    q_hat = b.op("Mul", l2norm(b, q), b.scale(q))
    hv, hk = b.dims(v, 2, 3), b.dims(k, 2, 3)
    r = b.op("Div", hv, hk)
    qx, kx = expand_heads(b, q_hat, hv, r), expand_heads(b, k_hat, hv, r)
    # head-major [B,Hv,T,d], T padded to nC*16, chunk-first [nC,B,Hv,16,d]
    T = b.dims(v, 1, 2)
    c16 = b.const([CHUNK])
    pad = b.op("Mod", b.op("Sub", c16, b.op("Mod", T, c16)), c16)
    nC = b.op("Div", b.op("Add", T, pad), c16)
    pads, ax2 = b.op("Concat", b.const([0]), pad, axis=0), b.const([2])

    def chunked(x, d):
        xp = b.op("Pad", x, pads, "", ax2)
        shape = b.op("Concat", b.const([0, 0]), nC, b.const([CHUNK] + ([-1] if d else [])), axis=0)
        xc = b.op("Reshape", xp, shape)
        return b.t(xc, 2, 0, 1, 3, 4) if d else b.t(xc, 2, 0, 1, 3)

    Qa, Ka, Va = (chunked(b.t(x, 0, 2, 1, 3), True) for x in (qx, kx, v))
    Ga, Ba = (chunked(b.t(x, 0, 2, 1), False) for x in (g, beta))

    # Loop body: one chunk; carries S, scans O.
    lb = Body(b.tag + "_loop")
    it, cond, S = lb.name(), lb.name(), lb.name()
    Qc, Kc, Vc, gc, bc = (lb.op("Gather", x, it, axis=0) for x in (Qa, Ka, Va, Ga, Ba))
    gam = lb.op("CumSum", gc, lb.const(-1))
    diff = lb.op("Sub", lb.unsq(gam, -1), lb.unsq(gam, -2))
    tril = np.tril(np.ones((CHUNK, CHUNK), dtype=bool))
    decay = lb.op("Exp", lb.op("Where", lb.const(tril, bool), diff, lb.const(-np.inf, np.float32)))
    strict = lb.op("Mul", decay, lb.const(np.tril(np.ones((CHUNK, CHUNK)), -1), np.float32))
    KcT = lb.t(Kc, 0, 1, 3, 2)
    A = lb.op("Mul", lb.op("Mul", lb.unsq(bc, -1), lb.op("MatMul", Kc, KcT)), strict)
    eye = lb.const(np.eye(CHUNK), np.float32)
    Tm, P = lb.op("Sub", eye, A), A
    for _ in range(3):  # (I+A)^-1 = (I-A)(I+A^2)(I+A^4)(I+A^8)
        P = lb.op("MatMul", P, P)
        Tm = lb.op("MatMul", Tm, lb.op("Add", eye, P))
    eg = lb.op("Exp", gam)
    W = lb.op("MatMul", Tm, lb.op("Mul", lb.unsq(lb.op("Mul", bc, eg), -1), Kc))
    U = lb.op("MatMul", Tm, lb.op("Mul", lb.unsq(bc, -1), Vc))
    Vn = lb.op("Sub", U, lb.op("MatMul", W, S))
    intra = lb.op("MatMul", lb.op("Mul", lb.op("MatMul", Qc, KcT), decay), Vn)
    O = lb.op("Add", lb.op("Mul", lb.unsq(eg, -1), lb.op("MatMul", Qc, S)), intra)
    gC = lb.op("Slice", gam, lb.const([-1]), lb.const([np.iinfo(np.int64).max]), lb.const([-1]))
    carry = lb.op("MatMul", KcT, lb.op("Mul", lb.unsq(lb.op("Exp", lb.op("Sub", gC, gam)), -1), Vn))
    S2 = lb.op("Add", lb.op("Mul", lb.unsq(lb.op("Exp", gC), -1), S), carry)
    cond_out = lb.op("Identity", cond)
    vi = helper.make_tensor_value_info
    body = helper.make_graph(
        lb.nodes, "gdn_chunk_loop",
        [vi(it, TensorProto.INT64, []), vi(cond, TensorProto.BOOL, []), vi(S, F32, None)],
        [vi(cond_out, TensorProto.BOOL, []), vi(S2, F32, None), vi(O, F32, None)])
    trip = b.op("Squeeze", nC, b.const([0]))
    S_fin, O_all = b.op("Loop", trip, b.const(True, bool), state, n_out=2, body=body)

    def unchunk(x):  # [nC,B,Hv,16,d] -> [B,T,Hv,d]
        shape = b.op("Concat", b.const([0, 0, -1]), b.dims(x, 4, 5), axis=0)
        xm = b.op("Reshape", b.t(x, 1, 2, 0, 3, 4), shape)
        return b.t(b.op("Slice", xm, b.const([0]), T, ax2), 0, 2, 1, 3)

    o = b.op("CastLike", unchunk(O_all), SPEC.input_names[0])  # o in q's dtype
    return [o, S_fin, k_hat, v, g, beta]  # fold data: the row inputs in float32
