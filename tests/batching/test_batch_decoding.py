"""Batched continuous decoding on CPU: the scheduler (joins, leaves, buckets with inert padding rows), the
three-part commit (reserve the worst case -> device writes -> finish), and the GPU step executor's logic run
eagerly on torch CPU tensors (device-side accept, per-slot state, one step kept in flight) — all token-
identical to sequences generated alone, with the ctx invariant checked after every step."""
import numpy as np
import pytest
from batch_helpers import JOINS, N_NEW, SIZES, full, graph_runtime, make_invariant_check, run_batch

from dflash_trt.abi import PoolSizes
from dflash_trt.runtime import commit
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.batching import bucket_for, pad_rows, step_tables
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.pools import BlockAllocator, PoolExhausted
from dflash_trt.runtime.runtime import CapacityError, Runtime


# ------------------------------------------------------------------ buckets and tables
def test_buckets_and_padding_rows():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64]
    with pytest.raises(ValueError, match="at most 64"):
        bucket_for(65)
    rows = pad_rows(["a", "b", "c"])
    assert rows == ["a", "b", "c", None]
    t = step_tables([None, None], max_blocks=3, ctx_blocks=2, max_seqs=5)
    assert t["live"].tolist() == [0, 0] and t["srow"].tolist() == [5, 5] and t["slot"].tolist() == [0, 0]
    assert not t["block_table"].any() and not t["ctx_table"].any() and not t["ctx_base"].any()


