"""The torch-pool Device (the GPU path's commit through dflash:: ops) gives the same tokens as the host
twin; on a GPU the whole spec loop runs on our CUDA kernels and matches the CPU tokens."""

import numpy as np
import pytest
import torch

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.torch_device import TorchDevice
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import KERNEL_SHAPES, make_tiny_pair

SIZES = PoolSizes(kv_blocks=64, page_size=4, max_seq_len=256, max_seqs=2, dkv_blocks=64, ctx_window=12,
                  prefill_chunk=16)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("p")), seed=5)


def load(dirs, dtype=torch.float32, device="cpu"):
    t = load_target(dirs[0], dtype).to(device)
    d = load_drafter(dirs[1], t, dtype).to(device)
    return t, d


def generate(t, d, device_obj, prompt, spec, gamma=3):
    rt = Runtime(TorchBackend(t, d), t.cfg, d.cfg, SIZES, device=device_obj)
    out, st = rt.generate(prompt, 48, gamma=gamma, spec=spec)
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total
    return out, st


PROMPT = list(np.random.default_rng(1).integers(0, 250, 21))


def test_torch_device_matches_host_device(dirs):
    t, d = load(dirs)
    ref, _ = generate(t, d, None, PROMPT, spec=False)
    for spec in (False, True):
        out, _ = generate(t, d, TorchDevice("cpu"), PROMPT, spec)
        assert out == ref


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("k")), seed=5, **KERNEL_SHAPES)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma", [1, 3, 15])
def test_gpu_spec_path_matches_cpu_greedy(kernel_dirs, gamma):
    """fp32 on the GPU (our kernels for GDN/conv/attention/commit) vs the CPU reference, token-identical."""
    dirs = kernel_dirs
    t, d = load(dirs)
    ref, _ = generate(t, d, None, PROMPT, spec=False)
    tg, dg = load(dirs, torch.float32, "cuda")
    plain, _ = generate(tg, dg, TorchDevice("cuda"), PROMPT, spec=False)
    spec, _ = generate(tg, dg, TorchDevice("cuda"), PROMPT, spec=True, gamma=gamma)
    assert plain == ref and spec == ref
