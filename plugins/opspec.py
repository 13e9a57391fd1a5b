"""The vocabulary every op folder is written in (pure python: no torch, onnx, cuda or tensorrt): its spec.py and
its bundle (the __init__.py).

An op's spec is ONE ``OpSpec``: its node signature (inputs, outputs, attributes), dtype groups, shape
rules and the CUDA kernel's limits. The seam (plugins/ops.py), the ONNX function body, the torch op, the
launcher and the TensorRT plugin all read it, so the contract is stated once.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

DOMAIN = "dflash"
OP_VERSION = 1
# On every node: TensorRT picks a plugin by these attributes (the parser flag alone does not, DESIGN §3).
PLUGIN_ATTRS = {"plugin_namespace": DOMAIN, "plugin_version": str(OP_VERSION)}
FLOATS = ("float32", "bfloat16", "float16")
INTS = ("int32", "int64")
# dtype codes the kernels take for runtime-typed tensors (DT_* in common.cuh)
KERNEL_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}
MIN_ARCH = (8, 0)  # bf16 cvt instructions in common.cuh


class KernelError(ValueError):
    """Unsupported shape / dtype / arch for a CUDA kernel (raised before any launch)."""


class ShapeError(ValueError):
    """A node's inputs are inconsistent with the op's signature."""


def need(cond, msg: str) -> None:
    if not cond:
        raise ShapeError(msg)


def kernel_need(cond, msg: str) -> None:
    if not cond:
        raise KernelError(msg)


def dtype_name(d) -> str:
    """'bfloat16' for 'bfloat16', 'torch.bfloat16' or torch.bfloat16 (no torch import here)."""
    return str(d).replace("torch.", "")


def dtype_code(name, what: str, allowed=tuple(KERNEL_DTYPES)) -> int:
    """The kernel dtype code of `name` ('bfloat16', 'torch.bfloat16', ...) or KernelError naming `what`."""
    name = dtype_name(name)
    if name not in allowed:
        raise KernelError(f"{what}: unsupported dtype {name}; supported: {', '.join(allowed)}")
    return KERNEL_DTYPES[name]


def check_arch(arch) -> None:
    if tuple(arch) < MIN_ARCH:
        raise KernelError(f"dflash kernels need compute capability >= 8.0 (bf16 cvt); device is sm_{arch[0]}{arch[1]}")


@dataclass(frozen=True)
class Port:
    name: str
    group: str   # dtype group: all ports of a group share one dtype per node
    shape: str   # documentation, e.g. "[B,T,Hk,dk]"


@dataclass(frozen=True)
class Attr:
    name: str
    kind: str    # "float" | "int"
    default: float | int
    doc: str = ""


@dataclass(frozen=True)
class OpSpec:
    """One custom op. ``output_shapes(in_shapes)`` works on ints or symbolic dims (torch, TensorRT);
    ``check_shapes(dims, attrs)`` raises ShapeError; ``check_kernel(dims, dtypes)`` raises KernelError
    when the CUDA kernel cannot run concrete input dims / dtype names."""

    name: str
    inputs: tuple
    outputs: tuple
    attrs: tuple
    groups: dict
    output_shapes: Callable
    check_shapes: Callable
    check_kernel: Callable
    doc: str = ""
    cuda_defines: dict = field(default_factory=dict)  # -D macros of kernel.cu (limits the host also reads)

    @property
    def input_names(self) -> list:
        return [p.name for p in self.inputs]

    @property
    def output_names(self) -> list:
        return [p.name for p in self.outputs]

    @property
    def attr_kinds(self) -> dict:
        return {a.name: a.kind for a in self.attrs}

    @property
    def attr_defaults(self) -> dict:
        return {a.name: a.default for a in self.attrs}

    def group_dtype(self, input_dtypes, group: str):
        """A group's dtype: that of its first input, else the group's first allowed dtype."""
        for p, t in zip(self.inputs, input_dtypes):
            if p.group == group:
                return t
        return self.groups[group][0]

    def output_dtypes(self, input_dtypes) -> list:
        """Output dtype names (or TensorRT DataTypes, whatever the inputs are given as)."""
        dts = list(input_dtypes)
        return [self.group_dtype(dts, p.group) for p in self.outputs]

    def signature(self) -> str:
        attrs = "; " + ", ".join(a.name for a in self.attrs) if self.attrs else ""
        return f"{self.name}({', '.join(self.input_names)}{attrs}) -> {', '.join(self.output_names)}"


def check_float_dtypes(op: str, dtypes) -> None:
    """Every floating dtype among `dtypes` must be one the kernels load (KERNEL_DTYPES)."""
    for t in dtypes:
        t = dtype_name(t)
        if not t.startswith(("int", "uint", "bool")) and t not in KERNEL_DTYPES:
            raise KernelError(f"{op}: dtype {t} not supported by the kernels ({list(KERNEL_DTYPES)})")


def _load(package: str, ref: str):
    """'module' or 'module:attr' of `package`, imported on demand (torch, onnx and tensorrt load only when asked)."""
    mod, _, attr = ref.partition(":")
    m = importlib.import_module(f"{package}.{mod}")
    return getattr(m, attr) if attr else m


@dataclass(frozen=True)
class OpBundle:
    """Everything one op folder (plugins/<folder>/) provides, as `plugins.<folder>.BUNDLE`. The shared modules
    (ops, torch_ops, trt_plugins, onnx_functions, nvrtc, the host device) read these instead of naming ops.
    Parts are 'module' or 'module:attr' names inside the folder, imported only when asked for.

    folder       the folder's name: its package, and its kernel.cu compiled with spec.cuda_defines
    spec         the op's OpSpec (pure python)
    reference    the reference math (torch)
    launcher     the NVRTC launchers
    torch_op     the module whose import registers the folder's dflash:: torch ops
    onnx_body    the ONNX function body (None: a torch-only op, exported graphs keep standard ops)
    trt_plugin   the TensorRT plugin class (None: no plugin)
    seam         the functions the models call through plugins.ops
    host_twins   numpy twins of the folder's commit kernels: methods of the host device
    device_ops   the same commit kernels as methods of the torch device (torch ops; functions of (dev, ...))"""

    folder: str
    spec: OpSpec
    reference: str = "reference"
    launcher: str = "launch"
    torch_op: str = "torch_op"
    onnx_body: str | None = None
    trt_plugin: str | None = None
    seam: tuple = ()
    host_twins: tuple = ()
    device_ops: tuple = ()

    @property
    def package(self) -> str:
        return f"dflash_trt.plugins.{self.folder}"

    def load(self, ref: str):
        return _load(self.package, ref)

    def onnx_body_fn(self):
        return self.load(self.onnx_body)

    def trt_plugin_class(self):
        return self.load(self.trt_plugin)

    def register_torch_ops(self):
        return self.load(self.torch_op)

    def functions(self, part: str) -> dict:
        """name -> function of one of the tuple parts (seam, host_twins, device_ops)."""
        return {ref.rpartition(":")[2]: self.load(ref) for ref in getattr(self, part)}
