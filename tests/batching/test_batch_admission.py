"""Admission while steps are in flight (CPU, the GPU step executor's logic on torch CPU tensors): a batch ending
together refills without draining, the per-step admission cap, joiners short of pages waiting, prefills not
waited for, prefetched joiners filling freed rows, and pages kept until a leaving request's launches land."""
from batch_helpers import full, graph_runtime, run_batch

from dflash_trt.abi import PoolSizes


def test_a_batch_ending_together_refills_without_draining(pair, alone):
    """Eight plain requests of one length run four at a time, so four end on the same step. With more state slots
    than rows, their successors join while that last step is in flight: the host never collects with nothing else
    queued while requests wait (the GPU never drains between the two groups), a step admits at most PREFILL_BATCH
    of them, and every request's tokens stay those generated alone."""
    from dflash_trt.runtime.batching import PREFILL_BATCH

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
    from dflash_trt.runtime.batching import PREFILL_BATCH
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
