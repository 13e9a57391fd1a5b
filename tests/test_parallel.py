"""Tensor / expert parallelism on the CPU (gloo, 2 processes): a sharded target's full-sequence logits, its cached
greedy tokens through the runtime and DFlash decoding equal the single-process run and transformers; a rank that
fails mid-generation fails the run on every rank within the collective timeout."""
import dataclasses
import functools
import time

import numpy as np
import pytest
import torch
from hf_tiny import make_hf_model

from dflash_trt import LLM, SamplingParams
from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.load import UsageError, load_runtime
from dflash_trt.runtime.parallel.launch import ParallelError, run_parallel
from dflash_trt.runtime.parallel.shard import ShardError, check_shardable, shard_target
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.runtime.sequence import TokenIdError
from dflash_trt.tools.tiny import TINY_MOE, make_tiny_pair

SIZES = PoolSizes(kv_blocks=32, page_size=8, max_seq_len=128, max_seqs=2, dkv_blocks=32, ctx_window=16,
                  prefill_chunk=16)
N_NEW = 16
PROMPT = [int(t) for t in np.random.default_rng(2).integers(0, 250, 30)]


def _run_case(case: dict, shard: bool) -> dict:
    """One checkpoint: full-sequence logits of PROMPT, cached greedy tokens, and DFlash tokens when a drafter
    is given; on a sharded target when `shard` (every rank alike)."""
    torch.manual_seed(0)
    split = functools.partial(shard_target, experts=case.get("experts", "ep")) if shard else None
    if case.get("in_memory"):  # the whole target loaded, then split
        target = split(load_target(case["target"])) if split else load_target(case["target"])
    else:  # built on the meta device, split, then each rank reads its slices
        target = load_target(case["target"], split=split)
    drafter = load_drafter(case["drafter"], target) if case.get("drafter") else None
    out = {"cfg": (target.cfg.num_heads, target.cfg.num_kv_heads, target.cfg.lin_num_v_heads)}
    with torch.no_grad():
        out["logits"] = target.forward_full(torch.tensor([PROMPT]))["logits"]
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg if drafter else None, SIZES)
    out["plain"], _ = rt.generate(PROMPT, N_NEW, spec=False)
    if drafter is not None:
        out["spec"], st = rt.generate(PROMPT, N_NEW, gamma=3)
        out["spec_steps"] = st.spec_steps
        fused = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES,
                        device=TorchCpuDevice(), executor=lambda r: GraphStepExecutor(r, inflight=1))
        out["fused"] = fused.generate(PROMPT, N_NEW, gamma=3)[0]  # the GPU step's code, eagerly, steps in flight
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
             {"target": str(d / "qwen3_next_moe"), "experts": "tp"}, {"target": tdir, "drafter": ddir, "in_memory": True}]
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


def _bytes_read(target_dir: str, experts: str) -> dict:
    """This rank's load from its slices: bytes the checkpoint reads returned, the bytes of its parameters (less the
    null expert, which is not read) and the largest tensor read."""
    from dflash_trt.export.checkpoint import WeightSource

    reads, get = [], WeightSource.get

    def counting(self, name, part=None):
        t = get(self, name, part)
        reads.append(t.nbytes)
        return t

    WeightSource.get = counting
    target = load_target(target_dir, split=functools.partial(shard_target, experts=experts))
    held = sum(p.nbytes for p in target.parameters())
    null = sum(p[-1].nbytes for n, p in target.named_parameters() if experts == "ep" and ".experts." in n)
    return {"read": sum(reads), "held": held - null, "largest": max(reads)}


@pytest.mark.parametrize("i", [1, 2], ids=["moe-ep", "moe-tp"])
def test_each_rank_reads_only_its_slices(runs, i):
    """A rank reads exactly the bytes of its shard (less than the whole checkpoint; no split weight read whole)."""
    import os

    case = runs[0][i]
    got = run_parallel(_bytes_read, 2, (case["target"], case["experts"]), timeout_s=60)
    whole = os.path.getsize(os.path.join(case["target"], "model.safetensors"))
    assert got["read"] == got["held"] < 0.75 * whole, (got, whole)
    embed = load_target(case["target"]).embed_tokens.weight
    assert got["largest"] < embed.nbytes  # the largest weight, split by vocabulary rows


