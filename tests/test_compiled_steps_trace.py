"""The compiled GPU steps' tracing, on CPU: torch.compile(fullgraph=True) of the fused prefill, decode and spec steps
(runtime/backends/torch_compile.py) with the aot_eager backend — Dynamo + AOTAutograd, our dflash:: ops opaque
through their fake impls, exactly what Inductor receives, without generating code. A graph break or an op
without a usable fake impl fails here; the compiled steps' tokens (greedy and sampled) equal the uncompiled
steps'. (The Inductor code itself runs on the GPU: tests/test_gpu_compiled_steps.py.)"""
import os

import numpy as np
import pytest
import torch

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.backends.torch_compile import compile_steps
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import make_tiny_pair

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
SIZES = PoolSizes(kv_blocks=96, page_size=4, max_seq_len=96, max_seqs=2, dkv_blocks=96, prefill_chunk=16)
N_NEW = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tdir, ddir = make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=5)
    target = load_target(tdir)
    return target, load_drafter(ddir, target)


def _runtime(pair):
    t, d = pair
    return Runtime(TorchBackend(t, d), t.cfg, d.cfg, SIZES, device=TorchCpuDevice(),
                   executor=lambda rt: GraphStepExecutor(rt, inflight=1))


def _runs(rt, prompt):
    return [rt.generate(prompt, N_NEW, gamma=g, spec=s, **kw)[0] for g, s, kw in
            ((None, False, {}), (3, True, {}), (3, True, dict(temperature=1.0, top_k=8, seed=11)))]


def _traced(pair, runs, prompt, graphs: int):
    """(compiled runs, uncompiled runs, the compiled runtime) of runs(rt, prompt); every compiled key traced whole."""
    want = runs(_runtime(pair), prompt)
    rt = _runtime(pair)
    compile_steps(rt.executor.steps, backend="aot_eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    got = runs(rt, prompt)
    assert counters["stats"]["unique_graphs"] >= graphs, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    return got, want, rt


def test_compiled_steps_trace_whole_and_match_uncompiled(pair, capsys):
    prompt = [int(x) for x in np.random.default_rng(2).integers(0, 250, 9)]
    # prefill and decode K=1 greedy and sampled, spec K=4 greedy and sampled: one whole graph each (fullgraph)
    got, want, _ = _traced(pair, _runs, prompt, 5)
    assert got == want
    # each key's compile is announced on stderr once, then its time; a key seen again is not
    err = capsys.readouterr().err.splitlines()
    started = [x for x in err if x.startswith("compiling step ")]
    done = [x for x in err if x.startswith("compiled step ")]
    assert len(started) == len(done) == len(set(started)) >= 5, err
    for line in ("compiling step decode batch 1 ...", "compiling step spec batch 1 K=4 ...",
                 "compiling step spec batch 1 K=4 sampled ...", "compiling step prefill batch 1 16 rows ..."):
        assert line in started, started


def test_inductor_cache_goes_under_the_dflash_trt_cache(tmp_path, monkeypatch):
    """Inductor's caches follow DFLASH_TRT_CACHE (a later process loads the compiled steps from there), unless the
    user points TORCHINDUCTOR_CACHE_DIR elsewhere."""
    from dflash_trt.runtime.backends.torch_compile import use_cache_dir

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    want = str(tmp_path / "cache" / "inductor")
    assert use_cache_dir() == want and os.path.isdir(want)
    import torch._inductor.runtime.runtime_utils as ru

    assert ru.cache_dir() == want  # where Inductor itself now reads and writes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_cache_dir() == str(tmp_path / "mine")


def _logprobs_runs(rt, prompt):
    """A greedy and a sampled DFlash request asking for logprobs: (tokens, logprobs, top ids)."""
    out = []
    for kw in (dict(gamma=3), dict(gamma=3, temperature=1.0, top_k=8, seed=11)):
        req = rt.add_request(prompt, N_NEW, logprobs=3, **kw)
        while rt.has_work:
            rt.step()
        out.append((req.tokens, [e.logprob for e in req.logprobs], [[i for i, _ in e.top] for e in req.logprobs]))
    return out


def test_compiled_logprobs_steps_trace_whole_and_match_uncompiled(pair):
    """The logprobs keys (log_softmax + top-k packed into the result rows) trace as one graph each, same values."""
    prompt = [int(x) for x in np.random.default_rng(4).integers(0, 250, 9)]
    got, want, rt = _traced(pair, _logprobs_runs, prompt, 4)  # prefill and spec, greedy and sampled
    for (gt, gl, gi), (wt, wl, wi) in zip(got, want):
        assert gt == wt and gi == wi and np.allclose(gl, wl, atol=1e-5) and len(gl) == N_NEW
    assert any(k[-1] == "logprobs" for k in rt.executor.buffers)


def test_failed_compile_falls_back_to_eager_with_correct_tokens(pair):
    """A backend that fails: each step runs uncompiled, the reason is kept, the tokens are the uncompiled ones."""
    def broken(gm, example_inputs):
        raise RuntimeError("forced compile failure")

    prompt = [int(x) for x in np.random.default_rng(3).integers(0, 250, 7)]
    want = _runs(_runtime(pair), prompt)
    rt = _runtime(pair)
    compile_steps(rt.executor.steps, backend=broken)
    with pytest.warns(UserWarning, match="fell back to eager"):
        got = _runs(rt, prompt)
    assert got == want
    for name in ("prefill", "decode", "spec"):
        step = getattr(rt.executor.steps, name)
        assert step.eager_keys and "forced compile failure" in " ".join(step.failures), step.failures


@pytest.mark.slow  # test_failed_compile_falls_back_to_eager_with_correct_tokens takes the same fallback in the suite
def test_failed_compile_of_one_key_leaves_the_others_compiled(pair):
    """A backend that fails only for sampled steps (their buffers carry the sampling fields): greedy keys stay
    compiled and keep compiling, sampled keys run uncompiled, every token as the uncompiled steps'."""
    def greedy_only(gm, example_inputs):
        if any("temperature" in str(n.target) or "temperature" in n.name for n in gm.graph.nodes):
            raise RuntimeError("forced compile failure of a sampled key")
        return gm.forward

    prompt = [int(x) for x in np.random.default_rng(4).integers(0, 250, 8)]
    want = _runs(_runtime(pair), prompt)
    rt = _runtime(pair)
    compile_steps(rt.executor.steps, backend=greedy_only)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="others stay compiled"):
        got = _runs(rt, prompt)
    assert got == want
    spec = rt.executor.steps.spec
    assert len(spec.eager_keys) == 1 and "sampled key" in spec.failures[0], spec.failures
    assert not rt.executor.steps.decode.eager_keys  # the decode step ran greedy only: compiled
    calls = []  # (compiled?, sampled?) of every spec step of a second greedy + sampled run
    spy = lambda f, tag: lambda b, *a, **k: calls.append((tag, "temperature" in b)) or f(b, *a, **k)  # noqa: E731
    spec.compiled, spec.fn = spy(spec.compiled, "compiled"), spy(spec.fn, "eager")
    assert _runs(rt, prompt) == want
    assert ("compiled", False) in calls and ("eager", True) in calls
    assert ("compiled", True) not in calls and ("eager", False) not in calls, calls