# ------------------------------------------------------------------ reserve / finish
def test_reserve_worst_case_then_finish_gives_back_the_tail(pair):
    target, drafter, prompts = pair
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES)
    seq = rt.add_sequence(prompts[0])
    rt.prefill(seq)
    kv0, ctx0 = list(seq.pages), seq.ctx.num_pages
    commit.reserve(seq, 16, rt.kv_alloc, SIZES.page_size)  # verify width 16: 4 more pages of 4 rows
    assert len(seq.pages) == -(-(seq.seq_len + 16) // 4) and seq.ctx.num_pages >= ctx0
    commit.finish(seq, 3, rt.kv_alloc, SIZES.page_size)  # only 3 rows were accepted
    assert len(seq.pages) == -(-seq.seq_len // 4) and seq.ctx.num_pages == -(-seq.ctx.end // 4)
    assert seq.pages[: len(kv0)] == kv0
    rt.release(seq)
    assert full(rt)


def test_reserve_is_all_or_nothing_across_pools(pair):
    target, drafter, prompts = pair
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES)
    seq = rt.add_sequence(prompts[0])
    rt.prefill(seq)
    kv, ctx, free_kv = list(seq.pages), list(seq.ctx.pages), rt.kv_alloc.num_free
    rt.dkv_alloc._free.clear()  # the drafter pool is empty: the KV pages taken first must come back
    with pytest.raises(PoolExhausted, match="drafter ctx pages"):
        commit.reserve(seq, 16, rt.kv_alloc, SIZES.page_size)
    assert seq.pages == kv and seq.ctx.pages == ctx and rt.kv_alloc.num_free == free_kv


def test_ctx_window_ahead_mode_slides_only_when_asked():
    alloc = BlockAllocator(32, "drafter ctx pages")
    from dflash_trt.runtime.ctx import CtxWindow

    cw = CtxWindow(8, 4, alloc, max_append=32, auto_slide=False)
    pos = 0
    for n in (5, 7, 9, 3, 11):
        cw.reserve(2 * 16)  # two steps' worst case
        cw.finish_append(n, np.arange(pos, pos + n))
        pos += n
        assert cw.base == 0 or cw.base % 4 == 0
        dropped = cw.slide()
        assert dropped % 4 == 0 and cw.end - cw.start <= 8 + 3 and cw.base + cw.end == pos
        cw.trim(0)
        assert cw.num_pages == -(-cw.end // 4)
        assert np.array_equal(cw.positions_visible(), np.arange(max(pos - 8, 0), pos))
    cw.release()
    assert alloc.num_free == 32


# ------------------------------------------------------------------ scheduler on the host path
@pytest.mark.parametrize("spec", [False, True])
def test_host_path_batch_joins_and_leaves(pair, alone, spec):
    target, drafter, prompts = pair
    toks, rows = alone
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES)
    log = []
    got, reqs = run_batch(rt, prompts, N_NEW, JOINS, gamma=3, spec=spec,
                          check=make_invariant_check(rt, rows, log))
    for i, p in enumerate(prompts):
        assert got[i] == toks[i][: N_NEW[i]], i
    assert {b for _, _, b, _ in log} >= {2, 4}  # ran in several buckets, with padding rows
    assert full(rt)


# ------------------------------------------------------------------ the GPU executor's logic, eagerly on CPU
@pytest.mark.parametrize("inflight", [0, 1])
def test_device_step_path_batch_matches_alone(pair, alone, inflight):
    target, drafter, prompts = pair
    toks, rows = alone
    rt = graph_runtime(target, drafter, prompts, toks, inflight)
    log = []
    got, reqs = run_batch(rt, prompts, N_NEW, JOINS, gamma=3, release_at=(3, 0),
                          check=make_invariant_check(rt, rows, log))
    for i in range(len(prompts)):
        want = toks[i][: N_NEW[i]]
        assert got[i] == want[: len(got[i])] and (i == 0 or len(got[i]) == N_NEW[i]), i
    assert reqs[0].finish_reason == "released" and len(got[0]) < N_NEW[0]
    assert {n for _, k, _, n in log if k == "spec"} == {1, 2, 3, 4}  # every accept count, per row
    assert full(rt)


def test_join_does_not_drain_the_steps_in_flight(pair, alone):
    """A request that joins mid-run is admitted right after the next step is launched without it (it sits out while
    its prefill runs beside the steps): its prefill's launch comes with two steps queued, and only then are the join
    and the step before collected; the step after holds the joiner. A request that joins an empty batch runs in the
    very next step (the device keeps its first token). Tokens stay those generated alone."""
    target, drafter, prompts = pair
    toks, _ = alone
    rt = graph_runtime(target, drafter, prompts, toks)
    ex, log = rt.executor, []
    for name in ("launch", "launch_prefill", "collect"):
        fn = getattr(ex, name)
        setattr(ex, name, lambda *a, _n=name, _f=fn: log.append((_n, a[0])) or _f(*a))
    got, reqs = run_batch(rt, prompts[:2], [10, 6], [0, 3], gamma=3)
    assert got[0] == toks[0][:10] and got[1] == toks[1][:6]
    i = next(k for k, (n, _) in enumerate(log) if n == "launch") - 1  # the first request's last prefill chunk
    assert log[i][0] == "launch_prefill" and log[i][1][0] in log[i + 1][1].rows  # alone: the next step holds it
    p1 = [int(t) for t in prompts[1]]
    i = next(k for k, (n, a) in enumerate(log) if n == "launch_prefill" and a[0].tokens[:len(p1)] == p1)
    joiner = log[i][1][0]
    assert log[i - 1][0] == "launch" and joiner not in log[i - 1][1].rows  # others run first: it sits out one step
    assert log[i - 2][0] == "collect" and [n for n, _ in log[i + 1:i + 3]] == ["collect", "collect"]
    assert log[i + 3][0] == "launch" and joiner in log[i + 3][1].rows
    assert full(rt)


@pytest.mark.parametrize("path", ["host", "device"])
def test_joiners_share_prefill_launches(pair, alone, path):
    """Five requests that join at once: chunk i of every prompt that has one goes out in launches of at most
    PREFILL_BATCH rows (prompts of 23, 5, 17, 40, 11 tokens in chunks of 16: rounds of 5, 3 and 1 rows), padding
    rows inert, and every request's tokens stay those generated alone (the ctx invariant checked each step)."""
    from dflash_trt.runtime.batching import PREFILL_BATCH, PREFILL_STEP

    target, drafter, prompts = pair
    toks, rows = alone
    if path == "host":
        rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES)
    else:
        rt = graph_runtime(target, drafter, prompts, toks)
    sizes, fn = [], rt.executor.launch_prefill
    rt.executor.launch_prefill = lambda seqs, chunks: sizes.append([len(c) for c in chunks]) or fn(seqs, chunks)
    log = []
    got, _ = run_batch(rt, prompts, N_NEW, [0] * 5, gamma=3, check=make_invariant_check(rt, rows, log))
    assert PREFILL_BATCH == 4 and sizes == [[16, 5, 16, 16], [11], [7, 1, 16], [8]]
    if path == "device":  # a launch whose chunks fit half the chunk runs at that width: [8] here
        assert sorted(k[1:] for k in rt.executor.buffers if k[0] == PREFILL_STEP) == [(8, 1), (16, 1), (16, 4)]
    assert all(got[i] == toks[i][: N_NEW[i]] for i in range(5))
    assert full(rt)


