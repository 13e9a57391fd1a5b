"""Model-local ONNX FunctionProtos of the dflash custom ops: the reference semantics in standard ONNX ops.

One body per op (DESIGN §3), shape-generic so the same body serves every graph and every K:
  GdnChunkWY16      export/gdn_ref.gdn_chunk_wy16 — T padded to a multiple of 16 (padded rows have
                    k̂ = v = β = g = 0, so they change nothing), then a Loop over chunks carrying S.
  CausalConvVerify  export/gdn_ref.conv_verify — windows gathered from [state | x], weighted sum, SiLU.
  PagedAttention    export/attention_ref.paged_attention_ref — gather every page of the block table
                    (O(max_ctx), correct), mask rows outside [kv_start, kv_len) (+ causal), softmax.
Math runs in float32 (the references' compute dtype); `o`/`y` come back in the input's dtype.
The node contract (inputs, outputs, attributes) is in export/ops.py.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

DOMAIN = "dflash"
OP_VERSION = 1
F32 = TensorProto.FLOAT
CHUNK = 16

# op -> (inputs, outputs, own attributes {name: (type, default)}); OUT_LIKE: the input each output's
# shape equals. The first output has the first input's dtype, the others are float32.
SIGNATURES = {
    "GdnChunkWY16": (["q", "k", "v", "g", "beta", "state"], ["o", "state_out", "k_hat", "v_new", "gamma"],
                     {"scale": ("float", 0.0)}),
    "CausalConvVerify": (["x", "conv_state", "weight"], ["y"], {}),
    "PagedAttention": (["q", "k_new", "v_new", "kv_pool", "block_table", "kv_start", "kv_len"], ["o"],
                       {"layer": ("int", 0), "causal": ("int", 1), "scale": ("float", 0.0)}),
}
# scale 0 means head_dim ** -0.5 (as in the TensorRT plugins).
OUT_LIKE = {"GdnChunkWY16": ["v", "state", "k", "v", "g"], "CausalConvVerify": ["x"], "PagedAttention": ["q"]}
_ATYPE = {"float": AttributeProto.FLOAT, "int": AttributeProto.INT, "string": AttributeProto.STRING}


class _Body:
    """Minimal SSA builder: op() appends a node and returns its output name(s)."""

    def __init__(self, tag: str):
        self.tag, self.nodes, self._n = tag, [], 0

    def name(self) -> str:
        self._n += 1
        return f"{self.tag}_{self._n}"

    def op(self, op_type, *ins, n_out=1, **attrs):
        outs = [self.name() for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(ins), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.int64):
        return self.op("Constant", value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    def attr(self, name: str, kind: str):
        """A scalar Constant whose value is the function attribute `name` (an attribute reference)."""
        out = self.name()
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(AttributeProto(name="value_" + kind, ref_attr_name=name, type=_ATYPE[kind]))
        self.nodes.append(node)
        return out

    def scale(self, x):
        """The `scale` attribute, or x.shape[-1] ** -0.5 when it is 0."""
        s = self.attr("scale", "float")
        d = self.op("Cast", self.op("Shape", x, start=-1), to=F32)
        dflt = self.op("Squeeze", self.op("Pow", d, self.const(-0.5, np.float32)), self.const([0]))
        return self.op("Where", self.op("Equal", s, self.const(0.0, np.float32)), dflt, s)

    def dims(self, x, start, end):
        """Shape(x)[start:end] as a 1-D int64 tensor."""
        return self.op("Shape", x, start=start, end=end)

    def unsq(self, x, *axes):
        return self.op("Unsqueeze", x, self.const(list(axes)))

    def t(self, x, *perm):
        return self.op("Transpose", x, perm=list(perm))


def _l2norm(b: _Body, x):
    ss = b.op("ReduceSum", b.op("Mul", x, x), b.const([-1]), keepdims=1)
    return b.op("Mul", x, b.op("Reciprocal", b.op("Sqrt", b.op("Add", ss, b.const(1e-6, np.float32)))))


def _expand_heads(b: _Body, x, hv, r):
    """[B,T,Hk,d] -> [B,T,Hv,d]: value head h reads key head h // r (repeat_interleave)."""
    shape5 = b.op("Concat", b.dims(x, 0, 3), r, b.dims(x, 3, 4), axis=0)
    x5 = b.op("Expand", b.unsq(x, 3), shape5)
    return b.op("Reshape", x5, b.op("Concat", b.dims(x, 0, 2), hv, b.dims(x, 3, 4), axis=0))