def test_dflash_equals_plain_under_tp(runs):
    """Host executor and the fused device step (the CUDA-graph step's code on the CPU, a step kept in flight)."""
    _, _, single, par = runs
    assert par[3]["spec_steps"] > 0
    assert par[3]["spec"] == par[3]["fused"] == par[3]["plain"] == single[3]["plain"]


def _failing_rank(target_dir: str) -> tuple:
    """Rank 1's target raises on its 5th step (mid-generation, after prefill); each rank reports how its request
    ended and after how long."""
    import torch.distributed as dist

    rt, _ = load_runtime(target_dir, sizes=SIZES, tensor_parallel_size=2)
    calls, rank = [0], dist.get_rank()  # the group is gone once a rank fails

    def boom(_m, _args):
        calls[0] += 1
        if rank == 1 and calls[0] == 5:
            raise RuntimeError("injected fault on rank 1")

    rt.backend.target.layers[0].mlp.register_forward_pre_hook(boom)
    t0 = time.perf_counter()
    try:
        rt.generate(PROMPT, N_NEW, spec=False)
        return "finished", time.perf_counter() - t0
    except Exception as e:
        assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.slots.num_total
        seconds = time.perf_counter() - t0
        if rank == 1:
            time.sleep(6)  # the failed rank lives on (as a server would): rank 0 must not wait for it
        return type(e).__name__, seconds


def test_rank_failing_mid_step_fails_every_rank_at_once(runs):
    """Rank 0's request fails too, with its pages and slot back, as soon as rank 1 leaves the group on its fault:
    not when rank 1's process ends, nor after the 60 s collective timeout."""
    outcome, seconds = run_parallel(_failing_rank, 2, (runs[0][0]["target"],), timeout_s=60)
    assert outcome != "finished" and seconds < 4, (outcome, seconds)


def test_rank_raising_ends_the_run(runs):
    with pytest.raises(ParallelError, match="rank 1 of 2 failed: ShardError: shard_target takes the model as loaded"):
        run_parallel(_fused_on_rank1, 2, (runs[0][0]["target"],), timeout_s=20)


def _fused_on_rank1(target_dir: str):
    import torch.distributed as dist

    target = load_target(target_dir)
    if dist.get_rank() == 1:
        target.fuse_projections()
    shard_target(target)


def test_llm_tensor_parallel_matches_one_process(runs):
    """LLM(tensor_parallel_size=2) starts its ranks: greedy and seeded sampled DFlash completions equal the
    single-process LLM's (the same full logits on every rank, the same seeded draws)."""
    pair = runs[0][3]
    kw = dict(model=pair["target"], drafter=pair["drafter"], sizes=SIZES, gamma=3)
    params = [SamplingParams(max_tokens=N_NEW), SamplingParams(max_tokens=N_NEW, temperature=0.8, seed=7)]
    one = LLM(**kw).generate([PROMPT, PROMPT[:20]], params)
    llm = LLM(**kw, tensor_parallel_size=2)
    try:
        two = llm.generate([PROMPT, PROMPT[:20]], params)
        with pytest.raises(TokenIdError):  # refused alike on every rank: raised as is, the ranks stay up
            llm.generate([PROMPT + [10**6]])
        unseeded = llm.generate(PROMPT, SamplingParams(max_tokens=N_NEW, temperature=0.8, n=2))  # seeded once here
    finally:
        llm.close()
    ids = [[c.token_ids for c in o.outputs] for o in two]
    assert ids == [[c.token_ids for c in o.outputs] for o in one]
    assert ids[0][0] == tuple(runs[2][3]["plain"])
    assert [len(c.token_ids) for c in unseeded[0].outputs] == [N_NEW, N_NEW]


