"""TensorRT IPluginV3 plugins for the dflash custom ops (DESIGN §3; namespace "dflash", version "1").

One class per op — GdnChunkWY16, CausalConvVerify, PagedAttention — with its IPluginCreatorV3One;
``register()`` puts the creators in TensorRT's plugin registry (before parsing an ONNX graph, and
before deserializing an engine). Node signatures are those of ``export/ops.py``:

  GdnChunkWY16(q, k, v, g, beta, state; scale)          -> o, state_out, k_hat, v_new, gamma
  CausalConvVerify(x, conv_state, weight)                -> y
  PagedAttention(q, k_new, v_new, kv_pool, block_table, kv_start, kv_len; layer, causal, scale) -> o

``enqueue`` calls the NVRTC launchers (plugins/launch.py) with TensorRT's pointers on TensorRT's
stream. Everything it needs is derived from the descriptors TensorRT passes in: no allocation (int64
index tensors are narrowed into TensorRT's workspace with one async strided copy), no host sync, no
Python state that changes between launches — so a CUDA graph captured around ``execute_async_v3``
replays it without Python. Kernel modules are NVRTC-built and loaded on the first launch: execute
once before capturing (as for TensorRT itself). Without TensorRT the classes derive from ``object`` (see
trt_compat) so ``enqueue`` can be driven directly with device pointers, as the GPU test does.
"""
from __future__ import annotations

import numpy as np

from dflash_trt.plugins import launch
from dflash_trt.plugins import trt_compat as C

NAMESPACE, VERSION = "dflash", "1"
FLOATS = ("float32", "bfloat16", "float16")
INTS = ("int32", "int64")
_ALIGN = 256
# Found while building, (op, message); read and cleared by engines/build.py. configure_plugin never
# raises into TensorRT (an exception there can abort the whole process): it records instead.
KERNEL_WARNINGS: list = []  # shapes/dtypes the CUDA kernels cannot run (engine still builds)
SHAPE_ERRORS: list = []     # inputs that do not fit the op's signature (the build must fail)


class PluginShapeError(ValueError):
    """The node's inputs are inconsistent with the op's signature (fails the build)."""


def _dims(d) -> tuple:
    return tuple(int(x) for x in d.dims)


def _field_value(data):
    return np.asarray(data).reshape(-1)[0].item()