def _dflash_ops(t):
    """seam_base.cuda_ops for any device: the model calls the dflash:: ops as it does on CUDA (their CPU kernels are the
    reference math), so the traced graph is the one Inductor receives on the GPU."""
    from dflash_trt.plugins import torch_ops  # noqa: F401

    return torch.ops.dflash


def _producer(node):
    while node.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                          torch.ops.aten.reshape.default):
        node = node.args[0]
    return node.target


def test_step_graph_casts_indices_once_and_reads_pools_in_place(pair, monkeypatch):
    """With the CUDA path's op calls: every int32 index tensor comes from one opaque dflash::as_int32 shared by the
    op calls that read it (a plain cast is recomputed into each call by Inductor: opaque_ops.py), and the GDN and
    conv ops read the pool layer by slot (a select of the pool, not a gathered copy); the decode step's in-place GDN
    ops chain on the pool itself. Tokens as the reference path."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from dflash_trt.plugins import seam_base

    prompt = [int(x) for x in np.random.default_rng(5).integers(0, 250, 9)]
    want = _runs(_runtime(pair), prompt)[:2]
    monkeypatch.setattr(seam_base, "cuda_ops", _dflash_ops)
    graphs = []
    rt = _runtime(pair)
    compile_steps(rt.executor.steps, backend=aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or
                                                          make_boxed_func(gm.forward)))
    torch._dynamo.reset()
    assert [rt.generate(prompt, N_NEW, gamma=g, spec=s)[0] for g, s in ((None, False), (3, True))] == want
    assert len(graphs) >= 2
    for gm in graphs:
        nodes = list(gm.graph.nodes)
        casts = [n for n in nodes if n.target == torch.ops.dflash.as_int32.default]
        plain = [n for n in nodes if n.target in (torch.ops.prims.convert_element_type.default,
                                                  torch.ops.aten._to_copy.default)
                 and torch.int32 in (list(n.args[1:]) + list(n.kwargs.values()))]
        assert not plain, [str(n) for n in plain]
        reads = sum(len(c.users) for c in casts)
        assert 2 <= len(casts) <= 8 and reads >= 2 * len(casts), (len(casts), reads)
        states = [n.args[5] for n in nodes if n.target == torch.ops.dflash.gdn_wy16.default]
        convs = [n.args[1] for n in nodes if n.target == torch.ops.dflash.conv_verify.default]
        # the decode step's GDN ops commit in place: each mutates the whole pool after the one before (no copy)
        decodes = [n for n in nodes if n.target == torch.ops.higher_order.auto_functionalized_v2
                   and n.args[0] == torch.ops.dflash.gdn_decode.default]
        assert len(states) + len(decodes) == len(convs) == len(pair[0].cfg.gdn_layers) and not (states and decodes)
        assert {_producer(s) for s in states + convs} == {torch.ops.aten.select.int}
        pools = [d.kwargs["_all_bases"][0] for d in decodes]
        assert all(p.op == "placeholder" if i == 0 else p.args[0] is decodes[i - 1] for i, p in enumerate(pools))


def _greedy_runs(rt, prompt):
    return [rt.generate(prompt, N_NEW, gamma=g, spec=s)[0] for g, s in ((None, False), (3, True))]


def test_stored_steps_load_in_a_later_runtime_without_tracing(pair, tmp_path, monkeypatch, capsys):
    """With a step store (runtime/backends/step_store.py) each key is AOT-compiled once and saved; a later runtime
    of the same model loads the files and traces nothing, with the uncompiled steps' tokens. A torn file is compiled
    again and replaced."""
    from dflash_trt.runtime.backends import step_store

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, 250, 9)]
    want = _greedy_runs(_runtime(pair), prompt)
    first = _runtime(pair)
    compile_steps(first.executor.steps, backend="aot_eager", store=True)
    assert _greedy_runs(first, prompt) == want
    files = sorted((tmp_path / step_store.SUBDIR).glob("*.aot"))
    assert len(files) == 3, files  # prefill, decode, spec K=4
    assert step_store.read_marker(str(tmp_path / step_store.SUBDIR))["kind"] == step_store.KIND
    capsys.readouterr()

    counters = torch._dynamo.utils.counters
    counters.clear()
    later = _runtime(pair)
    compile_steps(later.executor.steps, backend="aot_eager", store=True)
    assert _greedy_runs(later, prompt) == want
    err = capsys.readouterr().err
    assert err.count("loaded compiled step") == 3 and "compiling step" not in err, err
    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])  # Dynamo traced nothing

    torn = next(f for f in files if f.name.startswith("decode-"))
    torn.write_bytes(torn.read_bytes()[:100])
    again = _runtime(pair)
    compile_steps(again.executor.steps, backend="aot_eager", store=True)
    assert _greedy_runs(again, prompt) == want
    err = capsys.readouterr().err
    assert "stored step decode batch 1 not usable" in err and err.count("compiling step") == 1, err
    assert torn.stat().st_size > 100


def test_stored_steps_are_keyed_by_what_the_trace_depends_on(pair, monkeypatch):
    """Another switch of the step code (DFLASH_TRT_*) or other pool sizes give another fingerprint: no stale file."""
    from dflash_trt.runtime.backends.step_store import fingerprint

    base = fingerprint(_runtime(pair).executor.steps, "aot_eager", None)
    assert fingerprint(_runtime(pair).executor.steps, "aot_eager", None) == base
    assert fingerprint(_runtime(pair).executor.steps, "inductor", {"combo_kernels": True}) != base
    monkeypatch.setenv("DFLASH_TRT_PDL", "0")
    assert fingerprint(_runtime(pair).executor.steps, "aot_eager", None) != base
    monkeypatch.delenv("DFLASH_TRT_PDL")
    t, d = pair
    other = Runtime(TorchBackend(t, d), t.cfg, d.cfg, PoolSizes(kv_blocks=96, page_size=4, max_seq_len=96, max_seqs=3,
                    dkv_blocks=96, prefill_chunk=16), device=TorchCpuDevice(),
                    executor=lambda rt: GraphStepExecutor(rt, inflight=1))
    assert fingerprint(other.executor.steps, "aot_eager", None) != base


def test_a_torch_that_cannot_aot_compile_compiles_in_process(pair, tmp_path, monkeypatch, capsys):
    """The AOT API is experimental: where it raises, the step compiles through Dynamo's in-process cache instead,
    once said, with the uncompiled steps' tokens."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    prompt = [int(x) for x in np.random.default_rng(6).integers(0, 250, 9)]
    want = _greedy_runs(_runtime(pair), prompt)
    rt = _runtime(pair)
    compile_steps(rt.executor.steps, backend="aot_eager", store=True)
    for name in ("prefill", "decode", "spec"):
        step = getattr(rt.executor.steps, name)
        monkeypatch.setattr(step.unbound, "aot_compile", lambda *a: (_ for _ in ()).throw(NotImplementedError("no")))
    assert _greedy_runs(rt, prompt) == want
    err = capsys.readouterr().err
    assert "not AOT-compiled (NotImplementedError: no): compiling it in process" in err, err
    assert not (tmp_path / "steps").exists()


def test_the_store_is_on_by_default_from_the_checked_torch(monkeypatch):
    """Stored steps are the default from step_store.MIN_TORCH on (where this torch has the API); the switch decides
    either way."""
    from dflash_trt.runtime.backends import step_store

    monkeypatch.delenv("DFLASH_TRT_STEP_STORE", raising=False)
    assert step_store.default_on() == (step_store.supported() and tuple(
        int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= step_store.MIN_TORCH)
    monkeypatch.setenv("DFLASH_TRT_STEP_STORE", "0")
    assert not step_store.default_on()
    monkeypatch.setenv("DFLASH_TRT_STEP_STORE", "1")
    assert step_store.default_on() == step_store.supported()
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    monkeypatch.delenv("DFLASH_TRT_STEP_STORE")
    assert not step_store.default_on()
