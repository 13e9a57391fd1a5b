"""Sampling through the Runtime (tiny real target + DFlash drafter, vocab 16): the first 3 tokens of DFlash
sampling on the host executor and on the fused device step (TorchCpuDevice: the CUDA-graph code, eagerly) are
distributed as the exact target distribution computed by enumeration with the target's dense forward; same seed ->
same tokens; temperature-0 requests in a batch with sampling ones == greedy (all of it also with a DFlash2
drafter, whose candidate selector draws the drafts); bad parameters -> one error (API and
CLI); a backend without logits refused. GPU: the same on the CUDA graphs."""
import numpy as np
import pytest
import torch
from test_sampling import chi2_pvalue, ref_probs, tv_noise

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.interfaces import BackendDefaults
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.runtime.sampling import SamplingError
from dflash_trt.tools.tiny import KERNEL_SHAPES, make_tiny_pair

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = 16
SIZES = PoolSizes(kv_blocks=320, page_size=4, max_seq_len=64, max_seqs=16, dkv_blocks=320, prefill_chunk=16)
PROMPT = [3, 9, 1, 4, 7]
SAMPLE = dict(temperature=1.0, top_k=4)  # support <= 4 per position: <= 64 cells for 3 tokens




@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    td, dd = make_tiny_pair(str(tmp_path_factory.mktemp("s")), seed=11, target_over=dict(vocab=VOCAB),
                            drafter_over=dict(block_size=4))
    t = load_target(td, torch.float32)
    return t, load_drafter(dd, t, torch.float32)


def runtime(pair, fused=False, sizes=SIZES):
    t, d = pair
    kw = dict(device=TorchCpuDevice(), executor=lambda rt: GraphStepExecutor(rt, inflight=1)) if fused else {}
    return Runtime(TorchBackend(t, d), t.cfg, d.cfg, sizes, **kw)


def exact_first3(target, prompt, t=1.0, k=4):
    """P(x1, x2, x3) by enumeration over the (top-k) support, next-token logits from the dense forward."""
    def nxt(prefixes):
        with torch.no_grad():
            lg = target.forward_full(torch.tensor(prefixes))["logits"][:, -1]
        return [ref_probs(r, t, k, 1.0, 0.0) for r in lg]

    out = np.zeros(VOCAB ** 3)
    p1 = nxt([prompt])[0]
    s1 = np.nonzero(p1)[0]
    p2 = dict(zip(s1, nxt([prompt + [int(x)] for x in s1])))
    pre2 = [(int(a), int(b)) for a in s1 for b in np.nonzero(p2[a])[0]]
    p3 = dict(zip(pre2, nxt([prompt + list(ab) for ab in pre2])))
    for (a, b), p in p3.items():
        out[(a * VOCAB + b) * VOCAB:(a * VOCAB + b + 1) * VOCAB] = p1[a] * p2[a][b] * p
    return out


def sample_first3(rt, n, seed0=0, gamma=None, **kw):
    """n requests of 3 new tokens each, seeds seed0.., batched 16 at a time by the scheduler; also the step widths
    it ran (gamma None: chosen per step)."""
    reqs, widths = [], set()
    for i in range(n):
        reqs.append(rt.add_request(PROMPT, 3, gamma=gamma, temperature=kw.get("temperature", 1.0),
                                   top_k=kw.get("top_k", 0), seed=seed0 + i))
    rt.scheduler.on_step = lambda rt, req, plan, res, row: widths.add(plan.K)
    while rt.has_work:
        rt.step()
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.sizes.max_seqs
    return np.array([r.tokens for r in reqs]), [a for r in reqs for a in r.accepted], widths


@pytest.fixture(scope="module")
def pair2(tmp_path_factory):
    """The same with a DFlash2 drafter: its candidate selector draws the drafts from q over its top 3."""
    td, dd = make_tiny_pair(str(tmp_path_factory.mktemp("s2")), seed=11, target_over=dict(vocab=VOCAB),
                            drafter_over=dict(block_size=4, conv_kernel_size=2, conv_group_size=16, selector_rank=4,
                                              selector_top_k=3))
    t = load_target(td, torch.float32)
    return t, load_drafter(dd, t, torch.float32)


