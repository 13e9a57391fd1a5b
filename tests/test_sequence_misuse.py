"""Sequence handles cannot hurt others: released / foreign / duplicate / re-prefilled handles
and non-integer token ids are refused before anything is written, and a refused or exhausted step leaves every
pool and sequence as it was. The randomized test runs the same good calls on a reference runtime in lockstep."""
import random

import numpy as np
import pytest
import torch

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.pools import PoolExhausted
from dflash_trt.runtime.runtime import CapacityError, GammaError, Runtime
from dflash_trt.runtime.sequence import SequenceError, TokenIdError
from dflash_trt.tools.tiny import make_tiny_pair

# small pools: a few sequences exhaust the KV pages, the ctx pages or their block tables
SMALL = dict(kv_blocks=20, page_size=4, max_seq_len=48, max_seqs=3, dkv_blocks=30, ctx_window=8, prefill_chunk=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)  # tiny matmuls: threads only contend on a shared 2-core box (10-100x slower)
    tdir, ddir = make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3)
    target = load_target(tdir)
    return target, load_drafter(ddir, target)


def make_rt(models, **over):
    target, drafter = models
    return Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, PoolSizes(**{**SMALL, **over}))


def free_counts(rt):
    return rt.kv_alloc.num_free, rt.dkv_alloc.num_free, rt.slots.num_free


def state(rt, seqs):
    """Everything a refused call must not change: free counts and each live sequence's host state + pool rows."""
    out = [list(free_counts(rt))]
    for s in seqs:
        if s.live:
            out.append((s.seq_len, s.bonus, list(s.pages), s.ctx.start, s.ctx.end, s.ctx.total, list(s.ctx.pages),
                        rt.pools["gdn_pool"][:, s.slot].copy(), rt.pools["conv_pool"][:, s.slot].copy()))
    return out


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            assert x[:7] == y[:7]
            assert np.array_equal(x[7], y[7]) and np.array_equal(x[8], y[8])
        else:
            assert x == y


def live_prefilled(models):
    rt = make_rt(models)
    s = rt.add_sequence([5, 6, 7, 8, 9])
    rt.prefill(s)
    return rt, s


# ---- one test per case ------------------------------------------------------------------------
def test_step_after_release_is_refused(models):
    rt, s = live_prefilled(models)
    other = rt.add_sequence([1, 2, 3])
    rt.prefill(other)
    rt.release(s)
    before = state(rt, [other])
    for call in (lambda: rt.decode_step([s]), lambda: rt.spec_step([s], 3), lambda: rt.prefill(s),
                 lambda: rt.spec_step([other, s], 3), lambda: rt.decode_step([s, other])):
        with pytest.raises(SequenceError, match="was released"):
            call()
    same(before, state(rt, [other]))
    rt.release(s)  # a second release is a no-op


def test_foreign_sequence_is_refused(models):
    rt, s = live_prefilled(models)
    rt2, s2 = live_prefilled(models)
    before = state(rt, [s])
    for call in (lambda: rt.decode_step([s2]), lambda: rt.spec_step([s, s2], 2), lambda: rt.prefill(s2),
                 lambda: rt.release(s2), lambda: rt.save_sequence(s2, "/tmp/never-written")):
        with pytest.raises(SequenceError, match="belongs to another Runtime"):
            call()
    same(before, state(rt, [s]))
    assert rt2.decode_step([s2])  # still fine in its own runtime


def test_duplicate_in_batch_is_refused_before_anything_is_written(models):
    rt, s = live_prefilled(models)
    t = rt.add_sequence([4, 4, 4])
    rt.prefill(t)
    before = state(rt, [s, t])
    for batch in ([s, s], [s, t, s]):
        with pytest.raises(SequenceError, match="appears twice in one batch"):
            rt.spec_step(batch, 3)
        with pytest.raises(SequenceError, match="appears twice"):
            rt.decode_step(batch)
    same(before, state(rt, [s, t]))


