"""Shared helpers for the ONNX / ORT / compare tests (no tests here): the tiny pair, its export, oracle drafter.

The export is cached by ensure_export (checkpoint hashes + sizes + exporter source) under
$DFLASH_TRT_TEST_CACHE or <tmp>/dflash_trt_test_cache, so the test files share one export per source state.
"""
import os
import tempfile

import numpy as np
import pytest

from dflash_trt.abi import DRAFTER_BLOCK, PoolSizes
from dflash_trt.runtime.interfaces import BackendDefaults

# small pools so the gather-all-pages function bodies stay fast; ctx_window 32 makes the drafter window slide
SIZES = PoolSizes(kv_blocks=32, page_size=16, max_seq_len=256, max_seqs=4, dkv_blocks=64, ctx_window=32,
                  prefill_chunk=32)
KS = (1, 2, 4, 16)  # γ ∈ {1, 3, 15} -> K = γ+1
CACHE = os.environ.get("DFLASH_TRT_TEST_CACHE", os.path.join(tempfile.gettempdir(), "dflash_trt_test_cache"))
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib"  # 2 prefill chunks


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from dflash_trt.tools.tiny import make_tiny_pair

    return make_tiny_pair(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="session")
def exported(tiny_pair):
    """Manifest directory of the tiny pair's export (K 1,2,4,16, dynamic batch, logits)."""
    pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True) needs it
    from dflash_trt.export.onnx_export import ensure_export

    return ensure_export(*tiny_pair, KS, SIZES, cache_dir=CACHE, progress=None)


def torch_backend(tiny_pair, want_logits=True):
    import torch

    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    target = load_target(tiny_pair[0], torch.float32)
    return TorchBackend(target, load_drafter(tiny_pair[1], target), want_logits=want_logits)


class OracleDrafter(BackendDefaults):
    """Wraps a backend; answers drafter_block with the known greedy continuation (all drafts accepted)."""

    def __init__(self, backend, tokens):
        self.backend, self.tokens = backend, list(tokens)
        self.name, self.kv_dtype = "oracle+" + backend.name, backend.kv_dtype

    def run(self, graph, inputs):
        if not graph.startswith(DRAFTER_BLOCK):  # drafter_block or drafter_block_b{γ+1}
            return self.backend.run(graph, inputs)
        Bs = inputs["block_ids"].shape[1]
        start = inputs["positions"][:, 0]  # position of the bonus token
        t = self.tokens
        return {"drafts": np.array([[t[p + 1 + j] if p + 1 + j < len(t) else 0 for j in range(Bs - 1)]
                                    for p in start], dtype=np.int64)}