def _gdn_chunk_body(b: _Body):
    q, k, v, g, beta, state = (b.op("Cast", x, to=F32) for x in SIGNATURES["GdnChunkWY16"][0])
    k_hat = _l2norm(b, k)
    q_hat = b.op("Mul", _l2norm(b, q), b.scale(q))
    hv, hk = b.dims(v, 2, 3), b.dims(k, 2, 3)
    r = b.op("Div", hv, hk)
    qx, kx = _expand_heads(b, q_hat, hv, r), _expand_heads(b, k_hat, hv, r)
    gamma = b.op("CumSum", g, b.const(1))
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

    # Loop body: one chunk; carries S, scans O and V' rows.
    lb = _Body(b.tag + "_loop")
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
        [vi(cond_out, TensorProto.BOOL, []), vi(S2, F32, None), vi(O, F32, None), vi(Vn, F32, None)])
    trip = b.op("Squeeze", nC, b.const([0]))
    S_fin, O_all, Vn_all = b.op("Loop", trip, b.const(True, bool), state, n_out=3, body=body)

    def unchunk(x):  # [nC,B,Hv,16,d] -> [B,T,Hv,d]
        shape = b.op("Concat", b.const([0, 0, -1]), b.dims(x, 4, 5), axis=0)
        xm = b.op("Reshape", b.t(x, 1, 2, 0, 3, 4), shape)
        return b.t(b.op("Slice", xm, b.const([0]), T, ax2), 0, 2, 1, 3)

    o = b.op("CastLike", unchunk(O_all), "q")
    return [o, S_fin, k_hat, unchunk(Vn_all), gamma]


def _conv_body(b: _Body):
    x = b.op("Identity", "x")
    st, w = b.op("CastLike", "conv_state", x), b.op("CastLike", "weight", x)
    full = b.op("Concat", st, b.t(x, 0, 2, 1), axis=-1)  # [B,C,W-1+T]

    def rng(n):
        return b.op("Range", b.const(0), b.op("Squeeze", n, b.const([0])), b.const(1))

    idx = b.op("Add", b.unsq(rng(b.dims(x, 1, 2)), 1), b.unsq(rng(b.dims(w, 1, 2)), 0))  # [T,W]: t + j
    win = b.op("Gather", full, idx, axis=2)  # [B,C,T,W]
    y = b.op("ReduceSum", b.op("Mul", win, b.unsq(w, 1)), b.const([-1]), keepdims=0)
    return [b.t(b.op("Mul", y, b.op("Sigmoid", y)), 0, 2, 1)]


def _paged_attention_body(b: _Body):
    q, kn, vn = (b.op("Cast", x, to=F32) for x in ("q", "k_new", "v_new"))
    pool = b.op("Gather", "kv_pool", b.attr("layer", "int"), axis=0)  # [2,NB,bs,Hkv,hd]
    rows_shape = b.op("Concat", b.const([0, -1]), b.dims(kn, 2, 4), axis=0)

    def cached(i):  # all pages of the block table -> [B, MB*bs, Hkv, hd]
        pages = b.op("Gather", b.op("Gather", pool, b.const(i), axis=0), "block_table", axis=0)
        return b.op("Cast", b.op("Reshape", pages, rows_shape), to=F32)

    Kc, Vc = cached(0), cached(1)
    K, V = b.op("Concat", Kc, kn, axis=1), b.op("Concat", Vc, vn, axis=1)  # [B,S,Hkv,hd]
    # mask [B,T,S]: cached row j visible iff kv_start <= j < kv_len; new row s <= t when causal
    Sc = b.dims(Kc, 1, 2)
    T = b.dims(q, 1, 2)

    def rng(n):
        return b.op("Range", b.const(0), b.op("Squeeze", n, b.const([0])), b.const(1))

    j = b.unsq(rng(Sc), 0)
    ks, kl = (b.unsq(b.op("Cast", x, to=TensorProto.INT64), 1) for x in ("kv_start", "kv_len"))
    vis = b.op("And", b.op("GreaterOrEqual", j, ks), b.op("Less", j, kl))  # [B,Sc]
    vis = b.op("Expand", b.unsq(vis, 1), b.op("Concat", b.dims(q, 0, 2), Sc, axis=0))
    t = rng(T)
    causal = b.op("LessOrEqual", b.unsq(t, 0), b.unsq(t, 1))  # [T,T]: s <= t
    new = b.op("Or", causal, b.op("Equal", b.attr("causal", "int"), b.const(0)))
    new = b.op("Expand", b.unsq(new, 0), b.op("Concat", b.dims(q, 0, 2), T, axis=0))
    mask = b.unsq(b.op("Concat", vis, new, axis=2), 1, 2)  # [B,1,1,T,S]
    # GQA: q-head h = kv-head h // r -> q as [B,Hkv,r,T,hd]
    q5 = b.op("Reshape", q, b.op("Concat", b.const([0, 0]), b.dims(kn, 2, 3), b.const([-1]), b.dims(q, 3, 4), axis=0))
    q5 = b.t(q5, 0, 2, 3, 1, 4)
    K5 = b.unsq(b.t(K, 0, 2, 3, 1), 2)  # [B,Hkv,1,hd,S]
    s = b.op("Mul", b.op("MatMul", q5, K5), b.scale(q))
    p = b.op("Softmax", b.op("Where", mask, s, b.const(-np.inf, np.float32)), axis=-1)
    o = b.op("MatMul", p, b.unsq(b.t(V, 0, 2, 1, 3), 2))  # [B,Hkv,r,T,hd]
    o = b.op("Reshape", b.t(o, 0, 3, 1, 2, 4), b.op("Shape", "q"))
    return [b.op("CastLike", o, "q")]


