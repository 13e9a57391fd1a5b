"""Parse one exported graph into a TensorRT network and check what became of its dflash nodes.

`parse_graph` registers (or not) the dflash plugin creators, parses the ONNX file and compares the
network's PLUGIN_V3 layers with the graph's `dflash` nodes: with plugins every node must be a
PLUGIN_V3 layer of the same op (else TensorRT inlined a function body, which is a BuildError);
without plugins none may be. `builder_config` sets compute capabilities (TensorRT-RTX), the batch
profile and the timing cache. Only TensorRT-flavour specifics live in plugins/trt_compat.
"""
from __future__ import annotations

import os
import re
from collections import Counter

from dflash_trt.plugins import trt_compat as C

DOMAIN = "dflash"
FP8_MIN_CC = (8, 9)  # e4m3 tensor types: Ada and later (TensorRT refuses to compile them for sm80/sm86)


class BuildError(RuntimeError):
    """An engine cannot be built as asked (message says what and why)."""


def dflash_nodes(onnx_path: str) -> Counter:
    """op_type -> count of `dflash` nodes in the graph (weights not loaded)."""
    import onnx

    model = onnx.load(onnx_path, load_external_data=False)
    return Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN)


def fp8_weights(onnx_path: str) -> list[str]:
    """Names of the float8_e4m3fn initializers a DequantizeLinear reads (weights not loaded); none for a file that
    is not an ONNX model (the build checks each graph against its manifest and names what is wrong)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(onnx_path, load_external_data=False)
    except (DecodeError, OSError):
        return []
    fp8 = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    return [n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in fp8]


def plugin_layers(network) -> Counter:
    """(namespace, name, version) -> count of PLUGIN_V3 layers."""
    trt = C.require()
    out = Counter()
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type != trt.LayerType.PLUGIN_V3:
            continue
        layer.__class__ = trt.IPluginV3Layer
        core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
        out[(core.plugin_namespace, core.plugin_name, core.plugin_version)] += 1
    return out


def _fmt(counts) -> str:
    return ", ".join(f"{k}x{v}" for k, v in sorted(counts.items())) or "none"


def parse_graph(builder, onnx_path: str, *, plugins: bool, logger=None):
    """(network, parser, info). info: nodes {op: n}, plugin_layers {op: n}, inlined {op: n}, layers."""
    trt = C.require()
    from dflash_trt.plugins import trt_plugins

    nodes = dflash_nodes(onnx_path)
    if plugins:
        trt_plugins.register()
        if nodes:
            C.ensure_parser_lib()  # the parser dlopens libtensorrt_rtx.so for plugin nodes
    else:
        trt_plugins.unregister()
        still = trt_plugins.registered_names()
        if still:
            raise BuildError(f"--no-plugins: dflash creators {sorted(still)} are still registered in this process")
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger or trt.Logger(trt.Logger.WARNING))
    if not parser.parse_from_file(onnx_path):
        errs = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {onnx_path}: {errs}")
    layers = plugin_layers(network)
    ours = Counter({name: n for (ns, name, ver), n in layers.items() if ns == DOMAIN})
    wrong_ver = {f"{name} v{ver}" for (ns, name, ver), _ in layers.items()
                 if ns == DOMAIN and ver != trt_plugins.PLUGIN_VERSIONS.get(name)}
    if wrong_ver:
        raise BuildError(f"{onnx_path}: plugin layer(s) {sorted(wrong_ver)} have versions this dflash-trt does not ship")
    if plugins and ours != nodes:
        missing = nodes - ours
        raise BuildError(
            f"{os.path.basename(onnx_path)}: {sum(nodes.values())} dflash nodes ({_fmt(nodes)}) but PLUGIN_V3 layers "
            f"for {_fmt(ours)}: TensorRT inlined the ONNX function bodies of {_fmt(missing)} instead of using the "
            "plugins. Check that the nodes carry plugin_namespace='dflash', plugin_version='1' and that "
            "dflash_trt.plugins.trt_plugins.register() ran before parsing.")
    if not plugins and ours:
        raise BuildError(f"{onnx_path}: --no-plugins but TensorRT made PLUGIN_V3 layers {_fmt(ours)}")
    info = {"nodes": dict(nodes), "plugin_layers": dict(ours), "inlined": {} if plugins else dict(nodes),
            "layers": network.num_layers}
    return network, parser, info


# ------------------------------------------------------------------------ compute capability
def parse_cc(text: str) -> list:
    """'80,86,8.9,120' -> [(8,0),(8,6),(8,9),(12,0)]; 'current' -> ['current']."""
    out = []
    for tok in (t.strip().lower() for t in text.split(",") if t.strip()):
        if tok in ("current", "ampere+"):
            out.append(tok)
            continue
        m = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", tok)
        if not m:
            raise BuildError(f"--target-cc: cannot read {tok!r}; use e.g. 80,86,89,120 or 8.9 or 'current'")
        major, minor = (int(m.group(1)), int(m.group(2))) if m.group(2) else divmod(int(m.group(1)), 10)
        out.append((major, minor))
    return out


def cc_str(cc) -> str:
    return cc if isinstance(cc, str) else f"{cc[0]}.{cc[1]}"


def local_gpu_cc():
    """Compute capability of GPU 0, or None (no GPU, no driver, or no cuda-python)."""
    try:
        from cuda.bindings import driver as cu

        if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
            return None
        err, n = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS or n < 1:
            return None
        A = cu.CUdevice_attribute
        major = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0)[1]
        minor = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0)[1]
        return int(major), int(minor)
    except Exception:
        return None


def resolve_ccs(requested, gpu_cc, fp8: str | None = None) -> list:
    """The compute capabilities to build for (list of (major, minor) or ['ampere+']). fp8: where the graphs hold
    FP8 weights (a phrase naming the graph and a weight), which TensorRT compiles only for CC >= 8.9; None when they hold none."""
    ccs = _resolve_ccs(requested, gpu_cc, fp8)
    old = [cc for cc in ccs if cc == "ampere+" or cc < FP8_MIN_CC] if fp8 else []
    if old:
        raise BuildError(f"{fp8}; TensorRT builds float8_e4m3fn only for compute capability >= "
                         f"{cc_str(FP8_MIN_CC)}: drop {', '.join(map(cc_str, old))} from --target-cc")
    return ccs


def _resolve_ccs(requested, gpu_cc, fp8) -> list:
    kernel_ok = [cc for cc in C.RTX_CCS if cc >= (FP8_MIN_CC if fp8 else C.MIN_KERNEL_CC)]
    if C.IS_RTX:
        if not requested:
            if gpu_cc == (9, 0):
                raise BuildError("this GPU is CC 9.0 (Hopper), which TensorRT-RTX does not run on: pass --target-cc "
                                 "(e.g. 86,89,120) to build for other GPUs, or use full TensorRT for Hopper")
            requested = ["current"] if gpu_cc else kernel_ok  # no GPU: every CC both run
        if requested == ["current"]:
            if gpu_cc is None:
                raise BuildError("--target-cc current: no CUDA GPU here; name the CCs, e.g. --target-cc 86,89,120")
            requested = [gpu_cc]
        for cc in requested:
            if isinstance(cc, str):
                raise BuildError(f"--target-cc {cc}: TensorRT-RTX takes explicit CCs ({', '.join(map(cc_str, kernel_ok))})")
            if cc == (9, 0):
                raise BuildError("TensorRT-RTX does not run on compute capability 9.0 (Hopper: H100/H200); "
                                 "use full TensorRT (`pip install tensorrt`) to build engines for it")
            if cc not in C.RTX_CCS:
                raise BuildError(f"TensorRT-RTX cannot target CC {cc_str(cc)}; it supports {', '.join(map(cc_str, C.RTX_CCS))}")
            if cc < C.MIN_KERNEL_CC:
                raise BuildError(f"CC {cc_str(cc)}: the dflash CUDA kernels need compute capability >= 8.0")
        return sorted(set(requested))
    # full TensorRT: engines are for the building GPU, or for Ampere+ with hardware compatibility
    if gpu_cc is None:
        raise BuildError("full TensorRT builds engines on a GPU and none was found; build elsewhere, or use "
                         "TensorRT-RTX (`pip install tensorrt-rtx`), which builds without a GPU")
    if requested and requested not in (["current"], [gpu_cc], ["ampere+"]):
        raise BuildError(f"full TensorRT builds for this GPU (CC {cc_str(gpu_cc)}) or 'ampere+' only; "
                         f"got --target-cc {','.join(map(cc_str, requested))}")
    return ["ampere+"] if requested == ["ampere+"] else [gpu_cc]


# ---------------------------------------------------------------------------- builder config
def builder_config(builder, network, *, ccs, batch=None, timing_cache=None, opt_level=None):
    """batch: (min, opt, max) for a dynamic leading dim, or None when all shapes are static."""
    trt = C.require()
    cfg = builder.create_builder_config()
    if C.IS_RTX:
        cfg.num_compute_capabilities = len(ccs)
        for i, (major, minor) in enumerate(ccs):
            cfg.set_compute_capability(getattr(trt.ComputeCapability, f"SM{major}{minor}"), i)
    elif ccs == ["ampere+"]:
        cfg.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    if opt_level is not None:
        cfg.builder_optimization_level = int(opt_level)
    if timing_cache is not None and not C.IS_RTX:
        cfg.set_timing_cache(timing_cache, False)
    dynamic = [network.get_input(i) for i in range(network.num_inputs) if -1 in tuple(network.get_input(i).shape)]
    if dynamic:
        if batch is None:
            raise BuildError(f"inputs {[t.name for t in dynamic]} have dynamic dims but no batch range was given")
        profile = builder.create_optimization_profile()
        for t in dynamic:  # the only dynamic dim of our graphs is the batch of sequences (manifest "B")
            shape = tuple(t.shape)
            profile.set_shape(t.name, *[tuple(b if d == -1 else d for d in shape) for b in batch])
        cfg.add_optimization_profile(profile)
    return cfg


def network_io(network) -> dict:
    """{"inputs": [...], "outputs": [...]} as {name, shape, dtype}; a dynamic leading dim is "B"."""
    def rec(t):
        shape = ["B" if d == -1 else int(d) for d in tuple(t.shape)]
        return {"name": t.name, "shape": shape, "dtype": C.dtype_name(t.dtype)}

    return {"inputs": [rec(network.get_input(i)) for i in range(network.num_inputs)],
            "outputs": [rec(network.get_output(i)) for i in range(network.num_outputs)]}
