"""The TensorRT backend on CPU: engines for the shipped trained pair build with TensorRT-RTX, the binding
plan of every engine and batch bucket matches the ABI (names, shapes, dtypes) and the pool layout — one test per
graph kind — and any manifest/engine mismatch is refused before a context exists or anything launches.

No machine here executes engines, so `TrtBackend` runs once over stand-in engines whose contexts read and write
the very addresses the backend binds (ctypes views of the CPU pools and buffers) and compute with the torch
reference: the runtime's graph executor then decodes through the backend's binding, padding and launch order,
and its tokens must equal the stored CPU reference tokens. Real execution: tests/test_trt_backend_gpu.py."""
import ctypes
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dflash_trt.plugins import trt_compat as C

pytestmark = pytest.mark.skipif(not C.HAVE_TRT, reason=f"no TensorRT: {C.IMPORT_ERROR}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
KS = [1, 16]
GRAPHS_BY_KIND = {"target": ["target_k1", "target_k16"], "prefill": ["target_prefill"],
                  "drafter_ctx": ["drafter_ctx"], "drafter_block": ["drafter_block"]}


def sizes():
    from dflash_trt.abi import PoolSizes

    return PoolSizes(max_seq_len=512, kv_blocks=64, dkv_blocks=96)  # as tests/reference_tokens.py


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The trained pair exported (cached by checkpoint hashes) and its engines built into a copy (~6 s)."""
    from dflash_trt.engines.build import build_engines
    from dflash_trt.export.onnx_export import ensure_export

    src = ensure_export(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"), ks=KS, sizes=sizes(),
                        progress=None)
    d = str(tmp_path_factory.mktemp("trt_backend") / "m")
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("engines"))
    build_engines(d, ks=KS, progress=None)
    return d


def _tamper(built, tmp_path, edit):
    d = str(tmp_path / "m")
    shutil.copytree(built, d)
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(m)
    with open(path, "w") as f:
        json.dump(m, f)
    return d


def test_trained_pair_engines_build_and_are_loadable(built):
    from dflash_trt.engines.load import check_engine
    from dflash_trt.manifest import Manifest

    man = Manifest.load(built)
    assert sorted(man.data["engines"]) == sorted(g for gs in GRAPHS_BY_KIND.values() for g in gs)
    for g in man.graphs:
        rec = check_engine(man, g)  # every load-time refusal passes, kernel shapes included (no warnings)
        assert rec["kernel_warnings"] == [] and rec["batch"] == {"min": 1, "opt": 1, "max": man.sizes.max_seqs}
    assert set(man.data["engines"]["target_k16"]["plugins"]) == {"GdnChunkWY16", "CausalConvVerify", "PagedAttention"}


def test_buckets_stop_at_the_widest_when_slots_outnumber_rows():
    """More state slots than the widest bucket (slots for requests that finish while others join): the buckets
    stop at 64; a static-batch export keeps its batch."""
    from dataclasses import asdict

    from dflash_trt.abi import PoolSizes
    from dflash_trt.manifest import Manifest
    from dflash_trt.runtime.backends.trt_plan import buckets

    sizes = asdict(PoolSizes(max_seqs=100))
    assert buckets(Manifest({"batch": None, "sizes": sizes})) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(Manifest({"batch": None, "sizes": {**sizes, "max_seqs": 5}})) == [1, 2, 4, 8]
    assert buckets(Manifest({"batch": 2, "sizes": sizes})) == [2]


@pytest.mark.parametrize("kind", list(GRAPHS_BY_KIND))
def test_binding_plan_matches_abi_and_pools(built, kind):
    """Oracle: abi.graph_io evaluated at each concrete bucket, and the pools the Runtime allocates."""
    from dflash_trt.abi import graph_io, pool_specs
    from dflash_trt.manifest import Manifest
    from dflash_trt.runtime.backends.trt_plan import buckets, runtime_plan

    man = Manifest.load(built)
    plans = runtime_plan(man)
    assert buckets(man) == [1, 2, 4]  # every bucket up to max_seqs = 4, inside the 1..4 profile
    pools = pool_specs(man.target_config, man.drafter_config, man.sizes, man.kv_dtype)
    for g in GRAPHS_BY_KIND[kind]:
        for B in (1, 2, 4):
            p = plans[(g, B)]
            ins, outs = graph_io(g, man.target_config, man.drafter_config, man.sizes, B=B, want_logits=True)
            assert [(b.name, b.shape, b.dtype) for b in p.inputs] == [(n, tuple(s), d) for n, s, d in ins]
            assert [(b.name, b.shape, b.dtype) for b in p.outputs] == [(n, tuple(s), d) for n, s, d in outs]
            for b in p.inputs:
                if b.name in pools:
                    assert (b.source, b.pool, b.shape, b.dtype, b.dynamic) == (
                        "pool", b.name, tuple(pools[b.name][0]), pools[b.name][1], False)
                else:
                    assert b.source == "step" and b.dynamic and b.shape[0] == B
                assert b.pad_rows == (kind == "drafter_ctx")
            assert all(b.source == "output" and B in b.shape for b in p.outputs)
            assert p.input_shapes == {b.name: b.shape for b in p.inputs if b.source == "step"}
            assert p.engine_file == f"engines/{g}.engine"
    want = {"target": {"kv_pool", "gdn_pool", "conv_pool"}, "prefill": {"kv_pool", "gdn_pool", "conv_pool"},
            "drafter_ctx": set(), "drafter_block": {"dkv_pool"}}[kind]
    assert {b.pool for b in plans[(GRAPHS_BY_KIND[kind][0], 1)].inputs if b.pool} == want
    if kind == "drafter_ctx":
        assert plans[("drafter_ctx", 2)].binding("positions").shape == (2, man.sizes.max_append)


def test_launch_order_of_a_step():
    from dflash_trt.runtime.backends.trt_plan import step_launches

    assert step_launches("spec", 16, 16) == (("engine", "drafter_block"), ("engine", "target_k16"),
                                             ("kernels", "accept"), ("engine", "drafter_ctx"),
                                             ("kernels", "commit"), ("kernels", "advance"))
    assert step_launches("spec", 4, 16)[0] == ("engine", "drafter_block_b4")
    assert [x for x in step_launches("decode", 1, None)] == [("engine", "target_k1"), ("kernels", "commit"),
                                                             ("kernels", "advance")]
    assert step_launches("prefill", 64, 16)[:2] == (("engine", "target_prefill"), ("engine", "drafter_ctx"))


def _extra_output(m):
    m["engines"]["target_k1"]["io"]["outputs"].append({"name": "debug", "shape": ["B"], "dtype": "float32"})


def _missing_input(m):
    m["engines"]["drafter_block"]["io"]["inputs"].pop(3)


def _dtype(m):
    m["engines"]["target_k16"]["io"]["outputs"][1]["dtype"] = "float16"


def _dims(m):
    m["engines"]["drafter_ctx"]["io"]["inputs"][0]["shape"][1] = 8


def _profile(m):
    m["engines"]["target_prefill"]["batch"]["max"] = 2


def _no_engine(m):
    del m["engines"]["drafter_ctx"]


@pytest.mark.parametrize("edit,msg", [
    (_extra_output, r"engine target_k1 .*output names .*'debug'"),
    (_missing_input, r"engine drafter_block .*input names"),
    (_dtype, r"engine target_k16 .*output kv_rows dtype float16 in engine, float32 in manifest"),
    (_dims, r"engine drafter_ctx .*input ctx_hidden dims \['B', 8, 512\] in engine"),
    (_profile, r"engine target_prefill .*batch bucket 4 is outside the engine's batch profile 1..2"),
    (_no_engine, r"no TensorRT engine for graph drafter_ctx"),
])
def test_manifest_engine_mismatch_refused_before_any_launch(built, tmp_path, edit, msg):
    from dflash_trt.engines.load import EngineError
    from dflash_trt.runtime.backends.trt import TrtBackend

    d = _tamper(built, tmp_path, edit)
    engines = _fake_engines(d, None, None)
    with pytest.raises(EngineError, match=msg):
        TrtBackend(d, engines=engines)
    assert all(e.contexts == 0 for e in engines.values())  # nothing was bound or launched


def test_pool_layout_disagreement_refused(built):
    from dflash_trt.manifest import Manifest
    from dflash_trt.runtime.backends.trt_plan import PlanError, runtime_plan, runtime_pools

    man = Manifest.load(built)
    pools = runtime_pools(man)
    shape, dt = pools["kv_pool"]
    pools["kv_pool"] = ((shape[0], shape[1], shape[2] * 2) + shape[3:], dt)  # a runtime with more pages
    with pytest.raises(PlanError, match=r"input kv_pool is .* the runtime's pool is .*pool layout differs"):
        runtime_plan(man, pools=pools)
    pools = runtime_pools(man)
    pools["dkv_pool"] = (pools["dkv_pool"][0], "bfloat16")
    with pytest.raises(PlanError, match=r"dkv_pool .*bfloat16"):
        runtime_plan(man, pools=pools)


# ---------------------------------------------------------------- stand-in engines over the bound addresses
_TORCH = {"float32": "float32", "int64": "int64", "bfloat16": "bfloat16", "float16": "float16"}


def _at(ptr, shape, dtype):
    """A torch view of `shape` at the address the backend bound (CPU memory)."""
    import torch

    dt = getattr(torch, _TORCH[dtype])
    n = int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
    return torch.frombuffer((ctypes.c_byte * n).from_address(ptr), dtype=dt).view(tuple(shape))


class _FakeContext:
    def __init__(self, eng):
        self.eng, self.addr, self.shapes = eng, {}, {}

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.addr[name] = int(ptr)
        return True

    def execute_async_v3(self, stream):
        import torch

        from dflash_trt.export.graphs import run_graph

        io = self.eng.io
        dyn = [t["name"] for t in io["inputs"] if "B" in t["shape"]]
        assert sorted(self.shapes) == sorted(dyn)  # the plan told the context every dynamic shape
        B = self.shapes[dyn[0]][0]
        conc = lambda t: [B if d == "B" else d for d in t["shape"]]
        x = {t["name"]: _at(self.addr[t["name"]], conc(t), t["dtype"]) for t in io["inputs"]}
        for t in io["inputs"]:
            if t["name"] in self.shapes:
                assert list(self.shapes[t["name"]]) == conc(t)
        with torch.no_grad():
            out = run_graph(self.eng.graph, self.eng.target, self.eng.drafter, x, want_logits=True)
        for t in io["outputs"]:
            _at(self.addr[t["name"]], conc(t), t["dtype"]).copy_(out[t["name"]])
        self.eng.launches += 1
        return True


class _FakeEngine:
    def __init__(self, graph, io, target, drafter):
        self.graph, self.io, self.target, self.drafter = graph, io, target, drafter
        self.contexts = self.launches = 0

    def create_context(self):
        self.contexts += 1
        return _FakeContext(self)


def _fake_engines(d, target, drafter):
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    return {g: _FakeEngine(g, rec["io"], target, drafter) for g, rec in m["engines"].items()}


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(ROOT, "tests", "data", "trained_greedy_128.json")) as f:
        return json.load(f)


def test_backend_binding_decodes_reference_tokens_through_the_graph_executor(built, reference):
    import torch

    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
    from dflash_trt.runtime.backends.trt import TrtBackend
    from dflash_trt.runtime.backends.trt_plan import step_launches
    from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
    from dflash_trt.runtime.runtime import Runtime

    t = load_target(os.path.join(MODELS, "target"), torch.float32)
    dr = load_drafter(os.path.join(MODELS, "drafter"), t, torch.float32)
    dev = TorchCpuDevice()
    engines = _fake_engines(built, t, dr)
    be = TrtBackend(built, device=dev, engines=engines)
    rt = Runtime(be, be.tcfg, be.dcfg, be.sizes, device=dev, executor=GraphStepExecutor)
    n = 24
    ids, ref = reference["prompt_ids"][0], reference["tokens"][0][:n]
    got, _ = rt.generate(ids, n, spec=False)
    assert got == ref
    be.launches = []
    got, st = rt.generate(ids, n, gamma=15)
    assert got == ref and st.tau > 1.5
    spec = [g for w, g in step_launches("spec", 16, 16) if w == "engine"]
    i = be.launches.index("drafter_block")
    assert be.launches[i:i + len(spec)] == spec
    # batch 4: bucket 4 contexts, padding-free; every request == its reference
    reqs = [rt.add_request(reference["prompt_ids"][k], 12, gamma=15) for k in range(4)]
    while rt.has_work:
        rt.step()
    for k, r in enumerate(reqs):
        assert r.tokens == reference["tokens"][k][:12], k
    assert ("target_k16", 4) in be._contexts and all(e.contexts <= 3 for e in engines.values())


def test_compare_backends_on_cpu_stand_ins(built):
    """`compare` drives the backend's numpy `run` path (what `--backends torch,trt` uses)."""
    import torch

    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.runtime.backends.trt import TrtBackend
    from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
    from dflash_trt.tools.compare import compare

    t = load_target(os.path.join(MODELS, "target"), torch.float32)
    dr = load_drafter(os.path.join(MODELS, "drafter"), t, torch.float32)
    be = TrtBackend(built, device=TorchCpuDevice(), engines=_fake_engines(built, t, dr))
    rep = compare(built, ["torch", be], prompts=["def add(a, b):"], steps=3, names=["torch", "trt"])
    assert rep.ok, rep.format()
    assert rep.kl and max(k for *_, k in rep.kl) < 1e-6


def test_cli_generate_backend_trt_one_line_where_engines_cannot_run():
    from dflash_trt.engines.load import EngineError, check_can_execute

    try:
        check_can_execute()
        pytest.skip("this machine can execute TensorRT engines")
    except EngineError as e:
        why = str(e)
    r = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "--model", os.path.join(MODELS, "target"),
                        "--drafter", os.path.join(MODELS, "drafter"), "--prompt", "hi", "--backend", "trt"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines == [f"dflash-trt generate: error: {why}"]
    assert "cannot run here" in why and "TensorRT-RTX" in why and "Hopper" in why
