"""The GPU runtime (CudaDevice pools, one CUDA graph per step kind / K / bucket, accept and commit on the
device, one step in flight) on the shipped trained pair, fp32: DFlash == plain greedy == the CPU reference
tokens for 128 new tokens, at batch 1, 4 and 16 with requests joining and leaving mid-run (their prefills on the
second stream, beside the steps in flight), the ctx invariant checked on device state after every step; captured graphs replay bit-identically to their eager launch;
faults stay with the request that caused them; a forced capture failure falls back to eager."""
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not os.path.isfile(os.path.join(MODELS, "drafter", "config.json")), reason="no trained pair in models/")]
N_NEW = 128


@pytest.fixture(scope="module")
def reference():
    from reference_tokens import load_reference

    ref = load_reference()
    if ref is None:
        pytest.fail("tests/data/trained_greedy_128.json is missing or from other checkpoints: "
                    "run python tests/reference_tokens.py")
    return ref


@pytest.fixture(scope="module")
def modules():
    import torch

    from dflash_trt.export.checkpoint import load_drafter, load_target

    t = load_target(os.path.join(MODELS, "target"), torch.float32).cuda()
    d = load_drafter(os.path.join(MODELS, "drafter"), t, torch.float32).cuda()
    return t, d


def gpu_runtime(modules, sizes=None, compile_steps=False, **kw):
    from dflash_trt.abi import PoolSizes
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.devices.cuda import CudaDevice
    from dflash_trt.runtime.runtime import Runtime

    t, d = modules
    sizes = sizes or PoolSizes(max_seq_len=512, kv_blocks=1024, dkv_blocks=1024, max_seqs=16, ctx_window=256)
    return Runtime(TorchBackend(t, d, compile_steps=compile_steps), t.cfg, d.cfg, sizes, device=CudaDevice(),
                   **kw)


@pytest.fixture(scope="module")
def dense_rows(modules, reference):
    from batch_helpers import dense_ctx_rows

    t, d = modules
    return {tuple(p): dense_ctx_rows(t, d, list(p) + tk) for p, tk in zip(reference["prompt_ids"], reference["tokens"])}


