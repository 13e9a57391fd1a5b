"""Batched continuous decoding on CPU: the scheduler (joins, leaves, buckets with inert padding rows), the
three-part commit (reserve the worst case -> device writes -> finish), and the GPU step executor's logic run
eagerly on torch CPU tensors (device-side accept, per-slot state, one step kept in flight) — all token-
identical to sequences generated alone, with the ctx invariant checked after every step."""
import numpy as np
import pytest
import torch
from batch_helpers import dense_ctx_rows, make_invariant_check, run_batch
from spec_helpers import TableDrafter

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime import commit
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.batching import bucket_for, pad_rows, step_tables
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.pools import BlockAllocator, PoolExhausted
from dflash_trt.runtime.runtime import CapacityError, Runtime
from dflash_trt.tools.tiny import make_tiny_pair

SIZES = PoolSizes(kv_blocks=160, page_size=4, max_seq_len=128, max_seqs=6, dkv_blocks=160, ctx_window=12,
                  prefill_chunk=16)
N_NEW = [20, 9, 24, 14, 6]
JOINS = [0, 0, 2, 5, 6]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    tdir, ddir = make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3)
    target = load_target(tdir)
    drafter = load_drafter(ddir, target)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 250, n)) for n in (23, 5, 17, 40, 11)]
    return target, drafter, prompts


@pytest.fixture(scope="module")
def alone(pair):
    """Each prompt generated alone on the host path: the reference tokens, and the dense ctx rows."""
    target, drafter, prompts = pair
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES)
    toks = [rt.generate(p, max(N_NEW), spec=False)[0] for p in prompts]
    rows = {tuple(p): dense_ctx_rows(target, drafter, list(p) + t) for p, t in zip(prompts, toks)}
    return toks, rows


def graph_runtime(target, drafter, prompts, greedy, inflight=1, sizes=SIZES):
    d = TableDrafter(drafter, [list(p) + g for p, g in zip(prompts, greedy)], target.cfg.vocab_size,
                     sizes.max_seq_len)
    return Runtime(TorchBackend(target, d), target.cfg, drafter.cfg, sizes, device=TorchCpuDevice(),
                   executor=lambda rt: GraphStepExecutor(rt, inflight=inflight))


def full(rt):
    return (rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.dkv_alloc.num_free == rt.dkv_alloc.num_total
            and rt.slots.num_free == rt.slots.num_total)


# ------------------------------------------------------------------ buckets and tables
def test_buckets_and_padding_rows():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="at most 16"):
        bucket_for(17)
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


def test_a_batch_ending_together_refills_without_draining(pair, alone):
    """Eight plain requests of one length run four at a time, so four end on the same step. With more state slots
    than rows, their successors join while that last step is in flight: the host never collects with nothing else
    queued while requests wait (the GPU never drains between the two groups), a step admits at most PREFILL_BATCH
    of them, and every request's tokens stay those generated alone."""
    from dflash_trt.runtime.batching import PREFILL_BATCH, PREFILL_STEP

    target, drafter, prompts = pair
    toks, _ = alone
    sizes = PoolSizes(kv_blocks=160, page_size=4, max_seq_len=128, max_seqs=12, dkv_blocks=160, ctx_window=12,
                      prefill_chunk=16)
    rt = graph_runtime(target, drafter, prompts, toks, sizes=sizes)
    order = [0, 1, 2, 3, 4, 0, 2, 4, 1, 3]
    reqs = [rt.add_request(prompts[i], 7, spec=False) for i in order]
    sch, ex = rt.scheduler, rt.executor
    sch.max_batch = 4
    drains, admitted, fn = [], [], ex.collect
    ex.collect = lambda p: drains.append(not sch.inflight and bool(sch.waiting)) or fn(p)
    while sch.has_work:
        n = len(sch.waiting)
        sch.step()
        admitted.append(n - len(sch.waiting))
    assert not any(drains), drains
    assert admitted[0] == 4 and max(admitted[1:]) <= PREFILL_BATCH and sum(admitted) == len(order)
    assert all(r.tokens == toks[i][:7] for r, i in zip(reqs, order))
    assert full(rt)