def test_llm_sizes_that_do_not_divide_refused_before_any_rank_starts(runs):
    t0 = time.perf_counter()
    with pytest.raises(ShardError, match="num_attention_heads = 4 does not divide over 3 ranks"):
        LLM(runs[0][0]["target"], tensor_parallel_size=3)
    with pytest.raises(UsageError, match="runs the torch backend"):
        LLM(runs[0][0]["target"], backend="ort", tensor_parallel_size=2)
    assert time.perf_counter() - t0 < 2


def _cuda_n(target_dir: str):
    try:
        load_runtime(target_dir, device="cuda:1", tensor_parallel_size=2)
    except UsageError as e:
        return str(e)


def test_tensor_parallel_outside_a_process_group_or_on_one_gpu_refused(runs):
    with pytest.raises(UsageError, match="tensor_parallel_size 2: call this on each of 2 ranks"):
        load_runtime(runs[0][0]["target"], tensor_parallel_size=2)
    assert "rank r runs on GPU r" in run_parallel(_cuda_n, 2, (runs[0][0]["target"],), timeout_s=20)


def test_sizes_that_do_not_divide_refused_by_name(runs):
    cfg = load_target(runs[0][1]["target"]).cfg
    check_shardable(cfg, 2, "ep")
    with pytest.raises(ShardError, match="num_attention_heads = 4 does not divide over 3 ranks"):
        check_shardable(cfg, 3)
    with pytest.raises(ShardError, match="num_experts = 6 does not divide over 4 ranks"):
        check_shardable(dataclasses.replace(cfg, num_heads=8, num_kv_heads=4, lin_num_k_heads=4), 4, "ep")
    with pytest.raises(ShardError, match="experts='dp'"):
        check_shardable(cfg, 2, "dp")
    with pytest.raises(ShardError, match="vocab_size = 5 leaves rank 3 of 4 no vocabulary rows"):
        check_shardable(dataclasses.replace(cfg, vocab_size=5, num_heads=8, num_kv_heads=4, lin_num_k_heads=4,
                                            num_experts=8), 4)


def _sampling_rank(target_dir: str, drafter_dir: str, n: int):
    from test_sampling_runtime import SAMPLE, SIZES as S_SIZES, sample_first3

    target = shard_target(load_target(target_dir))
    drafter = load_drafter(drafter_dir, target)
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, S_SIZES)
    return sample_first3(rt, n, **SAMPLE)


@pytest.mark.slow  # ~20 s on 2 cores; the TP-2 LLM test checks seeded sampled completions in seconds
def test_dflash_sampling_under_tp_keeps_the_exact_distribution(tmp_path):
    """The exact-distribution check of DFlash sampling (tests/test_sampling_runtime.py) with the target on 2 ranks:
    the first 3 sampled tokens against the single-process target's distribution by enumeration."""
    from test_sampling import chi2_pvalue, tv_noise
    from test_sampling_runtime import PROMPT as S_PROMPT, SAMPLE, VOCAB, exact_first3

    td, dd = make_tiny_pair(str(tmp_path), seed=11, target_over=dict(vocab=VOCAB), drafter_over=dict(block_size=4))
    exact = exact_first3(load_target(td), S_PROMPT, SAMPLE["temperature"], SAMPLE["top_k"])
    n = 1000
    toks, accepted, _ = run_parallel(_sampling_rank, 2, (td, dd, n), timeout_s=120)
    c = np.bincount((toks[:, 0] * VOCAB + toks[:, 1]) * VOCAB + toks[:, 2], minlength=VOCAB ** 3)
    tv, bound, pv = 0.5 * np.abs(c / n - exact).sum(), 1.5 * tv_noise(exact, n), chi2_pvalue(c, exact * n)
    assert tv < bound and pv > 1e-4, (tv, bound, pv)
    assert 0 in accepted and max(accepted) > 0


