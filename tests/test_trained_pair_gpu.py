"""The shipped trained pair on the GPU path (torch + our CUDA kernels + TorchDevice commit): DFlash
tokens equal the CPU reference's plain greedy tokens on held-out prompts."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not os.path.isfile(os.path.join(MODELS, "drafter", "config.json")), reason="no trained pair in models/")]


def test_gpu_dflash_tokens_equal_cpu_greedy():
    import torch

    from dflash_trt.abi import PoolSizes
    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.devices.torch_device import TorchDevice
    from dflash_trt.runtime.runtime import Runtime
    from dflash_trt import load_runtime

    sizes = PoolSizes(max_seq_len=512, kv_blocks=64, dkv_blocks=96)
    cpu, codec = load_runtime(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"), "torch", sizes)
    t = load_target(os.path.join(MODELS, "target"), torch.float32).cuda()
    d = load_drafter(os.path.join(MODELS, "drafter"), t, torch.float32).cuda()
    gpu = Runtime(TorchBackend(t, d), t.cfg, d.cfg, sizes, device=TorchDevice("cuda"))
    prompts = [json.loads(x) for x in open(os.path.join(ROOT, "tests", "prompts_heldout.txt"))
               if x.strip() and not x.startswith("#")][:6]
    taus = []
    for p in prompts:
        ids = codec.encode(p)
        ref, _ = cpu.generate(ids, 48, spec=False)
        got, st = gpu.generate(ids, 48, gamma=15)
        assert got == ref, p
        taus.append(st.tau)
    print(f"GPU dflash == CPU greedy on {len(prompts)} prompts; tau {[round(x, 2) for x in taus]}")