def test_the_admission_cap_per_step_while_steps_are_in_flight(pair, alone):
    """A batch of nine with steps in flight: PREFETCH waiting requests join ahead of a free row (their prefills run
    while they wait); when the nine end on one step, the rest of their successors join over the next steps at most
    PREFILL_BATCH a step (2, then 4, 3), and none of them waits for the batch to drain."""
    from dflash_trt.runtime.batching import PREFILL_BATCH, PREFILL_STEP
    from dflash_trt.runtime.scheduler import PREFETCH

    target, drafter, prompts = pair
    toks, _ = alone
    sizes = PoolSizes(kv_blocks=400, page_size=4, max_seq_len=128, max_seqs=18, dkv_blocks=400, ctx_window=12,
                      prefill_chunk=16)
    rt = graph_runtime(target, drafter, prompts, toks, sizes=sizes)
    order = [i % 5 for i in range(18)]
    reqs = [rt.add_request(prompts[i], 5, spec=False) for i in order]
    sch = rt.scheduler
    sch.max_batch = 9
    admitted = []
    while sch.has_work:
        n = len(sch.waiting)
        sch.step()
        admitted.append(n - len(sch.waiting))
    joins = [a for a in admitted[1:] if a]
    assert admitted[0] == 9 and joins == [PREFETCH, PREFILL_BATCH, 9 - PREFETCH - PREFILL_BATCH], admitted
    assert admitted[1] == PREFETCH  # at the first step with one in flight, before any row frees
    assert all(r.tokens == toks[i][:5] for r, i in zip(reqs, order))
    assert full(rt)


def test_a_joiner_short_of_pages_waits_for_the_requests_ending(pair, alone):
    """Pages are tight: while the first two requests hold theirs (their last steps in flight), the third cannot
    get pages for its prompt. It waits until they give them back, rather than joining early and failing; every
    request finishes with the tokens generated alone and the pools come back full."""
    target, drafter, prompts = pair
    toks, _ = alone
    sizes = PoolSizes(kv_blocks=21, page_size=4, max_seq_len=128, max_seqs=4, dkv_blocks=160, ctx_window=12,
                      prefill_chunk=16)
    rt = graph_runtime(target, drafter, prompts, toks, sizes=sizes)
    order = [3, 0, 4]  # their last steps in flight, the first two hold 12 + 7 of 21 pages; the third needs 3
    reqs = [rt.add_request(prompts[i], 6, spec=False) for i in order]
    rt.scheduler.max_batch = 2
    while rt.has_work:
        rt.step()
    assert [r.status for r in reqs] == ["finished"] * 3, [r.error for r in reqs]
    assert all(r.tokens == toks[i][:6] for r, i in zip(reqs, order))
    assert full(rt)


def test_a_prefill_still_running_is_not_waited_for(pair, alone):
    """A joiner's prefill that has not landed when the host looks is left in flight: the steps before it are
    collected without it, and its first token comes at a later look (or just before the first step that holds it).
    Here every prefill is still running at its first look; tokens stay those generated alone."""
    target, drafter, prompts = pair
    toks, _ = alone
    rt = graph_runtime(target, drafter, prompts, toks)
    ex, log, looked, steps_after = rt.executor, [], set(), []
    launch, launch_prefill, collect = ex.launch, ex.launch_prefill, ex.collect
    ex.launch = lambda plan: [log.append("step") or p for p in [launch(plan)]][0]
    ex.launch_prefill = lambda seqs, chunks: [log.append(rows) or rows for rows in [launch_prefill(seqs, chunks)]][0]
    ex.landed = lambda p: id(p) in looked or looked.add(id(p))  # False at its first look, then True

    def collect_logged(p):  # for a prefill row: the steps launched since its prefill
        i = next((k for k, e in enumerate(log) if isinstance(e, list) and any(r is p for r in e)), None)
        if i is not None:
            steps_after.append(log[i:].count("step"))
        return collect(p)

    ex.collect = collect_logged
    got, _ = run_batch(rt, prompts[:3], [10, 8, 6], [0, 2, 4], gamma=3)
    assert all(got[i] == toks[i][:n] for i, n in enumerate((10, 8, 6)))
    # waiting for each prefill: collected after the one step launched beside it; not waiting: after two
    assert len(steps_after) == 3 and max(steps_after) >= 2, steps_after
    assert full(rt)


