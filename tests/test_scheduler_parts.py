"""The scheduler's parts on their own, with plain numbers: the page budget's worst-case sums, the admission decision
(cap, room, slots, pages, the prefetch rule) and the in-flight queue's order (which launch is due, landed joins)."""
from types import SimpleNamespace

import pytest

from dflash_trt.runtime.admission import PREFETCH, Admission
from dflash_trt.runtime.batching import DECODE, PREFILL_BATCH, StepPlan
from dflash_trt.runtime.inflight import InFlightQueue, Join
from dflash_trt.runtime.page_budget import PageBudget, fits
from dflash_trt.runtime.scheduler import Request

# 4 rows a page, verify width 4, a 12-row drafter window, ctx block tables 5 pages wide
BUDGET = PageBudget(page_size=4, step_rows=4, ctx_window=12, ctx_blocks=5)


def holding(prompt_len, max_new, kv_pages, ctx_pages):
    """A running request holding kv_pages KV pages and ctx_pages drafter ctx pages."""
    seq = SimpleNamespace(pages=list(range(kv_pages)), ctx=SimpleNamespace(num_pages=ctx_pages))
    return Request(0, [1] * prompt_len, max_new, seq=seq)


# ------------------------------------------------------------------ page budget
def test_pages_to_start_are_the_prompt_and_one_step():
    assert BUDGET.to_start(10) == (4, 3)  # 14 rows: 4 KV pages; the window holds 12 of them: 3 ctx pages
    assert BUDGET.to_start(4) == (2, 2)  # 8 rows
    assert PageBudget(4, 4, None, 5).to_start(10) == (4, 0)  # no drafter: no ctx pages


def test_pages_for_life_cap_the_ctx_at_its_block_table():
    assert BUDGET.for_life(10, 20) == (9, 5)  # 34 rows: 9 KV pages, the ctx window at most 5 pages wide
    assert BUDGET.for_life(1, 2) == (2, 2)  # 7 rows
    assert PageBudget(4, 1, None, 5).for_life(10, 20) == (8, 0)  # plain decode: one row a step, no drafter


def test_pages_owed_are_each_lifes_worst_case_less_what_it_holds():
    running = [holding(10, 20, 4, 3), holding(1, 2, 2, 2), holding(10, 20, 12, 6)]  # owe (5, 2), (0, 0), (0, 0)
    assert BUDGET.owed(running) == (5, 2)
    left = Request(1, [1] * 10, 20)  # left or not yet admitted: no sequence, owes nothing
    assert BUDGET.owed(running + [left]) == (5, 2)
    no_window = holding(10, 20, 4, 0)
    no_window.seq.ctx = None
    assert BUDGET.owed([no_window]) == (5, 5)


def test_fits_needs_both_pools():
    assert fits((3, 2), (3, 2)) and not fits((4, 2), (3, 2)) and not fits((3, 3), (3, 2))


# ------------------------------------------------------------------ admission
def admission(max_batch=16, stepping=0, overlapping=True, busy=True, free=(100, 100), owed=(0, 0)):
    return Admission(BUDGET, max_batch=max_batch, stepping=stepping, overlapping=overlapping, busy=busy, free=free,
                     owed=owed)


def test_at_most_prefill_batch_join_a_step_while_steps_are_in_flight():
    a = admission(stepping=0)
    assert a.has_room(PREFILL_BATCH - 1, free_slots=8) and not a.has_room(PREFILL_BATCH, free_slots=8)
    idle = admission(overlapping=False, busy=False)  # nothing in flight: up to the whole batch joins at once
    assert idle.has_room(PREFILL_BATCH, free_slots=20) and not idle.has_room(16, free_slots=20)


def test_room_is_the_batch_plus_prefetch_only_while_steps_are_in_flight():
    a = admission(max_batch=16, stepping=15)
    assert a.has_room(PREFETCH, free_slots=8) and not a.has_room(PREFETCH + 1, free_slots=8)
    full = admission(max_batch=16, stepping=16, overlapping=False)
    assert not full.has_room(0, free_slots=8)
    assert not admission().has_room(0, free_slots=0)  # no state slot


def test_a_joiner_waits_for_pages_while_requests_run_but_not_on_an_idle_scheduler():
    assert not admission(free=(3, 100)).admits(10, 20, joined=0)  # needs 4 KV pages to start
    assert not admission(free=(100, 2)).admits(10, 20, joined=0)  # needs 3 ctx pages
    idle = admission(overlapping=False, busy=False, free=(3, 2))
    assert idle.admits(10, 20, joined=0) and idle.free == (-1, -1)  # nothing will give pages back: it tries


