"""The ONNX function body of CausalConvVerify in standard ONNX ops: reference.conv_verify — windows gathered
from [conv_state | x], weighted sum, SiLU; in x's dtype."""
from __future__ import annotations

from dflash_trt.plugins.conv.spec import SPEC
from dflash_trt.plugins.onnx_builder import Body


def body(b: Body):
    """CausalConvVerify -> [y]."""
    x_in, state_in, weight_in = SPEC.input_names
    x = b.op("Identity", x_in)
    st, w = b.op("CastLike", state_in, x), b.op("CastLike", weight_in, x)
    full = b.op("Concat", st, b.t(x, 0, 2, 1), axis=-1)  # [B,C,W-1+T]
    idx = b.op("Add", b.unsq(b.arange(b.dims(x, 1, 2)), 1), b.unsq(b.arange(b.dims(w, 1, 2)), 0))  # [T,W]: t + j
    win = b.op("Gather", full, idx, axis=2)  # [B,C,T,W]
    y = b.op("ReduceSum", b.op("Mul", win, b.unsq(w, 1)), b.const([-1]), keepdims=0)
    return [b.t(b.op("Mul", y, b.op("Sigmoid", y)), 0, 2, 1)]