def test_a_prefetched_joiner_fills_the_freed_row_at_the_next_launch(pair, alone):
    """A full batch of two with a third request waiting: it is prefilled while it waits (PREFETCH), so when the
    short request ends, the next launch holds it; no launch runs short of rows before the drain (one that did:
    the joiner sitting out while its prefill runs, as when it joins only once a row frees). Tokens stay those
    generated alone."""
    target, drafter, prompts = pair
    toks, _ = alone
    rt = graph_runtime(target, drafter, prompts, toks)
    sizes, launch = [], rt.executor.launch
    rt.executor.launch = lambda plan: sizes.append(len(plan.reqs)) or launch(plan)
    reqs = [rt.add_request(prompts[i], n, spec=False) for i, n in ((1, 4), (0, 16), (2, 16))]
    rt.scheduler.max_batch = 2
    while rt.has_work:
        rt.step()
    assert sizes == sorted(sizes, reverse=True) and sizes.count(2) >= 14, sizes  # 2, ..., 2, then the drain's 1s
    assert all(r.tokens == toks[i][:n] for r, (i, n) in zip(reqs, ((1, 4), (0, 16), (2, 16))))
    assert full(rt)


def test_a_request_leaving_keeps_its_pages_until_its_launches_land(pair, alone):
    """A request that ends (length, EOS, release) while one of its steps is still in flight keeps its slot and
    pages until that step is collected: the GPU executor runs joiners' prefills on a second stream beside the step
    in flight, so a page given back earlier could be written by both at once. Checked after every scheduler step:
    each launch in flight still holds its requests' pages and slots; the case happens; the pools end full."""
    target, drafter, prompts = pair
    toks, _ = alone
    sizes = PoolSizes(kv_blocks=160, page_size=4, max_seq_len=128, max_seqs=12, dkv_blocks=160, ctx_window=12,
                      prefill_chunk=16)
    rt = graph_runtime(target, drafter, prompts, toks, sizes=sizes)
    order = [0, 1, 2, 3, 4, 0, 2, 4]
    reqs = [rt.add_request(prompts[i], 9, gamma=3) for i in order]
    sch = rt.scheduler
    sch.max_batch = 4
    left_in_flight = 0
    while sch.has_work:
        sch.step()
        held = [r for entry, _ in sch.inflight for r in (getattr(entry, "reqs", None) or [entry.req])]
        left_in_flight += sum(1 for r in held if r.done)
        assert all(r.seq is not None and r.seq.slot >= 0 for r in held), [r.req_id for r in held if r.seq is None]
        assert all(rt.kv_alloc.refcount(p) > 0 for r in held for p in r.seq.pages)
    assert left_in_flight > 0  # some request did end with a step of it in flight
    assert all(r.tokens == toks[i][:9] for r, i in zip(reqs, order))
    assert full(rt)


def test_releasing_an_uncollected_prefill_settles_it_before_the_pages_go_back(pair, alone):
    """launch_prefills() runs on the GPU executor's prefill stream; a sequence released before its result is
    collected waits for that stream (settle) while it still holds its pages, so no step can be handed a page the
    prefill is writing. A collected one releases without that wait."""
    target, drafter, prompts = pair
    toks, _ = alone
    rt = graph_runtime(target, drafter, prompts, toks)
    seen = []
    rt.executor.settle = lambda: seen.append(rt.kv_alloc.num_free)
    seq = rt.add_sequence(prompts[0])
    rt.launch_prefills([seq])
    held = rt.kv_alloc.num_free
    rt.release(seq)
    assert seen == [held] and full(rt)
    seq = rt.add_sequence(prompts[0])
    rt.prefill(seq)
    rt.release(seq)
    assert seen == [held] and full(rt)