def test_each_joiner_takes_its_pages_from_the_free_count():
    a = admission(overlapping=False, free=(8, 6))
    assert a.admits(10, 20, joined=0) and a.free == (4, 3)
    assert a.admits(10, 20, joined=1) and a.free == (0, 0)
    assert not a.admits(10, 20, joined=2) and a.free == (0, 0)  # refused: nothing taken


def test_a_prefetch_is_refused_when_its_life_and_what_running_requests_are_owed_exceed_the_free_pages():
    life, owed = BUDGET.for_life(10, 20), (7, 1)  # (9, 5)
    short = admission(stepping=16, free=(life[0] + owed[0] - 1, 100), owed=owed)
    assert not short.admits(10, 20, joined=0) and short.free == (15, 100)
    short_ctx = admission(stepping=16, free=(100, life[1] + owed[1] - 1), owed=owed)
    assert not short_ctx.admits(10, 20, joined=0)
    enough = admission(stepping=16, free=(life[0] + owed[0], life[1] + owed[1]), owed=owed)
    assert enough.admits(10, 20, joined=0)
    need = BUDGET.to_start(10)  # it holds its start now and is owed the rest of its life
    assert enough.free == (16 - need[0], 6 - need[1]) and enough.owed == (7 + 9 - need[0], 1 + 5 - need[1])


def test_within_the_batch_a_joiner_needs_only_its_start_while_steps_are_in_flight():
    a = admission(stepping=14, free=(8, 6), owed=(50, 50))
    assert a.admits(10, 20, joined=0)  # row 15 of 16: not a prefetch
    assert a.owed == (55, 52)  # still counted against the prefetches after it
    assert a.admits(10, 20, joined=1) and a.free == (0, 0)  # row 16: its start fits exactly
    b = admission(stepping=15, free=(30, 30), owed=(20, 10))
    assert b.admits(10, 20, joined=0) and b.owed == (25, 12)  # row 16: its start fits
    assert not b.admits(10, 20, joined=1)  # a prefetch: 9 + 25 KV pages > 26 free


# ------------------------------------------------------------------ in-flight queue
def step_of(*reqs):
    return StepPlan(DECODE, 1, [None] * len(reqs), reqs=list(reqs))


def test_the_oldest_step_is_due_after_its_own_joiners_prefills():
    a, b, c = (Request(i, [1], 4) for i in range(3))
    q = InFlightQueue()
    for launch in (Join(a), Join(b), step_of(b, c), Join(c), step_of(a)):
        q.push(launch, object())
    entries = list(q)
    assert q.next_due() == [entries[1], entries[2]]  # b's prefill, then the step; a's and c's wait
    q.take(entries[1])
    q.take(entries[2])
    assert q.next_due() == [entries[0], entries[4]] and len(q) == 3


def test_with_no_step_in_flight_the_oldest_prefill_is_due():
    q = InFlightQueue()
    q.push(Join(Request(0, [1], 4)), "p0")
    q.push(Join(Request(1, [1], 4)), "p1")
    assert [pending for _, pending in q.next_due()] == ["p0"] and q.steps() == 0


def test_due_keeps_the_executors_steps_running():
    q = InFlightQueue()
    assert not q.due(launched=False, keep_running=1)  # nothing in flight
    q.push(Join(Request(0, [1], 4)), "p")
    assert q.due(launched=False, keep_running=1) and not q.due(launched=True, keep_running=0)  # prefills not counted
    q.push(step_of(Request(1, [1], 4)), "s1")
    assert not q.due(launched=True, keep_running=1) and q.due(launched=True, keep_running=0)
    q.push(step_of(Request(1, [1], 4)), "s2")
    assert q.due(launched=True, keep_running=1)


def test_landed_joins_ask_only_prefills_in_launch_order():
    q, asked = InFlightQueue(), []
    for i, launch in enumerate((Join(Request(0, [1], 4)), step_of(), Join(Request(1, [1], 4)), Join(None))):
        q.push(launch, i)
    got = q.landed_joins(lambda pending: asked.append(pending) or pending != 2)
    assert asked == [0, 2, 3] and [pending for _, pending in got] == [0, 3]


def test_take_removes_by_identity_and_pops_at_both_ends():
    q, same = InFlightQueue(), Join(Request(0, [1], 4))
    q.push(same, "x")
    q.push(same, "x")
    q.push(same, "y")
    first = list(q)[0]
    q.take(first)
    assert len(q) == 2 and list(q)[0] is not first and list(q)[0] == first  # an equal entry stays
    assert q.pop_newest()[1] == "y" and q.pop_oldest()[1] == "x" and not q
