"""The step recipe (runtime/step_recipe.py) both executors run: numpy (NP) and torch (TORCH) give the same numbers,
the running-product greedy accept equals the first-miss rule on every case, and the ctx window equals CtxWindow's
own view of it."""
import itertools

import numpy as np
import pytest
import torch

from dflash_trt.runtime.backends.torch_fused_step import TORCH
from dflash_trt.runtime.ctx import CtxWindow
from dflash_trt.runtime.pools import BlockAllocator
from dflash_trt.runtime.step_recipe import NP, ctx_window, greedy_accept, positions, propose, verify


def first_miss_accept(drafts, argmax, live):
    """The rule written out: accepted = γ when every draft matches, else the index of the first miss."""
    match = drafts == argmax[:, :drafts.shape[1]]
    acc = np.where(match.all(1), drafts.shape[1], match.argmin(1))
    return (acc + 1) * live


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_greedy_accept_running_product_equals_first_miss_on_every_pattern(gamma):
    patterns = np.array(list(itertools.product([0, 1], repeat=gamma)), dtype=bool)  # all-match and all-miss too
    B = patterns.shape[0]
    argmax = np.arange(B * (gamma + 1), dtype=np.int64).reshape(B, gamma + 1)
    drafts = np.where(patterns, argmax[:, :gamma], argmax[:, :gamma] + 1)
    live = (np.arange(B) % 3 != 2).astype(np.int64)  # some padding rows: n 0
    want = first_miss_accept(drafts, argmax, live)
    got = greedy_accept(NP, drafts, argmax, live)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    got_t = greedy_accept(TORCH, torch.from_numpy(drafts), torch.from_numpy(argmax), torch.from_numpy(live))
    assert np.array_equal(got_t.numpy(), want)
    assert want[patterns.all(1) & (live > 0)].tolist() == [gamma + 1] * int((patterns.all(1) & (live > 0)).sum())
    assert (want[live == 0] == 0).all()


@pytest.mark.parametrize("dflash2", [False, True])
def test_propose_and_verify_same_inputs_in_numpy_and_torch(dflash2):
    class Cfg:
        mask_token_id, block_size = 7, 16
    Cfg.dflash2 = dflash2  # + the selector's draws, zeros (argmax) when none are given

    seen = {}

    def run_as(kind):
        def run(graph, inputs, want_logits):
            seen.setdefault(kind, []).append((graph, {k: np.asarray(v) for k, v in inputs.items()}, want_logits))
            B = inputs["positions"].shape[0]
            return {"argmax": inputs["positions"] * 0 + 3} if graph.startswith("target") else {"drafts": B}
        return run

    bonus, seq_len = np.array([11, 12]), np.array([5, 40])
    index = {"slot": np.array([0, 1]), "seq_len": seq_len, "block_table": np.zeros((2, 3), np.int64),
             "ctx_table": np.zeros((2, 2), np.int64), "kv_start": np.array([0, 8]), "kv_len": np.array([5, 40])}
    pools = {k: np.zeros(1) for k in ("kv_pool", "gdn_pool", "conv_pool", "dkv_pool")}
    drafts = np.array([[1, 2, 3], [4, 5, 6]])
    for xp, kind, conv in ((NP, "np", np.asarray), (TORCH, "torch", torch.as_tensor)):
        ix = {k: conv(v) for k, v in index.items()}
        _, pos = propose(xp, run_as(kind), ix, conv(bonus), conv(seq_len), 4, Cfg, pools["dkv_pool"], False)
        verify(xp, run_as(kind), ix, conv(bonus), conv(drafts), pos, pools, True)
    for (ga, xa, la), (gb, xb, lb) in zip(seen["np"], seen["torch"]):
        assert (ga, la) == (gb, lb) and sorted(xa) == sorted(xb)
        assert ("draft_u" in xa) == (dflash2 and ga.startswith("drafter"))
        if "draft_u" in xa:
            assert xa["draft_u"].shape == (2, 3) and xa["draft_u"].dtype == np.float32 and not xa["draft_u"].any()
        assert all(np.array_equal(xa[k], xb[k]) for k in xa), ga
    (g, x, _), (g2, y, _) = seen["np"]
    assert g == "drafter_block_b4" and x["block_ids"].tolist() == [[11, 7, 7, 7], [12, 7, 7, 7]]
    assert x["positions"].tolist() == [[5, 6, 7, 8], [40, 41, 42, 43]]
    assert g2 == "target_k4" and y["input_ids"].tolist() == [[11, 1, 2, 3], [12, 4, 5, 6]]
    assert np.array_equal(positions(NP, seq_len, 4), x["positions"])


@pytest.mark.parametrize("window, page, steps", [(8, 4, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]), (16, 16, [16] * 5 + [1] * 9)])
def test_ctx_window_equals_the_windows_own_view(window, page, steps):
    alloc = BlockAllocator(64, "ctx")
    ctx = CtxWindow(window, page, alloc, max_append=16)
    seq_len = 0
    for n in steps:
        ctx.plan_append(n)
        ctx.finish_append(n, range(seq_len, seq_len + n))
        seq_len += n
        _, kv_start, kv_len = ctx.visible()
        for xp, conv in ((NP, np.asarray), (TORCH, torch.as_tensor)):
            s, ln = ctx_window(xp, conv([seq_len]), conv([ctx.base]), window)
            assert (int(s[0]), int(ln[0])) == (kv_start, kv_len), (seq_len, ctx.base)
    assert ctx.base > 0  # the window slid: the base matters
    s, ln = ctx_window(NP, np.array([0]), np.array([0]), window)  # a padding row
    assert (s[0], ln[0]) == (0, 0)
