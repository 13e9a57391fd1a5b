"""`pytest -m trt_gpu`: the TensorRT backend executing the trained pair's engines. Runs only where a
TensorRT flavour accepts the GPU (TensorRT-RTX: CC 8.0/8.6/8.9/12.x incl. GB10; full TensorRT: Hopper); skips
elsewhere with the reason (tests/conftest.py), e.g. on the project's H200 with TensorRT-RTX.

  lossless   DFlash == plain == the stored CPU reference tokens (fp32), batch 1 and batch 4
  compare    every graph output of torch vs trt on the same inputs; top-10 KL of the logits < 1e-6 (fp32)
"""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
pytestmark = pytest.mark.trt_gpu
N_NEW = 48


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(ROOT, "tests", "data", "trained_greedy_128.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runtime():
    from dflash_trt.abi import PoolSizes
    from dflash_trt.runtime.load import load_runtime

    rt, _ = load_runtime(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"), "trt",
                         PoolSizes(max_seq_len=512, kv_blocks=64, dkv_blocks=96),
                         ks=(1, 16), device="cuda", dtype="float32")
    return rt


def test_trt_dflash_equals_plain_equals_cpu_reference_batch1(runtime, reference):
    for ids, ref in list(zip(reference["prompt_ids"], reference["tokens"]))[:4]:
        plain, _ = runtime.generate(ids, N_NEW, spec=False)
        spec, st = runtime.generate(ids, N_NEW, gamma=15)
        assert plain == ref[:N_NEW] and spec == ref[:N_NEW]
        assert st.tau > 1.5


@pytest.mark.parametrize("spec", [False, True])
def test_trt_batch4_equals_cpu_reference(runtime, reference, spec):
    reqs = [runtime.add_request(reference["prompt_ids"][k], N_NEW, gamma=15, spec=spec) for k in range(4)]
    while runtime.has_work:
        runtime.step()
    for k, r in enumerate(reqs):
        assert r.tokens == reference["tokens"][k][:N_NEW], k
    assert ("target_k1", 4) in runtime.backend._contexts


def test_compare_torch_trt_topk_kl(runtime):
    from dflash_trt.tools.compare import compare

    rep = compare(runtime.backend.manifest.root, ["torch", "trt"], steps=6)
    assert rep.ok, rep.format()
    assert rep.kl and max(k for *_, k in rep.kl) < 1e-6, rep.format()
