"""Compiled steps (runtime/backends/torch_compile.py: Inductor inside the step's CUDA graph) on the shipped trained
pair, fp32: plain and DFlash γ=15 tokens == the CPU reference for 128 new tokens; the compiled step's graph replay
== its launch outside the graph, bit for bit; the compile really fused something (fewer kernels a step); and in bf16
no compiled step copies a pool. The regional compile (compile_steps="regions"): tokens == the CPU reference, no piece
copies a pool layer."""
import os

import numpy as np
import pytest

from test_gpu_runtime import MODELS, N_NEW, gpu_runtime, modules, reference  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not os.path.isfile(os.path.join(MODELS, "drafter", "config.json")), reason="no trained pair in models/")]


@pytest.fixture(scope="module")
def compiled_rt(modules):  # noqa: F811
    rt = gpu_runtime(modules, compile_steps=True)
    assert rt.backend.compile_steps
    return rt


def test_compiled_steps_tokens_equal_cpu_reference(compiled_rt, reference):  # noqa: F811
    rt = compiled_rt
    for i in range(2):
        for gamma, spec in ((None, False), (15, True)):
            out, st = rt.generate(reference["prompt_ids"][i], N_NEW, gamma=gamma, spec=spec)
            assert out == reference["tokens"][i], (i, spec)
    assert not rt.executor.eager_keys, rt.device.capture_failures


def _kernels(rt, kind, K, vals, eager_steps=None):
    import torch

    ex = rt.executor
    fn = (lambda: eager_steps(ex.buffers[(kind, K, 1)].views)) if eager_steps else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        if fn is None:
            ex.run_key(kind, K, 1, vals, eager=True)
        else:
            with rt.device.on_stream():
                fn()
            rt.device.synchronize()
    return sum(e.count for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0)


def test_compiled_replay_bit_identical_and_fused(compiled_rt, reference):  # noqa: F811
    """Replay vs launch outside the graph on the same live state: same result bits and pools; and the compiled
    decode step launches fewer kernels than the reference modules' eager step (the compile took effect)."""
    import torch

    from dflash_trt.runtime import commit
    from dflash_trt.runtime.backends.torch_backend import ModuleGraphs
    from dflash_trt.runtime.backends.torch_fused_step import FusedSteps
    from dflash_trt.runtime.batching import pad_rows

    rt = compiled_rt
    ex = rt.executor
    seq = rt.add_sequence(reference["prompt_ids"][0])
    rt.prefill(seq)
    for kind, K in (("decode", 1), ("spec", 16)):
        commit.reserve(seq, K, rt.kv_alloc, rt.sizes.page_size)
        vals = ex._tables(pad_rows([seq]))
        ex.entry(kind, K, 1)
        assert ex.graphs[(kind, K, 1)] is not None
        with rt.device.on_stream():
            before = {k: v.clone() for k, v in rt.pools.items()}, ex.steps.state.seq_len.clone(), ex.steps.state.bonus.clone()
        rt.device.synchronize()
        eager = ex.run_key(kind, K, 1, vals, eager=True)
        with rt.device.on_stream():
            after_eager = {k: v.clone() for k, v in rt.pools.items()}
            for k, v in before[0].items():
                rt.pools[k].copy_(v)
            ex.steps.state.seq_len.copy_(before[1]), ex.steps.state.bonus.copy_(before[2])
        rt.device.synchronize()
        replay = ex.run_key(kind, K, 1, vals)
        assert np.array_equal(eager, replay), kind
        for k in rt.pools:
            assert torch.equal(rt.pools[k], after_eager[k]), (kind, k)
        if kind == "decode":
            plain = FusedSteps(ModuleGraphs(rt.backend.target, rt.backend.drafter), rt)
            plain.state = ex.steps.state
            n_compiled = _kernels(rt, kind, K, vals)
            n_eager = _kernels(rt, kind, K, vals, eager_steps=plain.decode)
            assert n_compiled < 0.6 * n_eager, (n_compiled, n_eager)
        with rt.device.on_stream():
            for k, v in before[0].items():
                rt.pools[k].copy_(v)
            ex.steps.state.seq_len.copy_(before[1]), ex.steps.state.bonus.copy_(before[2])
        rt.device.synchronize()
        commit.finish(seq, 0, rt.kv_alloc, rt.sizes.page_size)
    rt.release(seq)


