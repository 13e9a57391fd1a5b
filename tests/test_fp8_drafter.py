"""A drafter quantized to FP8 blocks at load (modeling/fp8.py quantize_projections), as load_runtime does beside an
FP8 target on the GPU: the quantizer matches the release layout's (tests/fp8_helpers.py, written independently),
the drafter's projections all become FP8, and DFlash with it stays plain greedy with nearly the same tau."""
import json
import os

import pytest
import torch

from fp8_helpers import quantize as release_quantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 130)])
def test_quantize_weight_is_the_release_quantizer(shape):
    from dflash_trt.modeling.fp8 import quantize_weight

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, :7] = 0.0  # a block with zeros keeps them
    q, s = quantize_weight(w.bfloat16())
    want_q, want_s = release_quantize(w.bfloat16().float())
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and q.shape == w.shape
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.skipif(not os.path.isfile(os.path.join(MODELS, "drafter", "config.json")), reason="no trained pair")
def test_fp8_drafter_keeps_greedy_tokens_and_tau():
    from dflash_trt import load_runtime
    from dflash_trt.modeling.fp8 import Fp8Linear, quantize_projections

    rt, codec = load_runtime(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"))
    with open(os.path.join(ROOT, "tests", "prompts_heldout.txt")) as f:
        prompts = [codec.encode(json.loads(x)) for x in f if x.strip() and not x.startswith("#")][:4]
    runs = [rt.generate(p, 48, gamma=15) for p in prompts]
    plain = [rt.generate(p, 48, spec=False)[0] for p in prompts]
    names = quantize_projections(rt.backend.drafter)
    assert "fc" in names and all(isinstance(m, Fp8Linear) for m in (rt.backend.drafter.fc,
                                                                     rt.backend.drafter.layers[0].mlp.down_proj))
    fp8 = [rt.generate(p, 48, gamma=15) for p in prompts]
    assert [t for t, _ in fp8] == plain == [t for t, _ in runs]
    tau = [sum(st.new_tokens for _, st in r) / sum(st.target_steps for _, st in r) for r in (runs, fp8)]
    assert tau[0] > 2 and tau[1] > 0.95 * tau[0], tau


def test_fp8_drafter_is_refused_off_the_gpu_torch_path():
    from dflash_trt.runtime.load import UsageError, load_runtime

    with pytest.raises(UsageError, match="--drafter-fp8 quantizes the drafter of the torch backend on cuda"):
        load_runtime(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"), drafter_fp8=True)