def full(rt):
    return (rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.dkv_alloc.num_free == rt.dkv_alloc.num_total
            and rt.slots.num_free == rt.slots.num_total)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_graph_path_tokens_equal_cpu_reference(modules, reference, dense_rows, batch):
    """plain, DFlash γ=3 and γ=15: every request's 128 tokens equal the CPU reference; half the batch joins
    later (mid-run), requests leave as they finish; the ctx invariant holds after every step."""
    from batch_helpers import make_invariant_check, run_batch

    prompts = reference["prompt_ids"][:batch]
    want = reference["tokens"][:batch]
    joins = [0 if i < max(batch // 2, 1) else 2 + i for i in range(batch)]
    for gamma, spec in ((0, False), (3, True), (15, True)):
        rt = gpu_runtime(modules)
        log = []
        got, reqs = run_batch(rt, prompts, [N_NEW] * batch, joins, gamma=gamma or None, spec=spec,
                              check=make_invariant_check(rt, dense_rows, log, atol=1e-3))
        for i in range(batch):
            assert got[i] == want[i], (batch, gamma, i)
        assert full(rt)
        assert not rt.executor.eager_keys, (rt.executor.eager_keys, rt.device.capture_failures)
        assert rt.executor.side.stream_handle != rt.device.stream_handle  # the joiners' prefills ran beside the steps
        taus = [1 + np.mean(r.accepted) for r in reqs.values() if r.accepted]
        print(f"batch {batch} spec={spec} gamma={gamma}: == CPU reference; buckets "
              f"{sorted({b for _, _, b, _ in log})}; mean tau {np.mean(taus) if taus else 1.0:.2f}")


def test_captured_graphs_replay_bit_identical_to_eager(modules, reference):
    """Every key a run captured, replayed on live state vs launched eagerly on the same state: same bits in
    the result and in every pool and the per-slot device state."""
    import torch

    from dflash_trt.runtime import commit
    from dflash_trt.runtime.batching import DECODE, PREFILL_STEP, pad_rows

    rt = gpu_runtime(modules)
    ex = rt.executor
    seqs = [rt.add_sequence(p) for p in reference["prompt_ids"][:3]]
    for s in seqs:
        rt.prefill(s)
    checked = 0
    for kind, K, B in [(DECODE, 1, 1), (DECODE, 1, 4), ("spec", 16, 4), ("spec", 4, 2), (PREFILL_STEP, 64, 1)]:
        live = seqs[:min(B, 3)]
        for s in live:
            commit.reserve(s, K, rt.kv_alloc, rt.sizes.page_size)
        vals = ex._tables(pad_rows(live) if kind != PREFILL_STEP else [live[0]])
        if kind == PREFILL_STEP:
            vals.update(ids=np.array([reference["prompt_ids"][0][:1] + [0] * (K - 1)]),
                        start=[live[0].seq_len], valid=[1])
        ex.entry(kind, K, len(pad_rows(live)) if kind != PREFILL_STEP else 1)  # captured (graph exists)
        assert ex.graphs[(kind, K, B)] is not None
        st = ex.steps.state

        def snapshot():
            with rt.device.on_stream():  # the runtime's stream: ordered with its steps
                out = {k: v.clone() for k, v in rt.pools.items()}, st.seq_len.clone(), st.bonus.clone()
            rt.device.synchronize()
            return out

        def restore(snap):
            with rt.device.on_stream():
                for k, v in snap[0].items():
                    rt.pools[k].copy_(v)
                st.seq_len.copy_(snap[1]), st.bonus.copy_(snap[2])
            rt.device.synchronize()

        before = snapshot()
        eager = ex.run_key(kind, K, B, vals, eager=True)
        after_eager = snapshot()
        restore(before)
        replay = ex.run_key(kind, K, B, vals)
        after_replay = snapshot()
        assert np.array_equal(eager, replay), (kind, K, B)
        for k in rt.pools:
            assert torch.equal(after_replay[0][k], after_eager[0][k]), (kind, K, B, k)
        assert torch.equal(after_replay[1], after_eager[1]) and torch.equal(after_replay[2], after_eager[2])
        assert any(not torch.equal(after_eager[0][k], before[0][k]) for k in rt.pools)  # it wrote
        restore(before)  # back to the state before the step: nothing was committed on the host
        for s in live:
            commit.finish(s, 0, rt.kv_alloc, rt.sizes.page_size)
        checked += 1
    for s in seqs:
        rt.release(s)
    assert checked == 5 and full(rt)


def test_forced_capture_failure_runs_eager_with_correct_tokens(modules, reference):
    """A capture that syncs inside (illegal while capturing) is ended by the brick guard; that key runs
    eagerly, every other key still captures, and the tokens are the reference's."""
    import torch

    rt = gpu_runtime(modules)
    ex = rt.executor
    ex.capture_hook = lambda key: torch.cuda.current_stream().synchronize() if key[0] == "spec" else None
    out, st = rt.generate(reference["prompt_ids"][0], N_NEW, gamma=15)
    print("capture failures:", [f[:160] for f in rt.device.capture_failures])
    assert out == reference["tokens"][0]
    assert ex.eager_keys == {("spec", 16, 1)} and rt.device.capture_failures
    assert ex.graphs[("prefill", rt.sizes.prefill_chunk, 1)] is not None  # the stream kept capturing
    out2, _ = rt.generate(reference["prompt_ids"][1], 32, spec=False)  # a new key captures after the failure
    assert out2 == reference["tokens"][1][:32] and ex.graphs[("decode", 1, 1)] is not None
    print("capture failure guarded:", rt.device.capture_failures[0][:120])


def test_one_sequence_out_of_pages_fails_alone_on_gpu(modules, reference):
    from batch_helpers import run_batch

    from dflash_trt.abi import PoolSizes
    from dflash_trt.runtime.pools import PoolExhausted

    sizes = PoolSizes(max_seq_len=512, kv_blocks=28, dkv_blocks=1024, max_seqs=16, ctx_window=256)
    rt = gpu_runtime(modules, sizes)
    got, reqs = run_batch(rt, reference["prompt_ids"][:4], [N_NEW] * 4, [0, 0, 0, 0], gamma=15)
    failed = [i for i, r in reqs.items() if r.status == "failed"]
    assert failed and len(failed) < 4
    assert all(isinstance(reqs[i].error, PoolExhausted) for i in failed)
    for i in reqs:
        assert got[i] == reference["tokens"][i][: len(got[i])]
        if i not in failed:
            assert len(got[i]) == N_NEW
    assert full(rt)


@pytest.mark.parametrize("prompt,max_new,msg", [([], 4, "empty prompt"), ([1, 10 ** 6], 4, "outside the vocabulary"),
                                                (list(range(500)), 64, "max_seq_len=512")])
def test_bad_requests_on_gpu(modules, prompt, max_new, msg):
    rt = gpu_runtime(modules)
    with pytest.raises(ValueError, match=msg):
        rt.generate(prompt, max_new)
    assert full(rt)
