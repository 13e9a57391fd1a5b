"""The ONNX function body of MoeExperts in standard ONNX ops: reference.moe_experts (dense combine) — every
expert on every token as one batched MatMul over E, mixed by the routing weights scattered into an [N,E]
combine matrix; in x's dtype. ONNX Runtime runs this; TensorRT runs the plugin (our grouped kernels) instead."""
from __future__ import annotations

from onnx import TensorProto

from dflash_trt.plugins.moe.spec import SPEC
from dflash_trt.plugins.onnx_builder import Body


def body(b: Body):
    """MoeExperts -> [y]."""
    x_in, idx_in, w_in, gate_up_in, down_in = SPEC.input_names
    x = b.op("Identity", x_in)
    gate_up, down, w = (b.op("CastLike", t, x) for t in (gate_up_in, down_in, w_in))
    idx = b.op("Cast", idx_in, to=TensorProto.INT64)
    zeros = b.op("CastLike", b.op("ConstantOfShape", b.op("Concat", b.dims(x, 0, 1), b.dims(gate_up, 0, 1), axis=0)), x)
    combine = b.op("ScatterElements", zeros, idx, w, axis=1)  # [N,E]: 0 where an expert was not selected
    gu = b.op("MatMul", b.unsq(x, 0), b.t(gate_up, 0, 2, 1))  # [1,N,H] @ [E,H,2I] -> [E,N,2I]
    inter = b.dims(down, 2, 3)
    gate, up = b.op("Split", gu, b.op("Concat", inter, inter, axis=0), axis=-1, n_out=2)
    h = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)  # silu(gate) * up
    y = b.op("MatMul", h, b.t(down, 0, 2, 1))  # [E,N,I] @ [E,I,H] -> [E,N,H]
    return [b.op("ReduceSum", b.op("Mul", y, b.unsq(b.t(combine, 1, 0), 2)), b.const([0]), keepdims=0)]
