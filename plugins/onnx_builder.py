"""A minimal SSA builder for the ops' ONNX function bodies (each op's onnx_body.py): op() appends a node and
returns its output name(s); the body's formal inputs are referred to by their names in the op's spec."""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto, TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT
_ATYPE = {"float": AttributeProto.FLOAT, "int": AttributeProto.INT, "string": AttributeProto.STRING}


class Body:
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
        """The `scale` attribute, or x.shape[-1] ** -0.5 when it is 0 (the specs' convention)."""
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

    def arange(self, n):
        """0..n-1 for a 1-element int64 tensor n."""
        return self.op("Range", self.const(0), self.op("Squeeze", n, self.const([0])), self.const(1))