def _narrow_i64(dst: int, src: int, n: int, stream: int) -> None:
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
    """Shared IPluginV3 plumbing; subclasses declare the op's signature and launch."""

    NAME = ""
    INPUTS: tuple = ()   # (name, type group)
    OUTPUTS: tuple = ()
    GROUPS: dict = {}    # type group -> allowed dtype names; one dtype per group and node
    FIELDS: dict = {}    # attribute -> ("float" | "int", default)

    def __init__(self, fields=None, phase=None):
        C.init_bases(self, C.PLUGIN_BASES)
        self.plugin_name, self.plugin_namespace, self.plugin_version = self.NAME, NAMESPACE, VERSION
        self.num_outputs = len(self.OUTPUTS)
        self.timing_cache_id = ""
        self.format_combination_limit = 64
        self.phase = phase
        self.attrs = {k: (float(v) if t == "float" else int(v)) for k, (t, v) in self.FIELDS.items()}
        for k, v in (fields or {}).items():
            if k not in self.FIELDS:
                raise PluginShapeError(f"{self.NAME}: unknown attribute {k!r} (expected {sorted(self.FIELDS)})")
            self.attrs[k] = float(v) if self.FIELDS[k][0] == "float" else int(v)
        self.metadata_string = f"{self.NAME} {self.attrs}"

    # ---- core
    def get_capability_interface(self, type):
        return self

    def clone(self):
        return type(self)(dict(self.attrs), self.phase)

    def get_fields_to_serialize(self):
        self._field_data = []  # TensorRT reads the buffers after this returns
        return C.plugin_fields(self.attrs, {k: t for k, (t, _) in self.FIELDS.items()}, self._field_data)

    def destroy(self):
        pass

    # ---- build
    def _group_type(self, types, group):
        for i, (_, g) in enumerate(self.INPUTS):
            if g == group:
                return types[i]
        return C.data_type(self.GROUPS[group][0])

    def get_output_data_types(self, input_types):
        return [self._group_type(list(input_types), g) for _, g in self.OUTPUTS]

    def get_output_shapes(self, inputs, shape_inputs, expr_builder):
        return [C.dims_exprs(s) for s in self.output_shapes([list(x) for x in inputs])]

    def output_shapes(self, ins):
        """Input shapes (lists of dims or dim expressions) -> output shapes, in output order."""
        raise NotImplementedError

    def supports_format_combination(self, pos, in_out, num_inputs):
        d = in_out[pos].desc
        if d.format != C.TensorFormat.LINEAR:
            return False
        sig = self.INPUTS + self.OUTPUTS
        group = sig[pos][1]
        if C.dtype_name(d.type) not in self.GROUPS[group]:
            return False
        return all(C.dtype_name(in_out[j].desc.type) == C.dtype_name(d.type) for j in range(pos) if sig[j][1] == group)

    def configure_plugin(self, inp, out):
        dims = [_dims(x.desc) for x in inp]
        if any(v < 0 for s in dims for v in s):  # dynamic batch: check the profile's largest shapes
            dims = [tuple(int(v) for v in x.max) for x in inp]
        try:
            self.check_shapes(dims)
        except Exception as e:  # noqa: BLE001 — see SHAPE_ERRORS
            SHAPE_ERRORS.append((self.NAME, str(e)))
            return
        try:
            self.kernel_check(dims, [C.dtype_name(x.desc.type) for x in inp])
        except Exception as e:  # noqa: BLE001
            KERNEL_WARNINGS.append((self.NAME, str(e)))

    def check_shapes(self, dims):
        """Raise PluginShapeError when the inputs do not fit the op's signature."""

    def kernel_check(self, dims, types):
        """Raise launch.KernelError when the CUDA kernel cannot run these shapes / dtypes (mirrors the
        launchers' checks through their public limits)."""
        for t in types:
            if t in C.DTYPE_SIZE and not t.startswith("int") and t not in launch.DTYPES:
                raise launch.KernelError(f"{self.NAME}: dtype {t} not supported by the kernels ({list(launch.DTYPES)})")

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


def _need(cond, msg):
    if not cond:
        raise PluginShapeError(msg)


class GdnChunkWY16Plugin(DflashPlugin):
    NAME = "GdnChunkWY16"
    INPUTS = (("q", "x"), ("k", "x"), ("v", "x"), ("g", "g"), ("beta", "g"), ("state", "f32"))
    OUTPUTS = (("o", "x"), ("state_out", "f32"), ("k_hat", "f32"), ("v_new", "f32"), ("gamma", "f32"))
    GROUPS = {"x": FLOATS, "g": FLOATS, "f32": ("float32",)}
    FIELDS = {"scale": ("float", 0.0)}  # 0: dk ** -0.5

    def output_shapes(self, ins):
        q, v = ins[0], ins[2]
        B, T, dk, Hv, dv = q[0], q[1], q[3], v[2], v[3]
        return [[B, T, Hv, dv], [B, Hv, dk, dv], list(q), [B, T, Hv, dv], [B, T, Hv]]

    def check_shapes(self, d):
        q, k, v, g, beta, s = d
        _need(len(q) == 4 and k == q, f"GdnChunkWY16: q {q} and k {k} must both be [B,T,Hk,dk]")
        _need(len(v) == 4 and v[:2] == q[:2], f"GdnChunkWY16: v {v} must be [B,T,Hv,dv] with q's B,T")
        _need(g == beta == v[:3], f"GdnChunkWY16: g {g} and beta {beta} must be [B,T,Hv] = {v[:3]}")
        _need(s == (q[0], v[2], q[3], v[3]), f"GdnChunkWY16: state {s} must be [B,Hv,dk,dv]")

    def kernel_check(self, d, types):
        super().kernel_check(d, types)
        (B, T, Hk, dk), (_, _, Hv, dv) = d[0], d[2]
        if dk not in launch.GDN_DK:
            raise launch.KernelError(f"gdn: unsupported key head dim dk={dk}; supported: {launch.GDN_DK}")
        if dv % 32:
            raise launch.KernelError(f"gdn: value head dim dv={dv} must be a multiple of 32")
        if Hv % Hk:
            raise launch.KernelError(f"gdn: Hv={Hv} must be a multiple of Hk={Hk}")

    def launch(self, d, it, ot, i, o, ws, stream):
        (B, T, Hk, dk), (_, _, Hv, dv) = d[0], d[2]
        scale = self.attrs["scale"] or dk ** -0.5
        launch.gdn_wy16(i[0], i[1], i[2], i[3], i[4], i[5], 0, o[0], o[2], o[3], o[4], o[1], B=B, T=T, Hk=Hk, Hv=Hv,
                        dk=dk, dv=dv, in_dtype=it[0], gb_dtype=it[3], o_dtype=ot[0], state_dtype=it[5], scale=scale,
                        stream=stream)


