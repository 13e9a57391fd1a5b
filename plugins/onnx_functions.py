"""Model-local ONNX FunctionProtos of the dflash custom ops (DESIGN §3): each op's body in standard ONNX ops
(plugins/<op>/onnx_body.py, as the registry's bundles name it) wrapped with the signature of its spec. ONNX
Runtime inlines the bodies; TensorRT uses them when no plugin creator is registered.

add_functions(model): appends the body of every dflash op a graph uses. single_op_model(op, inputs):
a one-node model for op-level tests of the body (ORT) and of the plugins (TensorRT).
"""
from __future__ import annotations

import onnx
from onnx import helper

from dflash_trt.plugins.onnx_builder import Body
from dflash_trt.plugins.opspec import DOMAIN, OP_VERSION, PLUGIN_ATTRS
from dflash_trt.plugins.registry import onnx_bundles

SPECS = {b.spec.name: b.spec for b in onnx_bundles()}
_BODIES = {b.spec.name: b.onnx_body_fn() for b in onnx_bundles()}


def make_function(op: str, opset: int) -> onnx.FunctionProto:
    """The FunctionProto `dflash::<op>` with body in standard ONNX ops of the given default-domain opset."""
    spec = SPECS[op]
    b = Body(op)
    res = _BODIES[op](b)
    for name, val in zip(spec.output_names, res):
        b.nodes.append(helper.make_node("Identity", [val], [name]))
    attrs = [helper.make_attribute(k, v) for k, v in PLUGIN_ATTRS.items()]
    attrs += [helper.make_attribute(a.name, float(a.default) if a.kind == "float" else int(a.default))
              for a in spec.attrs]
    return helper.make_function(DOMAIN, op, spec.input_names, spec.output_names, b.nodes,
                                [helper.make_opsetid("", opset)], attribute_protos=attrs)


def default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def add_functions(model: onnx.ModelProto) -> list[str]:
    """Append the body of every dflash op the graph uses (once each); returns the op names added."""
    used = sorted({n.op_type for n in model.graph.node if n.domain == DOMAIN})
    unknown = [u for u in used if u not in SPECS]
    if unknown:
        raise ValueError(f"graph uses unknown dflash op(s) {unknown}; known: {sorted(SPECS)}")
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
    spec = SPECS[op]
    ins, outs = spec.input_names, spec.output_names
    if list(inputs) != ins:
        raise ValueError(f"{op} takes inputs {ins}, got {list(inputs)}")
    in_types = [helper.np_dtype_to_tensor_dtype(a.dtype) for a in inputs.values()]
    out_shapes = spec.output_shapes([list(a.shape) for a in inputs.values()])
    node = helper.make_node(op, ins, outs, domain=DOMAIN, **PLUGIN_ATTRS, **(attrs or {}))
    g = helper.make_graph(
        [node], f"{op}_test",
        [helper.make_tensor_value_info(n, t, a.shape) for (n, a), t in zip(inputs.items(), in_types)],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(outs, spec.output_dtypes(in_types), out_shapes)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, OP_VERSION)],
                          ir_version=10)  # what onnxruntime >= 1.17 and TensorRT parsers read
    add_functions(m)
    return m
