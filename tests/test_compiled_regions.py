"""Regional compile on CPU (torch_compile.CompiledRegions with the aot_eager backend: Dynamo + AOTAutograd as Inductor
receives them): the steps' tokens equal the uncompiled steps' (greedy plain and DFlash, sampled DFlash), every piece
traces whole, the step's glue breaks only at its calls into the models, and the number of compiled graphs does not
grow with the layer count (one graph per piece and key, reused by every layer of its kind)."""
import numpy as np
import pytest
import torch

from dflash_trt.abi import PoolSizes
from dflash_trt.modeling.regions import EAGER
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.backends.torch_compile import CompiledRegions, compile_steps
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.bench_dense import build_random_dense

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
SIZES = PoolSizes(kv_blocks=96, page_size=4, max_seq_len=96, max_seqs=2, dkv_blocks=96, prefill_chunk=16)
DIMS = dict(hidden=64, inter=128, heads=4, kv_heads=2, head_dim=32, gdn_k=2, gdn_v=4, gdn_dim=32, vocab=256,
            d_heads=4, d_kv_heads=2, d_head_dim=16)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's caches hang on the code objects (the fused steps' methods, shared with the whole-step compile's tests):
    each test here starts and leaves them empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair(layers: int):
    torch.manual_seed(0)
    return build_random_dense(torch.float32, "cpu", layers, dims=DIMS)


def _runtime(pair):
    t, d = pair
    return Runtime(TorchBackend(t, d), t.cfg, d.cfg, SIZES, device=TorchCpuDevice(),
                   executor=lambda rt: GraphStepExecutor(rt, inflight=1))


def _runs(rt, prompt):
    return [rt.generate(prompt, 8, gamma=g, spec=s, **kw)[0] for g, s, kw in
            ((None, False, {}), (3, True, {}), (3, True, dict(temperature=1.0, top_k=8, seed=11)))]


def _regional(pair, prompt):
    """(compiled runs, uncompiled runs, Dynamo's graph count) with the target's pieces compiled."""
    want = _runs(_runtime(pair), prompt)
    rt = _runtime(pair)
    compile_steps(rt.executor.steps, backend="aot_eager", regions=True)
    counters = torch._dynamo.utils.counters
    counters.clear()
    regions = rt.executor.steps.graphs.regions
    got = _runs(rt, prompt)
    # the glue's only graph breaks: its calls into the models (CompiledRegions.model_call), pieces compiled inside
    breaks = [why for why in counters["graph_break"] if "_model_call" not in why]
    assert counters["graph_break"] and not breaks and not regions.failures, (breaks, regions.failures)
    return got, want, counters["stats"]["unique_graphs"]


def test_regional_steps_match_uncompiled_and_compile_once_per_kind_of_layer():
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, 250, 9)]
    got, want, graphs4 = _regional(_pair(4), prompt)
    assert got == want
    torch._dynamo.reset()
    got, want, graphs8 = _regional(_pair(8), prompt)
    assert got == want
    # embedding, GDN layer, attention layer, head (x prefill / decode / verify shapes) and the drafter graphs: the
    # same set of graphs for 4 and for 8 layers (one and two periods of 3 GDN : 1 attention)
    assert graphs4 == graphs8 and graphs4 > 0, (graphs4, graphs8)


def test_compiled_pieces_belong_to_their_runtime_not_to_the_modules():
    """A second runtime over the same modules runs its pieces as they are (it compiled nothing): the compiled
    pieces live on the first runtime's graphs, not on the shared modules."""
    pair = _pair(4)
    compiled = _runtime(pair)
    compile_steps(compiled.executor.steps, backend="aot_eager", regions=True)
    other = _runtime(pair)
    assert isinstance(compiled.executor.steps.graphs.regions, CompiledRegions)
    assert other.executor.steps.graphs.regions is EAGER
    other.generate([3, 14, 15, 92, 65], 4, gamma=None, spec=False)
    assert not compiled.executor.steps.graphs.regions.compiled  # the other runtime's steps did not run its pieces


def test_pieces_take_their_own_layer_of_a_pool():
    """A compiled piece takes its layer's slice of a pool with index 0 (an index would specialise the piece per
    layer); the eager step and the exported graphs take the whole pool and the layer's index."""
    pool = torch.arange(24.0).view(4, 6)
    view, i = CompiledRegions("aot_eager").layer_of(pool, 2)
    assert i == 0 and view.shape == (1, 6) and view.data_ptr() == pool[2].data_ptr()
    assert EAGER.layer_of(pool, 2) == (pool, 2)


def test_a_piece_that_cannot_compile_runs_eagerly_and_says_why():
    regions = CompiledRegions("aot_eager")

    def piece(x):
        torch._dynamo.graph_break()  # fullgraph: the trace fails before anything ran
        return x + 1

    with pytest.warns(UserWarning, match="compiled piece piece fell back to eager"):
        assert torch.equal(regions(piece, torch.zeros(2)), torch.ones(2))
    assert piece in regions.failures
    assert torch.equal(regions(piece, torch.ones(2)), torch.full((2,), 2.0))


def test_compile_steps_takes_true_false_or_regions():
    t, d = _pair(4)
    assert TorchBackend(t, d, compile_steps="regions").compile_regions
    with pytest.raises(ValueError, match="True, False or 'regions'"):
        TorchBackend(t, d, compile_steps="whole")


def test_decode_gdn_piece_commits_into_its_pool_slice_in_place(monkeypatch):
    """With the CUDA path's op calls, the decode step's GDN piece hands dflash::gdn_decode its own input (the
    layer's pool slice) as the base it mutates: no copy of the pool inside the piece; tokens as the reference."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from dflash_trt.plugins import seam_base, torch_ops  # noqa: F401

    pair = _pair(4)
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, 250, 9)]
    want = _runtime(pair).generate(prompt, 6, gamma=None, spec=False)[0]
    monkeypatch.setattr(seam_base, "cuda_ops", lambda t: torch.ops.dflash)
    graphs = []
    rt = _runtime(pair)
    compile_steps(rt.executor.steps, backend=aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or
                                                          make_boxed_func(gm.forward)), regions=True)
    torch._dynamo.reset()
    assert rt.generate(prompt, 6, gamma=None, spec=False)[0] == want
    decodes = [n for gm in graphs for n in gm.graph.nodes if n.target == torch.ops.higher_order.auto_functionalized_v2
               and n.args[0] == torch.ops.dflash.gdn_decode.default]
    assert len(decodes) == 1, len(decodes)  # one graph for the GDN layers' decode piece, one op in it
    base = decodes[0].kwargs["_all_bases"][0]
    assert base.op == "placeholder" and tuple(base.meta["val"].shape)[0] == 1


def test_regional_steps_of_a_sparse_moe_target_match_uncompiled(tmp_path):
    """A sparse-MoE target (its MoE and dense MLP layers are pieces of their own kinds): tokens as uncompiled."""
    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.tools.tiny import TINY_MOE, make_tiny_pair

    tdir, ddir = make_tiny_pair(str(tmp_path), seed=5, target_over=dict(TINY_MOE))
    t = load_target(tdir)
    got, want, graphs = _regional((t, load_drafter(ddir, t)), [3, 14, 15, 92, 65, 35, 89, 79, 32])
    assert got == want and graphs > 0