class CausalConvVerifyPlugin(DflashPlugin):
    NAME = "CausalConvVerify"
    INPUTS = (("x", "x"), ("conv_state", "s"), ("weight", "w"))
    OUTPUTS = (("y", "x"),)
    GROUPS = {"x": FLOATS, "s": FLOATS, "w": FLOATS}

    def output_shapes(self, ins):
        return [list(ins[0])]

    def check_shapes(self, d):
        x, s, w = d
        _need(len(x) == 3 and len(w) == 2 and w[0] == x[2], f"CausalConvVerify: x {x} [B,T,C], weight {w} [C,W]")
        _need(s == (x[0], x[2], w[1] - 1), f"CausalConvVerify: conv_state {s} must be [B,C,W-1]")

    def kernel_check(self, d, types):
        super().kernel_check(d, types)
        W = d[2][1]
        if not 2 <= W <= launch.CONV_MAX_W:
            raise launch.KernelError(f"conv: kernel width W={W} not in [2, {launch.CONV_MAX_W}]")

    def launch(self, d, it, ot, i, o, ws, stream):
        (B, T, C), W = d[0], d[2][1]
        launch.conv_verify(i[0], i[1], 0, i[2], o[0], B=B, T=T, C=C, W=W, x_dtype=it[0], s_dtype=it[1],
                           w_dtype=it[2], y_dtype=ot[0], stream=stream)


