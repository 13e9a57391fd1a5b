"""The custom ops as the models call them: the one seam between the model math and its backends.

The torch modules (modeling/target.py, modeling/drafter.py) call only these functions, each defined in its op's
folder (plugins/<op>/seam.py, listed by the op's bundle) and gathered here from the registry. Under
`torch.onnx.export` each becomes one `dflash::<Op>` node whose name, attributes, output dtypes and shapes
come from the op's spec (plugins/<op>/spec.py; its semantics are the FunctionProto of the same name,
plugins/<op>/onnx_body.py). On CUDA tensors they call the dflash:: torch ops (our kernels); otherwise the
reference math (plugins/<op>/reference.py). What the seams share: plugins/seam_base.py.
"""
from __future__ import annotations

from dflash_trt.plugins.registry import bundles


def _seams() -> dict:
    out = {}
    for b in bundles():
        for name, fn in b.functions("seam").items():
            if name in out:
                raise RuntimeError(f"op folders {out[name].__module__} and {b.package} both define seam '{name}'")
            out[name] = fn
    return out


_SEAMS = _seams()
globals().update(_SEAMS)
__all__ = sorted(_SEAMS)