@pytest.mark.parametrize("fused,n,gamma", [(False, 1600, None), (True, 1000, None), (False, 1600, 3)],
                         ids=["host-auto", "fused-auto", "host-gamma3"])
def test_dflash_sampling_first_three_tokens_exact(pair, fused, n, gamma):
    """Exact with the width chosen per step (auto: plain and spec steps of several widths mixed in one run) and with
    a fixed gamma (every step drafts 3)."""
    _check_first3_exact(pair, fused, n, gamma)


@pytest.mark.parametrize("fused,n", [(False, 1600), (True, 1000)], ids=["host", "fused"])
def test_dflash2_sampling_first_three_tokens_exact(pair2, fused, n):
    _check_first3_exact(pair2, fused, n, None)


def _check_first3_exact(pair, fused, n, gamma):
    exact = exact_first3(pair[0], PROMPT)
    toks, accepted, widths = sample_first3(runtime(pair, fused), n, gamma=gamma, **SAMPLE)
    assert 1 in widths and max(widths) > 1 if gamma is None else widths == {gamma + 1}
    c = np.bincount((toks[:, 0] * VOCAB + toks[:, 1]) * VOCAB + toks[:, 2], minlength=VOCAB ** 3)
    tv, bound, pv = 0.5 * np.abs(c / n - exact).sum(), 1.5 * tv_noise(exact, n), chi2_pvalue(c, exact * n)
    assert tv < bound and pv > 1e-4, (tv, bound, pv)
    assert 0 in accepted and max(accepted) > 0  # both the residual and the accept path ran


@pytest.mark.parametrize("which", ["pair", "pair2"], ids=["dflash", "dflash2"])
def test_same_seed_same_tokens_and_executors_agree(which, request):
    pair = request.getfixturevalue(which)
    rt, rf = runtime(pair), runtime(pair, fused=True)
    a = rt.generate(PROMPT, 24, temperature=0.9, top_p=0.9, seed=5)[0]
    assert a == rt.generate(PROMPT, 24, temperature=0.9, top_p=0.9, seed=5)[0]
    assert a != rt.generate(PROMPT, 24, temperature=0.9, top_p=0.9, seed=6)[0]
    assert a == rf.generate(PROMPT, 24, temperature=0.9, top_p=0.9, seed=5)[0]  # one math, same keys
    plain = rt.generate(PROMPT, 24, spec=False, temperature=0.9, seed=5)[0]
    assert plain == rt.generate(PROMPT, 24, spec=False, temperature=0.9, seed=5)[0]


@pytest.mark.parametrize("which", ["pair", "pair2"], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("fused", [False, True], ids=["host", "fused"])
def test_greedy_requests_in_a_sampling_batch_are_greedy(fused, which, request):
    rt = runtime(request.getfixturevalue(which), fused)
    greedy = rt.generate(PROMPT, 20)[0]
    assert greedy == rt.generate(PROMPT, 20, temperature=0.0, seed=3)[0]
    reqs = [rt.add_request(PROMPT, 20, temperature=0.0 if i % 2 == 0 else 1.0, seed=i) for i in range(6)]
    while rt.has_work:
        rt.step()
    assert all(r.tokens == greedy for r in reqs[::2])
    assert any(r.tokens != greedy for r in reqs[1::2])


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=0.5, top_p=0.0), dict(top_p=1.01),
                                 dict(top_k=-1), dict(min_p=1.5)])
def test_bad_params_one_error_nothing_queued(pair, bad):
    rt = runtime(pair)
    with pytest.raises(SamplingError):
        rt.generate(PROMPT, 4, **bad)
    with pytest.raises(SamplingError):
        rt.add_request(PROMPT, 4, **bad)
    assert not rt.has_work and rt.slots.num_free == rt.sizes.max_seqs


@pytest.mark.parametrize("flag,value,msg", [("--temperature", "-1", "temperature must be >= 0"),
                                            ("--top-p", "0", "top_p must be in (0, 1]"),
                                            ("--top-k", "-2", "top_k must be an integer >= 0"),
                                            ("--min-p", "2", "min_p must be in [0, 1]")])
