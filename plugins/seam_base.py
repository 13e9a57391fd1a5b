"""What every op's seam (plugins/<op>/seam.py, reached through plugins.ops) shares: export detection, the CUDA
torch ops, index casts, slot reads and the `dflash::<Op>` node of a spec."""
from __future__ import annotations

import torch

from dflash_trt.plugins.opspec import OP_VERSION, PLUGIN_ATTRS
from dflash_trt.plugins.torch_util import dname, torch_dtype


def exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def cuda_ops(t):
    """torch.ops.dflash (our NVRTC kernels) for CUDA tensors, else None (reference math).
    Imported lazily: CPU-only installs never load cuda-python."""
    if not t.is_cuda:
        return None
    from dflash_trt.plugins import torch_ops  # noqa: F401  registers torch.ops.dflash.*

    return torch.ops.dflash


def i32(t):
    """An index tensor as the kernels read it (int32). Nothing to do for the GPU step, which hands the model int32
    tensors cast once a step (torch_fused_step._index; opaque_ops.as_int32 says why a cast here would not do: under
    torch.compile it becomes one cast kernel per op call); other callers pay one cast per call."""
    return None if t is None else t.to(torch.int32)


def rows_of(pool, slot):
    """pool[slot] (the reference and export read of a per-sequence state slot)."""
    return pool if slot is None else pool[slot]


def node(spec, inputs, attrs: dict):
    """The `dflash::<Op>` node of `spec` on `inputs` (attributes by spec name; outputs typed by the spec)."""
    unknown = set(attrs) - set(spec.attr_kinds)
    if unknown:
        raise ValueError(f"{spec.name}: unknown attribute(s) {sorted(unknown)}")
    attrs = {k: (float(v) if spec.attr_kinds[k] == "float" else int(v)) for k, v in attrs.items()}
    dtypes = [torch_dtype(d) for d in spec.output_dtypes([dname(t) for t in inputs])]
    shapes = spec.output_shapes([list(t.shape) for t in inputs])
    return torch.onnx.ops.symbolic_multi_out(f"dflash::{spec.name}", list(inputs), {**attrs, **PLUGIN_ATTRS},
                                             dtypes=dtypes, shapes=shapes, version=OP_VERSION)