def test_prefill_twice_is_refused(models):
    rt, s = live_prefilled(models)
    before = state(rt, [s])
    with pytest.raises(SequenceError, match="already prefilled"):
        rt.prefill(s)
    same(before, state(rt, [s]))


def test_step_before_prefill_is_refused(models):
    rt = make_rt(models)
    s = rt.add_sequence([1, 2])
    with pytest.raises(SequenceError, match="has not been prefilled"):
        rt.decode_step([s])


def test_prefill_retried_after_pool_exhausted_is_exact(models):
    rt = make_rt(models, kv_blocks=8)  # 32 rows
    hog = rt.add_sequence(list(range(20)))
    rt.prefill(hog)  # 5 pages taken, 3 left: 12 rows
    s = rt.add_sequence(list(range(30, 60)))  # 30 rows: its prefill runs out part-way (after a chunk)
    free = free_counts(rt)
    with pytest.raises(PoolExhausted):
        rt.prefill(s)
    assert free_counts(rt) == free and s.seq_len == 0 and s.bonus is None and not s.pages
    with pytest.raises(PoolExhausted):  # retried while still short: refused the same way, nothing leaked
        rt.prefill(s)
    assert free_counts(rt) == free
    rt.release(hog)
    first = rt.prefill(s)
    assert s.seq_len == 30
    ref = make_rt(models, kv_blocks=8)
    r = ref.add_sequence(list(range(30, 60)))
    assert ref.prefill(r) == first and ref.spec_step([r], 1)[0] == rt.spec_step([s], 1)[0]


@pytest.mark.parametrize("prompt", [[3.7, 4.2], [np.float32(3.0)], [True, 2], ["a"], "hello", [1, None]])
def test_non_integer_token_ids_are_refused(models, prompt):
    rt = make_rt(models)
    free = free_counts(rt)
    with pytest.raises(TokenIdError):
        rt.add_sequence(prompt)
    with pytest.raises(TokenIdError):
        rt.add_request(prompt, 4)
    assert free_counts(rt) == free and not rt.has_work


def test_numpy_and_out_of_vocab_ids(models):
    rt = make_rt(models)
    s = rt.add_sequence(np.array([1, 2, 3], dtype=np.int32))
    assert s.tokens == [1, 2, 3] and all(type(t) is int for t in s.tokens)
    with pytest.raises(TokenIdError, match="token id 259 outside the vocabulary"):
        rt.add_sequence([1, 259])


def test_bad_gamma_is_refused_before_the_step(models):
    rt, s = live_prefilled(models)
    before = state(rt, [s])
    for g in (0, 16, -3, 2.5):
        with pytest.raises(GammaError):
            rt.spec_step([s], g)
    same(before, state(rt, [s]))


def test_scheduler_api_misuse(models):
    rt, ref = make_rt(models), make_rt(models)
    other = make_rt(models)
    foreign = other.add_request([9, 9], 4)
    reqs = [rt.add_request([1, 2, 3], 12, gamma=3), rt.add_request([7, 8], 12, gamma=3)]
    refs = [ref.add_request([1, 2, 3], 12, gamma=3), ref.add_request([7, 8], 12, gamma=3)]
    rt.step(), ref.step()
    for call, exc in ((lambda: rt.release_request(foreign), SequenceError),
                      (lambda: rt.release_request(object()), SequenceError),
                      (lambda: rt.decode_step([reqs[0].seq]), SequenceError),
                      (lambda: rt.release(reqs[0].seq), SequenceError),
                      (lambda: rt.add_request([1.5], 3, gamma=3), TokenIdError),
                      (lambda: rt.add_request([1], 0, gamma=3), ValueError),
                      (lambda: rt.add_request([1], 2.5, gamma=3), ValueError),
                      (lambda: rt.add_request([1], 4, gamma=16), GammaError),
                      (lambda: rt.add_request(list(range(60)), 4, gamma=3), CapacityError)):
        with pytest.raises(exc):
            call()
    assert foreign.status == "waiting" and other.scheduler.waiting[0] is foreign
    while ref.has_work:
        rt.step(), ref.step()
    assert [r.tokens for r in reqs] == [r.tokens for r in refs] and not rt.has_work
    assert free_counts(rt) == free_counts(ref)