def test_sampled_steps_compile_and_draw_the_uncompiled_tokens(compiled_rt, modules, reference):  # noqa: F811
    """Sampled decode and spec steps compile too (no eager fallback: the sampling cumsum is an opaque op,
    runtime/backends/opaque_ops.py) and draw the same tokens as the uncompiled steps for the same seed."""
    eager_rt = gpu_runtime(modules, compile_steps=False)
    kw = dict(temperature=0.8, top_k=50, top_p=0.95, seed=7)
    for gamma, spec in ((None, False), (15, True)):
        got, _ = compiled_rt.generate(reference["prompt_ids"][0], 32, gamma=gamma, spec=spec, **kw)
        want, _ = eager_rt.generate(reference["prompt_ids"][0], 32, gamma=gamma, spec=spec, **kw)
        assert got == want, spec
    steps = compiled_rt.executor.steps
    assert not steps.decode.failures and not steps.spec.failures, (steps.decode.failures, steps.spec.failures)


def _allocations(codes) -> list:
    """(numel, dtype name) of every buffer Inductor's generated code allocates."""
    import math
    import re

    allocs = re.findall(r"empty_strided_cuda\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)", "\n".join(codes))
    assert allocs, "no buffer allocation found in the generated code: the pattern is stale"
    return [(math.prod(int(x) for x in shape.split(",") if x.strip()), dt) for shape, dt in allocs]


def test_compiled_steps_write_the_pools_in_place(reference):  # noqa: F811
    """No compiled step allocates a buffer of a pool's size and dtype: the commit writes every pool in place. Where
    Inductor cannot order a write after every read of its pool it copies the whole pool in and back out around it
    (the bf16 decode step once did for the KV pool: two 17.8 MB copies, 35 us of a 0.23 ms step). bf16: the path with
    our gemv kernels, where that graph came out."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from dflash_trt.export.checkpoint import load_drafter, load_target

    t = load_target(os.path.join(MODELS, "target"), torch.bfloat16).cuda()
    rt = gpu_runtime((t, load_drafter(os.path.join(MODELS, "drafter"), t, torch.bfloat16).cuda()),
                     compile_steps=True)

    def run():
        for gamma, spec in ((None, False), (15, True)):
            rt.generate(reference["prompt_ids"][0], 8, gamma=gamma, spec=spec)

    # compile every step here (no cached graph from another test or run): run_and_get_code sees generated code only
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(run)
    assert len(codes) >= 3, len(codes)  # prefill, decode, spec
    pools = {(p.numel(), str(p.dtype).removeprefix("torch.")): name for name, p in rt.pools.items()}
    sizes = _allocations(codes)
    assert not [pools[s] for s in sizes if s in pools], "a compiled step copies a pool"


def test_regional_compile_tokens_equal_cpu_reference(modules, reference):  # noqa: F811
    """compile_steps="regions" (each kind of layer compiled once, torch_compile.CompiledRegions), fp32: plain and
    DFlash γ=15 tokens == the CPU reference, every piece compiled."""
    rt = gpu_runtime(modules, compile_steps="regions")
    for gamma, spec in ((None, False), (15, True)):
        out, _ = rt.generate(reference["prompt_ids"][0], N_NEW, gamma=gamma, spec=spec)
        assert out == reference["tokens"][0], spec
    regions = rt.executor.steps.graphs.regions
    assert regions.compiled and not regions.failures, regions.failures


def test_regional_pieces_write_pool_layers_in_place(reference):  # noqa: F811
    """bf16 (the path with our gemv kernels): no compiled piece allocates a buffer of a pool layer's size and dtype
    (each piece commits into its layer's slice of the pool in place), and no glue graph one of a pool's."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from dflash_trt.export.checkpoint import load_drafter, load_target

    t = load_target(os.path.join(MODELS, "target"), torch.bfloat16).cuda()
    rt = gpu_runtime((t, load_drafter(os.path.join(MODELS, "drafter"), t, torch.bfloat16).cuda()),
                     compile_steps="regions")
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(lambda: [rt.generate(reference["prompt_ids"][0], 8, gamma=g, spec=s)
                                             for g, s in ((None, False), (15, True))])
    regions = rt.executor.steps.graphs.regions
    assert regions.compiled and not regions.failures, regions.failures
    layers = {"kv_pool": len(t.cfg.attn_layers), "gdn_pool": len(t.cfg.gdn_layers), "conv_pool": len(t.cfg.gdn_layers)}
    slices = {(rt.pools[k].numel() // n, str(rt.pools[k].dtype).removeprefix("torch.")): k for k, n in layers.items()}
    slices.update({(p.numel(), str(p.dtype).removeprefix("torch.")): k for k, p in rt.pools.items()})  # the glue's
    sizes = _allocations(codes)
    assert not [slices[s] for s in sizes if s in slices], "a compiled graph copies a pool (layer)"
