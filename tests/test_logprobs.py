"""Logprobs of emitted tokens on the shipped trained pair (CPU, fp32): under DFlash (greedy and sampled) they equal
plain decoding's and transformers' log_softmax of the target's logits on the same tokens, top-k included; the fused
device step (TorchCpuDevice: the CUDA-graph code, eagerly) reports the host executor's values; a step with no row
asking computes none (no logprobs key, no logits); bad k refused."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

from dflash_trt.export.checkpoint import load_drafter, load_target  # noqa: E402
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor  # noqa: E402
from dflash_trt.runtime.backends.torch_backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice  # noqa: E402
from dflash_trt.runtime.load import load_codec  # noqa: E402
from dflash_trt.runtime.runtime import Runtime  # noqa: E402
from dflash_trt.runtime.sampling import SamplingError, SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET, DRAFTER = os.path.join(ROOT, "models", "target"), os.path.join(ROOT, "models", "drafter")
N, K = 20, 5


@pytest.fixture(scope="module")
def pair():
    t = load_target(TARGET, torch.float32)
    return t, load_drafter(DRAFTER, t, torch.float32), load_codec(TARGET)


@pytest.fixture(scope="module")
def hf():
    return transformers.Qwen3_5ForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def runtime(pair, fused=False):
    t, d, _ = pair
    kw = dict(device=TorchCpuDevice(), executor=lambda rt: GraphStepExecutor(rt, inflight=1)) if fused else {}
    from dflash_trt.abi import PoolSizes

    sizes = PoolSizes(kv_blocks=128, page_size=16, max_seq_len=256, max_seqs=4, dkv_blocks=128, prefill_chunk=32)
    return Runtime(TorchBackend(t, d), t.cfg, d.cfg, sizes, **kw)


def run(rt, reqs):
    """reqs: (prompt ids, add_request kwargs) queued together, stepped to the end."""
    out = [rt.add_request(ids, N, **kw) for ids, kw in reqs]
    while rt.has_work:
        rt.step()
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.sizes.max_seqs
    return out


def reference(hf, prompt, tokens):
    """transformers' log_softmax at the positions that emitted `tokens` after `prompt`: [len(tokens), V]."""
    with torch.no_grad():
        lg = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(lg, -1)


def check(req, ref, k):
    assert [e.token_id for e in req.logprobs] == req.tokens and all(len(e.top) == k for e in req.logprobs)
    got = torch.tensor([e.logprob for e in req.logprobs])
    want = ref.gather(-1, torch.tensor(req.tokens)[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    top_lp, top_ids = ref.topk(k, -1)
    for e, ids, lps in zip(req.logprobs, top_ids.tolist(), top_lp.tolist()):
        assert [i for i, _ in e.top] == ids and np.allclose([v for _, v in e.top], lps, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["host", "fused"])
def test_logprobs_dflash_equal_plain_and_transformers(pair, hf, fused):
    codec = pair[2]
    a, b = codec.encode("def fibonacci(n):\n    "), codec.encode("import os\n")
    rt = runtime(pair, fused)
    greedy, sampled, plainless = run(rt, [(a, dict(logprobs=K)), (b, dict(logprobs=0, temperature=0.8, seed=3)),
                                          (b, {})])
    assert sum(greedy.accepted) > 0 and len(greedy.tokens) == N  # speculation accepted drafts: the verify rows
    check(greedy, reference(hf, a, greedy.tokens), K)
    check(sampled, reference(hf, b, sampled.tokens), 0)  # the raw distribution, not the tempered one
    assert plainless.logprobs == []
    plain = run(rt, [(a, dict(logprobs=K, spec=False))])[0]
    assert plain.tokens == greedy.tokens
    assert np.allclose([e.logprob for e in plain.logprobs], [e.logprob for e in greedy.logprobs], atol=1e-5)
    if fused:
        keys = set(rt.executor.buffers)
        assert any(k[-1] == "logprobs" and k[0] == "spec" for k in keys)
        assert any(k[-1] == "logprobs" and k[0] == "prefill" for k in keys)


def test_no_logprobs_no_logits(pair, monkeypatch):
    """Steps without a row asking compute no logprobs, the host executor asks its graphs for no logits, and the fused
    step runs its plain keys."""
    from dflash_trt.runtime import host_step
    from dflash_trt.runtime.backends import torch_fused_step

    calls, asked = [], []
    for mod in (host_step, torch_fused_step):
        monkeypatch.setattr(mod, "token_logprobs", lambda *a: calls.append(a))
    run_graph = host_step.HostStepExecutor._run
    monkeypatch.setattr(host_step.HostStepExecutor, "_run",
                        lambda self, g, x, logits: (asked.append(logits), run_graph(self, g, x, logits))[1])
    ids = pair[2].encode("import os\n")
    for fused in (False, True):
        rt = runtime(pair, fused)
        req = run(rt, [(ids, {})])[0]
        assert len(req.tokens) == N and req.logprobs == [] and calls == []
    assert asked and not any(asked)
    assert all(k[-1] != "logprobs" for k in rt.executor.buffers)


@pytest.mark.parametrize("k", [-1, 21, True, 2.0])
def test_bad_logprobs_refused(k):
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=k)


def test_llm_logprobs_equal_transformers(hf):
    from dflash_trt import LLM, SamplingParams as Params

    llm = LLM(TARGET, DRAFTER)
    prompt = "class Stack:\n    def push(self, item):\n"
    out = llm.generate(prompt, Params(max_tokens=N, logprobs=3, n=2, temperature=0.7, seed=5))[0]
    ids = list(out.prompt_token_ids)
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) and c.finish_reason == "length"
        ref = reference(hf, ids, list(c.token_ids))
        want = ref.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([e.logprob for e in c.logprobs]), want, atol=1e-4)
        assert [[i for i, _ in e.top] for e in c.logprobs] == ref.topk(3, -1).indices.tolist()
    assert llm.generate(prompt, Params(max_tokens=4))[0].outputs[0].logprobs is None


@pytest.mark.gpu
def test_gpu_cuda_graph_logprobs_equal_cpu(pair):
    """The CUDA-graph executor's logprobs keys (captured) report the CPU host executor's values."""
    from dflash_trt import load_runtime

    codec = pair[2]
    ids = codec.encode("def fibonacci(n):\n    ")
    want = run(runtime(pair), [(ids, dict(logprobs=K))])[0]
    gpu, _ = load_runtime(TARGET, DRAFTER, "torch", device="cuda", dtype="float32", compile_steps=False)
    plain = run(gpu, [(ids, {})])[0]
    assert all(k[-1] != "logprobs" for k in gpu.executor.buffers)  # nothing asked: no logprobs key ran
    got = run(gpu, [(ids, dict(logprobs=K))])[0]
    assert got.tokens == want.tokens == plain.tokens and gpu.executor.graphs
    assert all(gpu.executor.graphs[k] is not None for k in gpu.executor.buffers if k[-1] == "logprobs")
    # fp32 on both; the GPU's reductions run in another order
    assert np.allclose([e.logprob for e in got.logprobs], [e.logprob for e in want.logprobs], atol=1e-3)
    assert [[i for i, _ in e.top] for e in got.logprobs] == [[i for i, _ in e.top] for e in want.logprobs]
