"""TensorRT plugins, build-time side, on CPU (TensorRT-RTX from pip builds without a GPU): output shapes
and dtypes for several K and B through the real ONNX parser, format combinations, workspace, the
serialization round trip through the creators, and the compute-capability rules of `dflash-trt build`."""
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_trt.plugins import trt_compat as C
from dflash_trt.plugins import trt_base
from dflash_trt.plugins import trt_plugins as P
from dflash_trt.plugins.opspec import ShapeError

pytestmark = pytest.mark.skipif(not C.HAVE_TRT, reason=f"no TensorRT: {C.IMPORT_ERROR}")
DT = C.DataType


def _rand(*shape, dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def gdn_inputs(B, T, Hk=2, Hv=4, dk=64, dv=32, dtype=np.float32):
    return {"q": _rand(B, T, Hk, dk, dtype=dtype), "k": _rand(B, T, Hk, dk, dtype=dtype),
            "v": _rand(B, T, Hv, dv, dtype=dtype), "g": _rand(B, T, Hv), "beta": _rand(B, T, Hv),
            "state": _rand(B, Hv, dk, dv)}


def conv_inputs(B, T, C_=48, W=4, dtype=np.float32):
    return {"x": _rand(B, T, C_, dtype=dtype), "conv_state": _rand(B, C_, W - 1, dtype=dtype),
            "weight": _rand(C_, W, dtype=dtype)}


def attn_inputs(B, T, Hq=4, Hkv=2, hd=64, L=2, NB=8, BS=16, MB=4, idx=np.int64):
    return {"q": _rand(B, T, Hq, hd), "k_new": _rand(B, T, Hkv, hd), "v_new": _rand(B, T, Hkv, hd),
            "kv_pool": _rand(L, 2, NB, BS, Hkv, hd), "block_table": np.zeros((B, MB), idx),
            "kv_start": np.zeros(B, idx), "kv_len": np.full(B, 3, idx)}


def _build(op, inputs, attrs=None, build=True):
    """Parse a one-node model with the plugins registered; returns (network info, plan bytes or None)."""
    from dflash_trt.plugins.onnx_functions import single_op_model

    trt = C.require()
    P.register()
    C.ensure_parser_lib()
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    net = builder.create_network(0)
    parser = trt.OnnxParser(net, logger)
    assert parser.parse(single_op_model(op, inputs, attrs).SerializeToString()), \
        [parser.get_error(i).desc() for i in range(parser.num_errors)]
    types = [net.get_layer(i).type for i in range(net.num_layers)]
    outs = [(net.get_output(i).name, tuple(net.get_output(i).shape), C.dtype_name(net.get_output(i).dtype))
            for i in range(net.num_outputs)]
    plan = None
    if build:
        cfg = builder.create_builder_config()
        cfg.num_compute_capabilities = 1
        cfg.set_compute_capability(trt.ComputeCapability.SM86, 0)
        plan = builder.build_serialized_network(net, cfg)
    return types, outs, plan


@pytest.mark.parametrize("B,K", [(1, 1), (2, 16), (3, 5)])
def test_gdn_shapes_types(B, K):
    P.KERNEL_WARNINGS.clear()
    types, outs, plan = _build("GdnChunkWY16", gdn_inputs(B, K), {"scale": 0.125})
    trt = C.trt
    assert types == [trt.LayerType.PLUGIN_V3]
    assert outs == [("o", (B, K, 4, 32), "float32"), ("state_out", (B, 4, 64, 32), "float32"),
                    ("k_hat", (B, K, 2, 64), "float32"), ("v_f32", (B, K, 4, 32), "float32"),
                    ("g_f32", (B, K, 4), "float32"), ("beta_f32", (B, K, 4), "float32")]
    assert plan is not None and plan.nbytes > 0
    assert P.KERNEL_WARNINGS == []  # dk=64, dv=32: the kernels run these


def test_gdn_half_inputs_and_kernel_warning():
    P.KERNEL_WARNINGS.clear()
    _, outs, plan = _build("GdnChunkWY16", gdn_inputs(2, 4, dk=16, dv=8, dtype=np.float16))
    assert outs[0] == ("o", (2, 4, 4, 8), "float16") and all(o[2] == "float32" for o in outs[1:])
    assert plan is not None
    assert any("dk=16" in msg for op, msg in P.KERNEL_WARNINGS if op == "GdnChunkWY16")


@pytest.mark.parametrize("B,K", [(1, 1), (4, 16)])
def test_conv_shapes_types(B, K):
    types, outs, plan = _build("CausalConvVerify", conv_inputs(B, K))
    assert types == [C.trt.LayerType.PLUGIN_V3] and outs == [("y", (B, K, 48), "float32")] and plan is not None


@pytest.mark.parametrize("B,K,idx", [(1, 1, np.int64), (2, 16, np.int64), (3, 7, np.int32)])
def test_attention_shapes_types(B, K, idx):
    types, outs, plan = _build("PagedAttention", attn_inputs(B, K, idx=idx), {"layer": 1, "causal": 0, "scale": 0.5})
    assert types == [C.trt.LayerType.PLUGIN_V3] and outs == [("o", (B, K, 4, 64), "float32")] and plan is not None


@pytest.mark.parametrize("N,idx", [(1, np.int64), (6, np.int32)])
def test_moe_experts_shapes_types_and_workspace(N, idx):
    """MoeExperts parses to our plugin (not its dense body); its workspace holds the routing plan (int32: 3
    slots + N*k pairs, slots = min(E, N*k)), h [N*k, I] in x's dtype and y_pair [N*k, H] fp32, each 256-aligned."""
    E, k, H, I = 8, 2, 64, 32  # noqa: E741
    rng = np.random.default_rng(N)
    ins = {"x": _rand(N, H), "topk_idx": np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(idx),
           "topk_w": _rand(N, k), "gate_up": _rand(E, 2 * I, H), "down": _rand(E, H, I)}
    types, outs, plan = _build("MoeExperts", ins)
    assert types == [C.trt.LayerType.PLUGIN_V3] and outs == [("y", (N, H), "float32")] and plan is not None
    a = P.PLUGINS["MoeExperts"]()
    descs = [C.dynamic_desc(v.shape, str(v.dtype)) for v in ins.values()]
    align = lambda n: -(-n // 256) * 256  # noqa: E731
    pairs = N * k
    assert a.get_workspace_size(descs, []) == align(4 * (3 * min(E, pairs) + pairs)) + align(pairs * I * 4) + pairs * H * 4


def test_attention_layer_out_of_range_is_a_shape_error():
    P.SHAPE_ERRORS.clear()
    _build("PagedAttention", attn_inputs(1, 2), {"layer": 5, "causal": 1, "scale": 0.5})
    assert any("layer 5 not in [0, 2)" in m for _, m in P.SHAPE_ERRORS)  # build.py turns these into a BuildError
    P.SHAPE_ERRORS.clear()


def test_output_shapes_pure():
    g = P.PLUGINS["GdnChunkWY16"]({"scale": 0.1})
    ins = [list(a.shape) for a in gdn_inputs(3, 7).values()]
    assert g.output_shapes(ins) == [[3, 7, 4, 32], [3, 4, 64, 32], [3, 7, 2, 64], [3, 7, 4, 32], [3, 7, 4], [3, 7, 4]]
    g.check_shapes([tuple(s) for s in ins])
    bad = [tuple(s) for s in ins]
    bad[5] = (3, 4, 32, 64)
    with pytest.raises(ShapeError, match="state"):
        g.check_shapes(bad)


def _io(*types):
    return [SimpleNamespace(desc=SimpleNamespace(type=t, format=C.TensorFormat.LINEAR)) for t in types]


def test_supports_format_combination():
    F, H, BF, I32, I64 = DT.FLOAT, DT.HALF, DT.BF16, DT.INT32, DT.INT64
    g = P.PLUGINS["GdnChunkWY16"]()
    ok = _io(BF, BF, BF, F, F, F, BF, F, F, F, F)
    assert all(g.supports_format_combination(i, ok, 6) for i in range(11))
    assert not g.supports_format_combination(1, _io(BF, H, BF, F, F, F, BF, F, F, F, F), 6)  # q/k differ
    assert not g.supports_format_combination(5, _io(F, F, F, F, F, H, F, F, F, F, F), 6)  # state must be fp32
    assert not g.supports_format_combination(6, _io(BF, BF, BF, F, F, F, F, F, F, F, F), 6)  # o follows q
    assert not g.supports_format_combination(0, _io(I32, I32, I32, F, F, F, I32, F, F, F, F), 6)
    a = P.PLUGINS["PagedAttention"]()
    for idx in (I32, I64):
        io = _io(BF, BF, BF, BF, idx, idx, idx, BF)
        assert all(a.supports_format_combination(i, io, 7) for i in range(8))
    assert not a.supports_format_combination(4, _io(F, F, F, F, F, I64, I64, F), 7)
    assert not a.supports_format_combination(2, _io(F, F, H, F, I64, I64, I64, F), 7)  # k_new / v_new differ
    nonlinear = [SimpleNamespace(desc=SimpleNamespace(type=F, format=C.TensorFormat.HWC))]
    assert not P.PLUGINS["CausalConvVerify"]().supports_format_combination(0, nonlinear, 3)


def test_output_types():
    F, H = DT.FLOAT, DT.HALF
    assert P.PLUGINS["GdnChunkWY16"]().get_output_data_types([H, H, H, F, F, F]) == [H, F, F, F, F, F]
    assert P.PLUGINS["CausalConvVerify"]().get_output_data_types([H, F, F]) == [H]
    assert P.PLUGINS["PagedAttention"]().get_output_data_types([H, H, H, F, DT.INT64, DT.INT64, DT.INT64]) == [H]


def test_workspace_for_int64_indices():
    a = P.PLUGINS["PagedAttention"]({"layer": 0})
    shapes = [s.shape for s in attn_inputs(3, 4, MB=100).values()]
    d64 = [C.dynamic_desc(s, "float32" if i < 4 else "int64") for i, s in enumerate(shapes)]
    d32 = [C.dynamic_desc(s, "float32" if i < 4 else "int32") for i, s in enumerate(shapes)]
    # int64 indices narrowed first: 300 int32 = 1200 B -> 5 x 256; 3 -> 256; 3 -> 256; int32 ones need no room
    assert a.get_workspace_size(d64, []) - a.get_workspace_size(d32, []) == 1280 + 256 + 256
    # then the split-KV partials: at least what these exact shapes need (their bound, from the shapes alone)
    from dflash_trt.plugins.paged_attention import spec as attn_spec

    q, k = shapes[0], shapes[1]
    exact = attn_spec.workspace_bytes(q[0], q[1], q[2], k[2], q[3], shapes[4][1] * shapes[3][3])
    assert a.get_workspace_size(d32, []) == attn_spec.workspace_bound(*q) >= exact


def test_serialization_round_trip_through_creator():
    trt = C.require()
    cr = P.creators()
    for name, attrs in (("GdnChunkWY16", {"scale": 0.0884}), ("CausalConvVerify", {}),
                        ("PagedAttention", {"layer": 3, "causal": 0, "scale": 0.125})):
        keep = []
        fc = C.plugin_fields(attrs, P.PLUGINS[name].SPEC.attr_kinds, keep)
        p = cr[name].create_plugin(name, fc, trt.TensorRTPhase.BUILD)
        assert (p.plugin_name, p.plugin_namespace, p.plugin_version) == (name, "dflash", "1")
        for k, v in attrs.items():
            assert p.attrs[k] == pytest.approx(v)
        q = cr[name].create_plugin(name, p.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
        assert q.attrs == pytest.approx(p.attrs) and q.phase == trt.TensorRTPhase.RUNTIME
        c = q.clone()
        assert type(c) is type(q) and c.attrs == q.attrs and c is not q
    with pytest.raises(ShapeError, match="unknown attribute"):
        cr["CausalConvVerify"].create_plugin("x", {"bogus": 1}, trt.TensorRTPhase.BUILD)


def test_register_unregister_idempotent():
    P.register()
    P.register()
    assert P.registered_names() == set(P.PLUGINS)
    P.unregister()
    assert P.registered_names() == set()
    P.register()
    assert P.registered_names() == set(P.PLUGINS)


def test_compat_basics():
    assert C.FLAVOUR in ("tensorrt", "tensorrt_rtx") and C.VERSION
    assert C.dtype_name(DT.BF16) == "bfloat16" and C.dtype_name("torch.float16") == "float16"
    assert C.data_type("int64") == DT.INT64
    if C.IS_RTX:
        import os

        assert os.path.exists(C.ensure_parser_lib())


@pytest.mark.skipif(not C.IS_RTX, reason="TensorRT-RTX only")
def test_parser_lib_unwritable_dir_explains_fix(tmp_path, monkeypatch):
    import os

    libdir = tmp_path / "libs"
    libdir.mkdir()
    (libdir / "libtensorrt_rtx.so.1").write_bytes(b"")
    real_symlink = os.symlink

    def symlink(src, dst):
        if os.path.dirname(dst) == str(libdir):
            raise PermissionError("read-only file system")
        real_symlink(src, dst)

    monkeypatch.setattr(C, "_rtx_lib_dir", lambda: str(libdir))
    monkeypatch.setattr(C.os, "symlink", symlink)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    alt = tmp_path / "cache" / "lib"
    with pytest.raises(C.ParserLibError, match=f"LD_LIBRARY_PATH={alt}"):
        C.ensure_parser_lib()
    assert os.readlink(alt / "libtensorrt_rtx.so") == str(libdir / "libtensorrt_rtx.so.1")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(alt))
    assert C.ensure_parser_lib() == str(alt / "libtensorrt_rtx.so")


def test_plugins_read_their_specs():
    """Name, I/O, attributes and limits of each plugin are its op's spec (the ONNX functions use the same)."""
    from dflash_trt.plugins.onnx_functions import SPECS

    assert set(P.PLUGINS) == set(SPECS)
    for name, cls in P.PLUGINS.items():
        p = cls()
        assert cls.SPEC is SPECS[name] and p.plugin_name == name and p.num_outputs == len(SPECS[name].outputs)
        assert p.attrs == SPECS[name].attr_defaults
    assert trt_base.NAMESPACE == "dflash" and P.PLUGIN_VERSIONS == {n: "1" for n in SPECS}