@pytest.mark.slow  # 4 processes on 2 cores: ~20 s; the 2-rank tests check the same paths
def test_four_ranks_uneven_vocab(tmp_path):
    """4 ranks (EP 4: one expert each; vocab 259 split 65/65/65/64): logits, greedy and DFlash tokens as one process."""
    td, dd = make_tiny_pair(str(tmp_path), seed=7, target_over=dict(TINY_MOE, num_key_value_heads=4,
                                                                    linear_num_key_heads=4, linear_num_value_heads=8))
    case = {"target": td, "drafter": dd}
    one = _run_case(case, shard=False)
    four = run_parallel(_rank, 4, ([case],), timeout_s=120)[0]
    assert four["cfg"] == tuple(n // 4 for n in one["cfg"])
    assert (four["logits"] - one["logits"]).abs().max().item() <= 1e-4
    assert four["spec_steps"] > 0 and four["spec"] == four["fused"] == four["plain"] == one["plain"]


def test_cli_generate_tensor_parallel(runs, capsys):
    from dflash_trt.cli import main

    pair = runs[0][3]
    argv = ["generate", "--model", pair["target"], "--drafter", pair["drafter"], "--prompt", "tensor parallel",
            "--max-new-tokens", "12", "--gamma", "3"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    assert main(argv + ["--tensor-parallel", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == one and "tensor_parallel=2" in out.err


@pytest.mark.parametrize("extra,msg", [(["--tensor-parallel", "0"], "tensor_parallel_size 0: a positive number"),
                                       (["--tensor-parallel", "2", "--backend", "ort"], "runs the torch backend"),
                                       (["--tensor-parallel", "3"], "num_attention_heads = 4 does not divide")])
def test_cli_tensor_parallel_refused_in_one_line(runs, capsys, extra, msg):
    from dflash_trt.cli import main

    pair = runs[0][3]
    assert main(["generate", "--model", pair["target"], "--prompt", "x", *extra]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


FP8_TP = dict(num_key_value_heads=2, linear_key_head_dim=128, shared_expert_intermediate_size=256)


def _fp8_tokens(target_dir: str, tp: int) -> list:
    from test_fp8_checkpoint import PROMPT as F_PROMPT, SIZES as F_SIZES

    rt, _ = load_runtime(target_dir, sizes=F_SIZES, tensor_parallel_size=tp)
    return rt.generate(F_PROMPT, N_NEW, spec=False)[0]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_fp8_target_under_tp_matches_one_process(kind, tmp_path):
    """FP8 block-wise weights split with their 128x128 scale blocks (every split on a block boundary; the MoE's
    experts whole per rank, their scales with them): greedy tokens under TP 2 equal the single process's."""
    from hf_tiny import FP8_DIMS
    from fp8_helpers import fp8_checkpoint, skip_list

    torch.set_num_threads(1)
    make_hf_model(kind, 1, str(tmp_path / "hf"), dims=dict(FP8_DIMS, **FP8_TP))
    fp8_checkpoint(str(tmp_path / "hf"), str(tmp_path / "fp8"), str(tmp_path / "ref"), skip_list(4))
    target = load_target(str(tmp_path / "fp8"))
    assert any(p.dtype == torch.float8_e4m3fn for p in target.parameters())
    one = _fp8_tokens(str(tmp_path / "fp8"), 1)
    assert run_parallel(_fp8_tokens, 2, (str(tmp_path / "fp8"), 2), timeout_s=120) == one


@pytest.mark.parametrize("kind,dims,msg", [
    ("qwen3_5", {}, "linear_num_key_heads over 2 ranks splits an FP8 weight at row 64, inside a 128-row"),
    ("qwen3_next", FP8_TP, "linear_num_key_heads over 2 ranks splits an FP8 weight at row 2, inside a 128-row")])
def test_fp8_split_inside_a_scale_block_refused_by_name(kind, dims, msg, tmp_path):
    """Key heads of 64 rows (in_proj_qkv), Qwen3-Next's 4-row in_proj_ba quantized as one partial block: refused
    before any rank starts."""
    from hf_tiny import FP8_DIMS
    from fp8_helpers import fp8_checkpoint, skip_list

    make_hf_model(kind, 1, str(tmp_path / "hf"), dims={**FP8_DIMS, "num_key_value_heads": 2, **dims})
    fp8_checkpoint(str(tmp_path / "hf"), str(tmp_path / "fp8"), str(tmp_path / "ref"), skip_list(4))
    with pytest.raises(ShardError, match=msg):
        LLM(str(tmp_path / "fp8"), tensor_parallel_size=2)
