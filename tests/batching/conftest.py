"""The batch tests' tiny pair (module-scoped) and each of its prompts generated alone: the reference tokens."""
import numpy as np
import pytest
import torch
from batch_helpers import N_NEW, SIZES, dense_ctx_rows

from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import make_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    tdir, ddir = make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3)
    target = load_target(tdir)
    drafter = load_drafter(ddir, target)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 250, n)) for n in (23, 5, 17, 40, 11)]
    return target, drafter, prompts


@pytest.fixture(scope="module")
def alone(pair):
    """Each prompt generated alone on the host path: the reference tokens, and the dense ctx rows."""
    target, drafter, prompts = pair
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES)
    toks = [rt.generate(p, max(N_NEW), spec=False)[0] for p in prompts]
    rows = {tuple(p): dense_ctx_rows(target, drafter, list(p) + t) for p, t in zip(prompts, toks)}
    return toks, rows