def test_cli_bad_params_one_line(tmp_path, capsys, flag, value, msg):
    from dflash_trt.cli import main

    rc = main(["generate", "--model", str(tmp_path / "none"), "--prompt", "hi", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("dflash-trt generate: error: ") and msg in err[0]


class NoLogits(BackendDefaults):
    """A backend whose graphs emit no logits (an export with --no-logits)."""

    def __init__(self, inner):
        self.inner, self.name, self.kv_dtype = inner, "nologits", inner.kv_dtype

    def run(self, graph, inputs):
        return {k: v for k, v in self.inner.run(graph, inputs).items() if k != "logits"}


def test_backend_without_logits_refused_pools_consistent(pair):
    t, d = pair
    rt = Runtime(NoLogits(TorchBackend(t, d)), t.cfg, d.cfg, SIZES)
    with pytest.raises(SamplingError, match="emits no logits"):
        rt.generate(PROMPT, 4, temperature=1.0, seed=1)
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.sizes.max_seqs
    assert rt.generate(PROMPT, 6)[0] == runtime(pair).generate(PROMPT, 6)[0]  # greedy still fine


def test_sampling_joiner_refused_alone_in_a_shared_prefill(pair):
    """A greedy and a sampling request join together on graphs without logits: their shared prefill launch is
    refused, each row is retried alone, and only the sampling request fails; the greedy one's tokens are those
    it gets alone, and every pool comes back full."""
    t, d = pair
    rt = Runtime(NoLogits(TorchBackend(t, d)), t.cfg, d.cfg, SIZES)
    greedy = rt.add_request(PROMPT, 6, spec=False)
    sampled = rt.add_request(PROMPT[::-1], 6, spec=False, temperature=1.0, seed=1)
    while rt.scheduler.has_work:
        rt.step()
    assert sampled.status == "failed" and isinstance(sampled.error, SamplingError)
    assert greedy.status == "finished" and greedy.tokens == runtime(pair).generate(PROMPT, 6)[0]
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.sizes.max_seqs


# ---- GPU: the CUDA graphs ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel_pair(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("sk")), seed=11, **KERNEL_SHAPES)


@pytest.mark.gpu
def test_gpu_sampling_in_cuda_graphs(kernel_pair):
    from dflash_trt.runtime import sampling as S
    from dflash_trt.runtime.devices.cuda import CudaDevice

    seeds, pos = torch.arange(4096) * 7 + 3, torch.arange(4096) * 13
    assert torch.equal(S.uniform(seeds.cuda(), pos.cuda(), S.ACCEPT).cpu(), S.uniform(seeds, pos, S.ACCEPT))
    t = load_target(kernel_pair[0], torch.float32)
    d = load_drafter(kernel_pair[1], t, torch.float32)
    tc = load_target(kernel_pair[0], torch.float32).cuda()
    dc = load_drafter(kernel_pair[1], tc, torch.float32).cuda()
    sizes = PoolSizes(kv_blocks=256, page_size=16, max_seq_len=256, max_seqs=8, dkv_blocks=256, prefill_chunk=16)
    cpu = Runtime(TorchBackend(t, d), t.cfg, d.cfg, sizes)
    rt = Runtime(TorchBackend(tc, dc), tc.cfg, dc.cfg, sizes, device=CudaDevice())
    prompt = [int(x) for x in np.random.default_rng(2).integers(0, 250, 19)]
    greedy = cpu.generate(prompt, 32)[0]
    a = rt.generate(prompt, 32, temperature=0.8, top_k=50, seed=7)[0]
    assert a == rt.generate(prompt, 32, temperature=0.8, top_k=50, seed=7)[0]
    assert a != greedy
    reqs = [rt.add_request(prompt, 32, temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.95, seed=i) for i in range(4)]
    while rt.has_work:
        rt.step()
    assert all(r.tokens == greedy for r in reqs[::2]) and any(r.tokens != greedy for r in reqs[1::2])
    ex = rt.executor
    sampled = [k for k in ex.graphs if k[-1] == "sampled"]
    assert sampled and all(ex.graphs[k] is not None for k in sampled), (sampled, ex.eager_keys)
    print(f"GPU sampled tokens == CPU sampled tokens (same seed): "
          f"{a == cpu.generate(prompt, 32, temperature=0.8, top_k=50, seed=7)[0]}")