class PagedAttentionPlugin(DflashPlugin):
    NAME = "PagedAttention"
    INPUTS = (("q", "q"), ("k_new", "n"), ("v_new", "n"), ("kv_pool", "p"), ("block_table", "i0"),
              ("kv_start", "i1"), ("kv_len", "i2"))
    OUTPUTS = (("o", "q"),)
    GROUPS = {"q": FLOATS, "n": FLOATS, "p": FLOATS, "i0": INTS, "i1": INTS, "i2": INTS}
    FIELDS = {"layer": ("int", 0), "causal": ("int", 1), "scale": ("float", 0.0)}  # scale 0: hd ** -0.5

    def output_shapes(self, ins):
        return [list(ins[0])]

    def check_shapes(self, d):
        q, k, v, pool, bt, ks, kl = d
        B = q[0] if q else None
        _need(len(q) == 4 and len(k) == 4 and k == v and k[:2] == q[:2] and k[3] == q[3],
              f"PagedAttention: q {q} [B,T,Hq,hd], k_new/v_new {k}/{v} [B,T,Hkv,hd]")
        _need(len(pool) == 6 and pool[1] == 2 and pool[4:] == k[2:],
              f"PagedAttention: kv_pool {pool} must be [L,2,num_blocks,block_size,Hkv,hd] with Hkv,hd = {k[2:]}")
        _need(len(bt) == 2 and bt[0] == B, f"PagedAttention: block_table {bt} must be [B,max_blocks], B={B}")
        _need(int(np.prod(ks)) == B and int(np.prod(kl)) == B, f"PagedAttention: kv_start {ks}/kv_len {kl} need B={B}")
        _need(0 <= self.attrs["layer"] < pool[0], f"PagedAttention: layer {self.attrs['layer']} not in [0, {pool[0]})")

    def kernel_check(self, d, types):
        super().kernel_check(d, types)
        (B, T, Hq, hd), Hkv = d[0], d[1][2]
        if hd not in launch.ATTN_HD:
            raise launch.KernelError(f"paged_attention: unsupported head dim {hd}; supported: {launch.ATTN_HD}")
        if Hq % Hkv:
            raise launch.KernelError(f"paged_attention: Hq={Hq} must be a multiple of Hkv={Hkv}")

    @staticmethod
    def _index_slots(dims, types):
        """(input index, element count, workspace offset) for each int64 index input."""
        out, off = [], 0
        for idx in (4, 5, 6):
            if types[idx] == "int64":
                n = int(np.prod(dims[idx]))
                out.append((idx, n, off))
                off += -(-4 * n // _ALIGN) * _ALIGN
        return out, off

    def workspace_bytes(self, dims, types):
        return self._index_slots(dims, types)[1]

    def launch(self, d, it, ot, i, o, ws, stream):
        (B, T, Hq, hd), Hkv = d[0], d[1][2]
        L, _, NB, BS = d[3][:4]
        idx = {4: i[4], 5: i[5], 6: i[6]}
        for k, n, off in self._index_slots(d, it)[0]:
            _narrow_i64(ws + off, i[k], n, stream)
            idx[k] = ws + off
        scale = self.attrs["scale"] or hd ** -0.5
        launch.paged_attention(i[0], i[1], i[2], i[3], idx[4], idx[5], idx[6], o[0], B=B, T=T, Hq=Hq, Hkv=Hkv, hd=hd,
                               layer=self.attrs["layer"], num_blocks=NB, block_size=BS, max_blocks=d[4][1],
                               causal=bool(self.attrs["causal"]), scale=scale, q_dtype=it[0], n_dtype=it[1],
                               p_dtype=it[3], o_dtype=ot[0], stream=stream)


PLUGINS = {cls.NAME: cls for cls in (GdnChunkWY16Plugin, CausalConvVerifyPlugin, PagedAttentionPlugin)}
PLUGIN_VERSIONS = {name: VERSION for name in PLUGINS}


class DflashPluginCreator(*C.CREATOR_BASES):
    """IPluginCreatorV3One for one op: builds plugins from ONNX node attributes / serialized fields."""

    def __init__(self, plugin_cls):
        C.init_bases(self, C.CREATOR_BASES)
        self.plugin_cls = plugin_cls
        self.name, self.plugin_namespace, self.plugin_version = plugin_cls.NAME, NAMESPACE, VERSION
        types = {k: t for k, (t, _) in plugin_cls.FIELDS.items()}
        self._field_data = []
        self.field_names = C.plugin_fields({k: 0 for k in types}, types, self._field_data)

    def create_plugin(self, name, fc, phase):
        if isinstance(fc, dict):
            fields = dict(fc)
        else:
            fields = {f.name: _field_value(f.data) for f in fc if f.name not in ("plugin_namespace", "plugin_version")}
        return self.plugin_cls(fields, phase)


_registered: dict = {}  # name -> creator; kept alive here (TensorRT holds only a pointer)


def creators() -> dict:
    return {name: DflashPluginCreator(cls) for name, cls in PLUGINS.items()}


def _find(reg) -> dict:
    """name -> creator of the dflash creators in TensorRT's registry (no error log for absent ones)."""
    out = {}
    for cr in reg.all_creators:
        if getattr(cr, "plugin_namespace", None) == NAMESPACE and getattr(cr, "plugin_version", None) == VERSION:
            out[cr.name] = cr
    return out


def register() -> dict:
    """Register the dflash creators with TensorRT's plugin registry (idempotent); returns name -> creator."""
    trt = C.require()
    reg = trt.get_plugin_registry()
    present = _find(reg)
    for name, cr in creators().items():
        if name in present:  # by us earlier, or by someone else in this process
            _registered.setdefault(name, present[name])
            continue
        if not reg.register_creator(cr, NAMESPACE):
            raise RuntimeError(f"TensorRT refused to register plugin creator {NAMESPACE}::{name} v{VERSION}")
        _registered[name] = cr
    return dict(_registered)


def unregister() -> None:
    """Remove the dflash creators (graphs then parse with their ONNX function bodies inlined)."""
    trt = C.require()
    reg = trt.get_plugin_registry()
    for name, cr in _find(reg).items():
        if name in PLUGINS:
            reg.deregister_creator(cr)
    _registered.clear()


def registered_names() -> set:
    """Names of dflash plugins TensorRT can find now."""
    return set(_find(C.require().get_plugin_registry())) & set(PLUGINS)