def test_a_joiner_out_of_pages_mid_prefill_fails_alone(pair, alone):
    """Three joiners share their first prefill launch; the second round cannot get pages for the longest prompt:
    that request fails alone (its pages given back, its slot zeroed and freed), the others' tokens stay those
    generated alone, and every pool comes back full."""
    target, drafter, prompts = pair
    toks, _ = alone
    small = PoolSizes(kv_blocks=14, page_size=4, max_seq_len=128, max_seqs=4, dkv_blocks=160, ctx_window=12,
                      prefill_chunk=16)
    rt = graph_runtime(target, drafter, prompts, toks, sizes=small)
    # 11 of 14 pages free; round 1 = 16 rows of the 40-token prompt (4 pages) + 5 + 11 rows (2 + 3 pages): 2 left,
    # so its second chunk (4 pages) cannot be reserved
    held = rt.kv_alloc.alloc(3)
    got, reqs = run_batch(rt, [prompts[3], prompts[1], prompts[4]], [4, 4, 4], [0, 0, 0], gamma=3)
    rt.kv_alloc.free(held)
    assert reqs[0].status == "failed" and isinstance(reqs[0].error, PoolExhausted), reqs[0].error
    assert got[1] == toks[1][:4] and got[2] == toks[4][:4]
    assert full(rt)


def test_a_broken_prefill_launch_fails_its_joiners_and_frees_them(pair, alone):
    """The executor itself breaks during the joiners' shared prefill (not one request's fault): the error reaches
    the caller, every joiner is failed with it and gives back its slot and pages; the runtime serves the next
    request normally."""
    target, drafter, prompts = pair
    toks, _ = alone
    rt = graph_runtime(target, drafter, prompts, toks)
    fn = rt.executor.launch_prefill
    rt.executor.launch_prefill = lambda seqs, chunks: (_ for _ in ()).throw(RuntimeError("device lost"))
    reqs = [rt.add_request(p, 4, gamma=3) for p in prompts[:3]]
    with pytest.raises(RuntimeError, match="device lost"):
        rt.step()
    assert all(r.status == "failed" and "device lost" in str(r.error) for r in reqs) and full(rt)
    rt.executor.launch_prefill = fn
    got, _ = run_batch(rt, prompts[:1], [6], [0], gamma=3)
    assert got[0] == toks[0][:6] and full(rt)


def test_uncollected_results_survive_their_staging_set_being_reused():
    """Three launches of one key before any is collected (joins' prefills): the third reuses the first one's
    pinned staging set, and the first result must still read back as it was (fill keeps a copy first)."""
    from dflash_trt.runtime.backends.graph_executor import STAGING_COPIES, StepBuffers

    buf = StepBuffers(TorchCpuDevice(), {"x": (2,)}, (1, 2))
    launches = []
    for v in range(STAGING_COPIES + 1):
        i = buf.fill({"x": np.array([v, v])})
        buf.result[:] = 10 * v + 1  # the launch's output, then its read-back
        launches.append(buf.pending("prefill", i))
    assert [buf.take(p).tolist() for p in launches] == [[[10 * v + 1] * 2] for v in range(STAGING_COPIES + 1)]


def test_device_step_path_gamma_15_single(pair, alone):
    target, drafter, prompts = pair
    toks, _ = alone
    rt = graph_runtime(target, drafter, prompts, toks)
    out, st = rt.generate(prompts[2], 24, gamma=15)
    assert out == toks[2][:24] and st.tau > 1
    assert full(rt)


