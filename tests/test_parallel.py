"""Tensor / expert parallelism on the CPU (gloo, 2 processes): a sharded target's full-sequence logits, its cached
greedy tokens through the runtime and DFlash decoding equal the single-process run and transformers; a rank that
fails mid-generation fails the run on every rank within the collective timeout."""
import dataclasses
import time

import numpy as np
import pytest
import torch
from hf_tiny import make_hf_model

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.gating import Gate
from dflash_trt.runtime.parallel.launch import ParallelError, run_parallel
from dflash_trt.runtime.parallel.shard import ShardError, check_shardable, shard_target
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import TINY_MOE, make_tiny_pair

SIZES = PoolSizes(kv_blocks=32, page_size=8, max_seq_len=128, max_seqs=2, dkv_blocks=32, ctx_window=16,
                  prefill_chunk=16)
N_NEW = 16
PROMPT = [int(t) for t in np.random.default_rng(2).integers(0, 250, 30)]


def _run_case(case: dict, shard: bool) -> dict:
    """One checkpoint: full-sequence logits of PROMPT, cached greedy tokens, and DFlash tokens when a drafter
    is given; on a sharded target when `shard` (every rank alike)."""
    torch.manual_seed(0)
    target = load_target(case["target"])
    if shard:
        shard_target(target, experts=case.get("experts", "ep"))
    drafter = load_drafter(case["drafter"], target) if case.get("drafter") else None
    out = {"cfg": (target.cfg.num_heads, target.cfg.num_kv_heads, target.cfg.lin_num_v_heads)}
    with torch.no_grad():
        out["logits"] = target.forward_full(torch.tensor([PROMPT]))["logits"]
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg if drafter else None, SIZES,
                 gate=Gate(min_rate=0.0))
    out["plain"], _ = rt.generate(PROMPT, N_NEW, spec=False)
    if drafter is not None:
        out["spec"], st = rt.generate(PROMPT, N_NEW, gamma=3)
        out["spec_steps"] = st.spec_steps
    return out


def _rank(cases: list) -> list:
    return [_run_case(c, shard=True) for c in cases]


def _hf_greedy(hf, n: int) -> list:
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(PROMPT):]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Cases: Qwen3.5 dense (split GDN projections), Qwen3-Next MoE (interleaved qkvz, dense and sparse layers)
    with experts whole per rank (EP) and split within (TP), a tiny target + DFlash drafter pair with an MoE target.
    Returns (cases, hf greedy tokens by case, single-process results, 2-rank results)."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("tp")
    hf = {k: make_hf_model(k, 2, str(d / k)) for k in ("qwen3_5", "qwen3_next_moe")}
    tdir, ddir = make_tiny_pair(str(d / "pair"), seed=5, target_over=dict(TINY_MOE))
    cases = [{"target": str(d / "qwen3_5")}, {"target": str(d / "qwen3_next_moe"), "experts": "ep"},
             {"target": str(d / "qwen3_next_moe"), "experts": "tp"}, {"target": tdir, "drafter": ddir}]
    oracle = {i: _hf_greedy(hf[k], N_NEW) for i, k in ((0, "qwen3_5"), (1, "qwen3_next_moe"))}
    single = [_run_case(c, shard=False) for c in cases]
    t0 = time.perf_counter()
    par = run_parallel(_rank, 2, (cases,), timeout_s=120)
    assert time.perf_counter() - t0 < 300
    return cases, oracle, single, par


@pytest.mark.parametrize("i", range(4), ids=["dense", "moe-ep", "moe-tp", "pair"])
def test_sharded_logits_and_greedy_match_single_process(runs, i):
    cases, oracle, single, par = runs
    one, two = single[i], par[i]
    assert two["cfg"] == tuple(n // 2 for n in one["cfg"])  # the pools were sized by the local heads
    diff = (two["logits"] - one["logits"]).abs().max().item()
    assert diff <= 1e-4, diff
    assert two["plain"] == one["plain"]
    if i in oracle:
        assert two["plain"] == oracle[i]


def test_dflash_equals_plain_under_tp(runs):
    _, _, single, par = runs
    assert par[3]["spec_steps"] > 0
    assert par[3]["spec"] == par[3]["plain"] == single[3]["plain"]


class _Boom(RuntimeError):
    pass


def _failing_rank(case: dict) -> list:
    """Rank 1's target raises on its 5th MLP call (mid-generation, after prefill); rank 0 runs on."""
    import torch.distributed as dist

    target = shard_target(load_target(case["target"]))
    calls = [0]

    def boom(_m, _args):
        calls[0] += 1
        if dist.get_rank() == 1 and calls[0] == 5:
            raise _Boom("injected fault on rank 1")

    target.layers[0].mlp.register_forward_pre_hook(boom)
    rt = Runtime(TorchBackend(target), target.cfg, None, SIZES)
    return rt.generate(PROMPT, N_NEW, spec=False)[0]


def test_rank_failing_mid_generation_fails_every_rank(runs):
    cases = runs[0]
    t0 = time.perf_counter()
    with pytest.raises(ParallelError, match="rank 1 of 2 failed.*injected fault"):
        run_parallel(_failing_rank, 2, (cases[0],), timeout_s=20)
    assert time.perf_counter() - t0 < 60  # no rank waits past the collective timeout


def test_sizes_that_do_not_divide_refused_by_name(runs):
    cfg = load_target(runs[0][1]["target"]).cfg
    check_shardable(cfg, 2, "ep")
    with pytest.raises(ShardError, match="num_attention_heads = 4 does not divide over 3 ranks"):
        check_shardable(cfg, 3)
    with pytest.raises(ShardError, match="num_experts = 6 does not divide over 4 ranks"):
        check_shardable(dataclasses.replace(cfg, num_heads=8, num_kv_heads=4, lin_num_k_heads=4), 4, "ep")
    with pytest.raises(ShardError, match="experts='dp'"):
        check_shardable(cfg, 2, "dp")
