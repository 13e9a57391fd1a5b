"""Pools sized from a byte budget: how many KV pages a GPU's memory holds once the weights are loaded.

The state slots (GDN + conv, one per sequence) are fixed by max_seqs; the rest of the budget becomes KV pages.
Target and drafter pages are bought in pairs: every committed row takes one target KV row and one drafter ctx row,
so the two pools fill at the same rate, and the drafter's block tables need a little slack per slot on top (a
window, one append and one step in flight: PoolSizes.max_ctx_blocks). Pages beyond what max_seqs sequences of
max_seq_len rows can use are not bought.
"""
from __future__ import annotations

import numpy as np

from dflash_trt.abi import PoolSizes, pool_specs
from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig

# Activation headroom kept free beside the pools: the widest step's live tensors (a prefill chunk through one
# layer, its logits rows) are a few hundred MiB at the 27B shape; CUDA graphs and the allocator's slack take the
# rest. A fixed floor because Inductor's and cuBLAS's workspaces do not scale with the model.
HEADROOM_FLOOR = 1 << 30


def _nbytes(shape, dtype: str) -> int:
    return int(np.prod(shape)) * np.dtype("float32" if dtype == "float32" else "float16").itemsize


def activation_headroom(t: TargetConfig, rows: int) -> int:
    """Bytes kept free for a step of `rows` rows: hidden, MLP and projection activations in fp32 twice over
    (inputs and outputs of a layer live at once) plus the rows' fp32 logits."""
    per_row = 4 * (2 * (4 * t.hidden_size + 3 * t.intermediate_size) + t.vocab_size)
    return HEADROOM_FLOOR + rows * per_row


def pools_from_budget(t: TargetConfig, d: DrafterConfig | None, budget: int, *, max_seq_len: int, max_seqs: int,
                      kv_dtype: str, page_size: int = 16, prefill_chunk: int = 64, ctx_window: int = 0) -> PoolSizes:
    """The PoolSizes whose pools fit in `budget` bytes with as many KV pages as fit (at most what max_seqs
    sequences of max_seq_len rows use). ConfigError naming the shortfall if not even one full-length sequence fits."""
    base = PoolSizes(kv_blocks=1, dkv_blocks=1, page_size=page_size, max_seq_len=max_seq_len, max_seqs=max_seqs,
                     prefill_chunk=prefill_chunk, ctx_window=ctx_window)
    specs = pool_specs(t, d, base, kv_dtype)
    fixed = _nbytes(*specs["gdn_pool"]) + _nbytes(*specs["conv_pool"])
    kv_page = _nbytes(*specs["kv_pool"])  # kv_blocks=1: one page's bytes
    dkv_page = _nbytes(*specs["dkv_pool"]) if d is not None else 0
    slack = base.drafter_slack_blocks if d is not None else 0
    pages = (budget - fixed - slack * dkv_page) // (kv_page + dkv_page)
    one_seq = base.max_blocks
    if pages < one_seq:
        need = fixed + slack * dkv_page + one_seq * (kv_page + dkv_page)
        raise ConfigError(f"the pools for one sequence of max_seq_len {max_seq_len} need {need / 2**30:.2f} GiB "
                          f"(KV pages {one_seq} x {(kv_page + dkv_page) / 2**20:.2f} MiB with the drafter's, state "
                          f"slots {fixed / 2**20:.1f} MiB), but only {max(budget, 0) / 2**30:.2f} GiB are free for "
                          "them: lower --max-seq-len / --max-seqs or raise --gpu-memory-utilization")
    pages = int(min(pages, max_seqs * one_seq))
    return PoolSizes(kv_blocks=pages, dkv_blocks=pages + slack if d is not None else 1, page_size=page_size,
                     max_seq_len=max_seq_len, max_seqs=max_seqs, prefill_chunk=prefill_chunk,
                     ctx_window=base.ctx_window)


def gpu_budget(utilization: float, free: int, total: int, headroom: int) -> int:
    """Bytes the pools may take: utilization of the GPU's total memory, less what is already in use (weights,
    other processes) and the activation headroom."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}")
    return int(utilization * total) - (total - free) - headroom


def sized_for_gpu(t: TargetConfig, d: DrafterConfig | None, shape: PoolSizes, utilization: float, free: int,
                  total: int, kv_dtype: str) -> PoolSizes:
    """`shape` (max_seq_len, max_seqs, page size, prefill chunk, ctx window) with its KV pages chosen to fill
    `utilization` of a GPU that has `free` of `total` bytes free now (weights loaded)."""
    rows = max(shape.prefill_chunk, shape.max_seqs * 16)  # the widest step: a prefill chunk or a full verify batch
    budget = gpu_budget(utilization, free, total, activation_headroom(t, rows))
    return pools_from_budget(t, d, budget, max_seq_len=shape.max_seq_len, max_seqs=shape.max_seqs, kv_dtype=kv_dtype,
                             page_size=shape.page_size, prefill_chunk=shape.prefill_chunk,
                             ctx_window=shape.ctx_window)