def test_device_step_path_wide_batch_matches_alone(pair):
    """Twenty requests at once run in the 32-row bucket (padding rows inert): each one's tokens are the tokens it
    generates alone on the host path, plain and speculative, and every page and slot comes back."""
    target, drafter, _ = pair
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(0, 250, int(n))) for n in rng.integers(3, 30, 20)]
    sizes = PoolSizes(kv_blocks=20 * 16 + 8, page_size=4, max_seq_len=64, max_seqs=20, dkv_blocks=20 * 16 + 8,
                      ctx_window=12, prefill_chunk=16)
    host = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, sizes)
    toks = [host.generate(p, 8, spec=False)[0] for p in prompts]
    for spec in (False, True):
        rt = graph_runtime(target, drafter, prompts, toks, sizes=sizes)
        log = []
        rt.executor.launch = lambda plan, *a, _f=rt.executor.launch: log.append(plan.bucket) or _f(plan, *a)
        got, _ = run_batch(rt, prompts, [8] * 20, [0] * 20, gamma=3, spec=spec)
        assert [got[i] for i in range(20)] == toks, spec
        assert 32 in log and full(rt)


def test_device_decode_step_commits_its_gdn_rows_in_the_graph(pair, alone, monkeypatch):
    """The torch modules' plain decode step commits its GDN row inside the GDN op (ModuleGraphs.commits_decode_gdn):
    no decode step runs the commit's fold, and the tokens and every pool (GDN state included) are those of the
    graph + fold path, bit for bit, with requests joining and leaving (padding rows at slot 0 commit nothing)."""
    from dflash_trt.runtime.backends.torch_backend import ModuleGraphs

    target, drafter, prompts = pair
    toks, _ = alone
    runs = {}
    for in_graph in (True, False):
        monkeypatch.setattr(ModuleGraphs, "commits_decode_gdn", in_graph)
        rt = graph_runtime(target, drafter, prompts, toks)
        folds = []
        fold = rt.device.gdn_fold
        rt.device.gdn_fold = lambda *a, _fold=fold: folds.append(1) or _fold(*a)
        got, _ = run_batch(rt, prompts, N_NEW, JOINS, gamma=3, spec=False)
        assert [got[i] for i in range(len(prompts))] == [t[:n] for t, n in zip(toks, N_NEW)] and full(rt)
        runs[in_graph] = (got, {k: v.clone() for k, v in rt.pools.items()}, len(folds))
    assert runs[True][2] == 0 and runs[False][2] > 0
    assert runs[True][0] == runs[False][0]
    for name, pool in runs[True][1].items():
        assert pool.equal(runs[False][1][name]), name


# ------------------------------------------------------------------ faults
def test_one_request_out_of_pages_fails_alone(pair, alone):
    target, drafter, prompts = pair
    toks, _ = alone
    small = PoolSizes(kv_blocks=20, page_size=4, max_seq_len=128, max_seqs=4, dkv_blocks=160, ctx_window=12,
                      prefill_chunk=16)
    rt = graph_runtime(target, drafter, prompts, toks, sizes=small)
    got, reqs = run_batch(rt, prompts[:3], [24, 9, 24], [0, 0, 0], gamma=3)
    failed = [i for i, r in reqs.items() if r.status == "failed"]
    assert failed and all(isinstance(reqs[i].error, PoolExhausted) for i in failed)
    assert "target kv pages pool exhausted" in str(reqs[failed[0]].error)
    done = [i for i in reqs if i not in failed]
    assert done, "every request failed"
    for i, r in reqs.items():
        assert got[i] == toks[i][: len(got[i])]
    for i in done:
        assert len(got[i]) == [24, 9, 24][i]
    assert full(rt)


@pytest.mark.parametrize("prompt,max_new,err,msg", [
    ([], 4, CapacityError, "empty prompt"),
    ([1, 999], 4, ValueError, "token id 999 outside the vocabulary"),
    (list(range(110)), 20, CapacityError, r"needs \d+ positions; this runtime holds max_seq_len=128"),
    ([1, 2], 0, ValueError, "max_new_tokens must be >= 1"),
])
def test_bad_requests_are_refused_before_any_pool_is_touched(pair, prompt, max_new, err, msg):
    target, drafter, prompts = pair
    rt = graph_runtime(target, drafter, prompts, [[0]] * len(prompts))
    with pytest.raises(err, match=msg):
        rt.add_request(prompt, max_new, gamma=3)
    assert full(rt) and (rt.scheduler is None or not rt.scheduler.has_work)