# ---- randomized misuse ------------------------------------------------------------------------
exhausted = [0]


def _outcome(fn):
    try:
        return ("ok", fn())
    except (PoolExhausted, CapacityError) as e:
        exhausted[0] += 1
        return ("exhausted", type(e).__name__)


def test_randomized_misuse_matches_a_reference_run(models):
    """Good calls run on both runtimes (same outcome, exhaustion included: all-or-nothing); bad calls only
    on `rt`, and after each one rt's pools and live sequences equal the reference's."""
    rng = random.Random(1234)
    rt, ref, other = make_rt(models), make_rt(models), make_rt(models)
    foreign = other.add_sequence([3, 1, 4])
    other.prefill(foreign)
    pairs = []  # (seq of rt, seq of ref), live
    released = []
    refused = good = 0
    for _ in range(3000):
        live = [p for p in pairs if p[0].bonus is not None]
        fresh = [p for p in pairs if p[0].bonus is None]
        op = rng.random()
        if op < 0.2:  # ---- a good call, on both runtimes
            good += 1
            kind = rng.choice(["add", "prefill", "step", "step", "release"])
            if kind == "add" or not pairs:
                prompt = [rng.randrange(258) for _ in range(rng.randrange(1, 30))]
                a, b = _outcome(lambda: rt.add_sequence(prompt)), _outcome(lambda: ref.add_sequence(prompt))
                assert a[0] == b[0]
                if a[0] == "ok":
                    pairs.append((a[1], b[1]))
            elif kind == "prefill" and fresh:
                s, r = rng.choice(fresh)
                assert _outcome(lambda: rt.prefill(s)) == _outcome(lambda: ref.prefill(r))
            elif kind == "step" and live:
                batch = rng.sample(live, rng.randrange(1, len(live) + 1))
                g = rng.randrange(0, 16)  # 0: plain decode
                a = _outcome(lambda: rt.spec_step([p[0] for p in batch], g) if g else rt.decode_step([p[0] for p in batch]))
                b = _outcome(lambda: ref.spec_step([p[1] for p in batch], g) if g else ref.decode_step([p[1] for p in batch]))
                assert a == b
            else:
                p = rng.choice(pairs)
                rt.release(p[0]), ref.release(p[1])
                pairs.remove(p)
                released.append(p[0])
        else:  # ---- a bad call, on rt only: refused, nothing changed
            before = state(rt, [p[0] for p in pairs])
            choices = []
            if released:
                d = rng.choice(released)
                choices += [lambda: rt.decode_step([d]), lambda: rt.spec_step([d], 2), lambda: rt.prefill(d)]
                if live:
                    choices.append(lambda: rt.spec_step([rng.choice(live)[0], d], 3))
            if live:
                s = rng.choice(live)[0]
                choices += [lambda: rt.spec_step([s, s], 1 + rng.randrange(15)), lambda: rt.decode_step([s, s]),
                            lambda: rt.prefill(s), lambda: rt.spec_step([s], rng.choice([0, 16, -1]))]
            if fresh:
                choices.append(lambda: rt.decode_step([rng.choice(fresh)[0]]))
            choices += [lambda: rt.decode_step([foreign]), lambda: rt.release(foreign), lambda: rt.decode_step([]),
                        lambda: rt.add_sequence([1.5, 2.0]), lambda: rt.add_sequence([np.float64(7)]),
                        lambda: rt.add_sequence([False])]
            with pytest.raises((SequenceError, TokenIdError, GammaError)):
                rng.choice(choices)()
            refused += 1
            same(before, state(rt, [p[0] for p in pairs]))
        same(state(rt, [p[0] for p in pairs]), state(ref, [p[1] for p in pairs]))
    assert refused > 2000 and good > 500 and exhausted[0] > 10
    for s, r in pairs:  # the survivors continue identically
        if s.bonus is not None:
            assert _outcome(lambda: rt.decode_step([s])) == _outcome(lambda: ref.decode_step([r]))
