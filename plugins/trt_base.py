"""The IPluginV3 plumbing shared by the ops' TensorRT plugins (plugins/<op>/trt_plugin.py; namespace "dflash",
version "1"). A plugin class names its op's spec (SPEC) and implements ``launch``: I/O, dtype groups,
attributes, output shapes, shape checks and kernel limits all come from the spec.

``enqueue`` calls the NVRTC launchers with TensorRT's pointers on TensorRT's stream. Everything it needs
is derived from the descriptors TensorRT passes in: no allocation (int64 index tensors are narrowed into
TensorRT's workspace with one async strided copy), no host sync, no Python state that changes between
launches — so a CUDA graph captured around ``execute_async_v3`` replays it without Python. Kernel modules
are NVRTC-built and loaded on the first launch: execute once before capturing (as for TensorRT itself).
Without TensorRT the classes derive from ``object`` (see trt_compat) so ``enqueue`` can be driven
directly with device pointers, as the GPU tests do.
"""
from __future__ import annotations

import numpy as np

from dflash_trt.plugins import trt_compat as C
from dflash_trt.plugins.opspec import DOMAIN, OP_VERSION, ShapeError

NAMESPACE, VERSION = DOMAIN, str(OP_VERSION)
WORKSPACE_ALIGN = 256


def ws_align(nbytes: int) -> int:
    """nbytes rounded up to WORKSPACE_ALIGN: where the next part of a plugin's workspace starts."""
    return -(-int(nbytes) // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
# Found while building, (op, message); read and cleared by engines/build.py. configure_plugin never
# raises into TensorRT (an exception there can abort the whole process): it records instead.
KERNEL_WARNINGS: list = []  # shapes/dtypes the CUDA kernels cannot run (engine still builds)
SHAPE_ERRORS: list = []     # inputs that do not fit the op's signature (the build must fail)


def _dims(d) -> tuple:
    return tuple(int(x) for x in d.dims)


def _field_value(data):
    return np.asarray(data).reshape(-1)[0].item()


def narrow_i64(dst: int, src: int, n: int, stream: int) -> None:
    """dst[i] = (int32) src[i] for n int64 values: the low words, one strided async device copy."""
    from cuda.bindings import driver as cu

    m = cu.CUDA_MEMCPY2D()
    m.srcMemoryType = m.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcDevice, m.srcPitch, m.dstDevice, m.dstPitch = src, 8, dst, 4
    m.WidthInBytes, m.Height = 4, n
    err = cu.cuMemcpy2DAsync(m, cu.CUstream(int(stream)))
    err = err[0] if isinstance(err, tuple) else err
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpy2DAsync (int64 -> int32 index narrowing) failed: {err}")


class DflashPlugin(*C.PLUGIN_BASES):
    """Shared IPluginV3 plumbing; subclasses set SPEC (an OpSpec) and implement launch()."""

    SPEC = None

    def __init__(self, fields=None, phase=None):
        C.init_bases(self, C.PLUGIN_BASES)
        spec = self.SPEC
        self.plugin_name, self.plugin_namespace, self.plugin_version = spec.name, NAMESPACE, VERSION
        self.num_outputs = len(spec.outputs)
        self.timing_cache_id = ""
        self.format_combination_limit = 64
        self.phase = phase
        kinds = spec.attr_kinds
        self.attrs = {k: (float(v) if kinds[k] == "float" else int(v)) for k, v in spec.attr_defaults.items()}
        for k, v in (fields or {}).items():
            if k not in kinds:
                raise ShapeError(f"{spec.name}: unknown attribute {k!r} (expected {sorted(kinds)})")
            self.attrs[k] = float(v) if kinds[k] == "float" else int(v)
        self.metadata_string = f"{spec.name} {self.attrs}"

    # ---- core
    def get_capability_interface(self, type):
        return self

    def clone(self):
        return type(self)(dict(self.attrs), self.phase)

    def get_fields_to_serialize(self):
        self._field_data = []  # TensorRT reads the buffers after this returns
        return C.plugin_fields(self.attrs, self.SPEC.attr_kinds, self._field_data)

    def destroy(self):
        pass

    # ---- build
    def get_output_data_types(self, input_types):
        return [C.data_type(t) if isinstance(t, str) else t for t in self.SPEC.output_dtypes(list(input_types))]

    def get_output_shapes(self, inputs, shape_inputs, expr_builder):
        return [C.dims_exprs(s) for s in self.output_shapes([list(x) for x in inputs])]

    def output_shapes(self, ins):
        """Input shapes (lists of dims or dim expressions) -> output shapes, in output order."""
        return self.SPEC.output_shapes(ins)

    def supports_format_combination(self, pos, in_out, num_inputs):
        d = in_out[pos].desc
        if d.format != C.TensorFormat.LINEAR:
            return False
        sig = self.SPEC.inputs + self.SPEC.outputs
        group = sig[pos].group
        if C.dtype_name(d.type) not in self.SPEC.groups[group]:
            return False
        return all(C.dtype_name(in_out[j].desc.type) == C.dtype_name(d.type) for j in range(pos) if sig[j].group == group)

    def configure_plugin(self, inp, out):
        dims = [_dims(x.desc) for x in inp]
        if any(v < 0 for s in dims for v in s):  # dynamic batch: check the profile's largest shapes
            dims = [tuple(int(v) for v in x.max) for x in inp]
        try:
            self.check_shapes(dims)
        except Exception as e:  # noqa: BLE001 — see SHAPE_ERRORS
            SHAPE_ERRORS.append((self.SPEC.name, str(e)))
            return
        try:
            self.kernel_check(dims, [C.dtype_name(x.desc.type) for x in inp])
        except Exception as e:  # noqa: BLE001
            KERNEL_WARNINGS.append((self.SPEC.name, str(e)))

    def check_shapes(self, dims):
        """ShapeError when the inputs do not fit the op's signature."""
        self.SPEC.check_shapes(dims, self.attrs)

    def kernel_check(self, dims, types):
        """KernelError when the CUDA kernel cannot run these shapes / dtypes (the spec's kernel limits)."""
        self.SPEC.check_kernel(dims, types)

    def get_workspace_size(self, inp, out):
        return self.workspace_bytes([tuple(int(v) for v in x.max) for x in inp],
                                    [C.dtype_name(x.desc.type) for x in inp])

    def workspace_bytes(self, dims, types) -> int:
        return 0

    def get_valid_tactics(self):
        return []

    def set_tactic(self, tactic):
        pass

    # ---- runtime
    def on_shape_change(self, inp, out):
        if self.phase == C.TensorRTPhase.RUNTIME:
            dims, types = [_dims(x) for x in inp], [C.dtype_name(x.type) for x in inp]
            self.check_shapes(dims)
            self.kernel_check(dims, types)  # a clear KernelError now rather than at the first launch

    def attach_to_context(self, context):
        return self.clone()

    def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
        self.launch([_dims(d) for d in input_desc], [C.dtype_name(d.type) for d in input_desc],
                    [C.dtype_name(d.type) for d in output_desc], [int(p) for p in inputs],
                    [int(p) for p in outputs], int(workspace or 0), int(stream))

    def launch(self, dims, in_types, out_types, inputs, outputs, workspace, stream):
        raise NotImplementedError


class DflashPluginCreator(*C.CREATOR_BASES):
    """IPluginCreatorV3One for one op: builds plugins from ONNX node attributes / serialized fields."""

    def __init__(self, plugin_cls):
        C.init_bases(self, C.CREATOR_BASES)
        self.plugin_cls = plugin_cls
        self.name, self.plugin_namespace, self.plugin_version = plugin_cls.SPEC.name, NAMESPACE, VERSION
        kinds = plugin_cls.SPEC.attr_kinds
        self._field_data = []
        self.field_names = C.plugin_fields({k: 0 for k in kinds}, kinds, self._field_data)

    def create_plugin(self, name, fc, phase):
        if isinstance(fc, dict):
            fields = dict(fc)
        else:
            fields = {f.name: _field_value(f.data) for f in fc if f.name not in ("plugin_namespace", "plugin_version")}
        return self.plugin_cls(fields, phase)