_BODIES = {"GdnChunkWY16": _gdn_chunk_body, "CausalConvVerify": _conv_body, "PagedAttention": _paged_attention_body}


def make_function(op: str, opset: int) -> onnx.FunctionProto:
    """The FunctionProto `dflash::<op>` with body in standard ONNX ops of the given default-domain opset."""
    ins, outs, own = SIGNATURES[op]
    b = _Body(op)
    res = _BODIES[op](b)
    for name, val in zip(outs, res):
        b.nodes.append(helper.make_node("Identity", [val], [name]))
    attrs = [helper.make_attribute("plugin_namespace", DOMAIN), helper.make_attribute("plugin_version", "1")]
    plain = []
    for name, (kind, default) in own.items():
        if default is None:
            plain.append(name)
        else:
            attrs.append(helper.make_attribute(name, default))
    return helper.make_function(DOMAIN, op, ins, outs, b.nodes, [helper.make_opsetid("", opset)],
                                attributes=plain, attribute_protos=attrs)


def default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def add_functions(model: onnx.ModelProto) -> list[str]:
    """Append the body of every dflash op the graph uses (once each); returns the op names added."""
    used = sorted({n.op_type for n in model.graph.node if n.domain == DOMAIN})
    unknown = [u for u in used if u not in SIGNATURES]
    if unknown:
        raise ValueError(f"graph uses unknown dflash op(s) {unknown}; known: {sorted(SIGNATURES)}")
    have = {f.name for f in model.functions if f.domain == DOMAIN}
    opset = default_opset(model)
    for op in used:
        if op not in have:
            model.functions.append(make_function(op, opset))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OP_VERSION))
    return used


def single_op_model(op: str, inputs: dict, attrs: dict | None = None, opset: int = 20) -> onnx.ModelProto:
    """A model holding one dflash node (plugin attributes included) + its function: for op-level tests
    of the body (ORT) and of the plugins (TRT) against the torch references. inputs: name -> numpy array."""
    ins, outs, _ = SIGNATURES[op]
    if list(inputs) != ins:
        raise ValueError(f"{op} takes inputs {ins}, got {list(inputs)}")
    first = helper.np_dtype_to_tensor_dtype(inputs[ins[0]].dtype)  # o / y: the first input's dtype; rest fp32
    node = helper.make_node(op, ins, outs, domain=DOMAIN, plugin_namespace=DOMAIN, plugin_version="1", **(attrs or {}))
    g = helper.make_graph(
        [node], f"{op}_test",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in inputs.items()],
        [helper.make_tensor_value_info(n, first if i == 0 else TensorProto.FLOAT, inputs[like].shape)
         for i, (n, like) in enumerate(zip(outs, OUT_LIKE[op]))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, OP_VERSION)],
                          ir_version=10)  # what onnxruntime >= 1.17 and TensorRT parsers read
    add_functions(m)
    return m
