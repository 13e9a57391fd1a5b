"""Pools sized from a byte budget (runtime/memory.py, `--gpu-memory-utilization`): the pools fit the budget and
one more page pair would not, a budget short of one full-length sequence is one line naming what it needs, and the
27B shape at 262,144 positions fits an H200-sized budget."""
import numpy as np
import pytest

from dflash_trt.abi import MAX_K, PoolSizes, pool_specs
from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig
from dflash_trt.runtime.memory import activation_headroom, gpu_budget, pools_from_budget, sized_for_gpu
from dflash_trt.tools.bench_dense import dense_drafter_config, dense_target_config
from dflash_trt.tools.generate import run_sizes

GiB = 1 << 30


def pool_bytes(t, d, s, kv_dtype):
    size = {"float32": 4, "bfloat16": 2}
    return sum(int(np.prod(shape)) * size[dt] for shape, dt in pool_specs(t, d, s, kv_dtype).values())


@pytest.fixture(scope="module")
def shape27b():
    t = TargetConfig.from_dict(dense_target_config(64))
    return t, DrafterConfig.from_dict(dense_drafter_config(64))


def test_pools_fill_the_budget_and_no_more(shape27b):
    t, d = shape27b
    for budget in (12 * GiB, 20 * GiB + 12345):
        s = pools_from_budget(t, d, budget, max_seq_len=32768, max_seqs=8, kv_dtype="bfloat16")
        used = pool_bytes(t, d, s, "bfloat16")
        assert used <= budget
        more = PoolSizes(kv_blocks=s.kv_blocks + 1, dkv_blocks=s.dkv_blocks + 1, max_seq_len=32768, max_seqs=8)
        assert pool_bytes(t, d, more, "bfloat16") > budget
        assert s.dkv_blocks - s.kv_blocks == 8 * (s.max_ctx_blocks - s.max_blocks)  # the drafter tables' slack
        assert s.kv_blocks >= s.max_blocks  # at least one full-length sequence


def test_pages_capped_at_what_the_sequences_can_use(shape27b):
    t, d = shape27b
    s = pools_from_budget(t, d, 500 * GiB, max_seq_len=4096, max_seqs=2, kv_dtype="bfloat16")
    assert s.kv_blocks == 2 * s.max_blocks
    s = pools_from_budget(t, None, 500 * GiB, max_seq_len=4096, max_seqs=2, kv_dtype="float32")
    assert (s.kv_blocks, s.dkv_blocks) == (2 * s.max_blocks, 1)


def test_262144_positions_of_the_27b_shape_fit_an_h200(shape27b):
    """bf16 weights of the 27B shape ~54 GB on a 141 GB H200 at utilization 0.9: a 262,144-row sequence fits."""
    t, d = shape27b
    total, weights = 141 * 10**9, 54 * 10**9
    s = sized_for_gpu(t, d, PoolSizes(max_seq_len=262144, max_seqs=1, prefill_chunk=512), 0.9, total - weights,
                      total, "bfloat16")
    assert s.kv_blocks * s.page_size >= 262144 and s.ctx_window == 262144
    assert pool_bytes(t, d, s, "bfloat16") <= 0.9 * total - weights - activation_headroom(t, 512)


def test_shortfall_and_bad_fraction_are_one_line(shape27b):
    t, d = shape27b
    with pytest.raises(ConfigError, match=r"one sequence of max_seq_len 262144 need .* GiB .* only 1\.00 GiB are free"
                                          r".*--gpu-memory-utilization"):
        pools_from_budget(t, d, GiB, max_seq_len=262144, max_seqs=1, kv_dtype="bfloat16")
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="--gpu-memory-utilization must be in"):
            gpu_budget(bad, GiB, 2 * GiB, 0)


def test_run_sizes_grow_both_kv_pools():
    s = run_sizes(65536, 2)
    assert s.kv_blocks >= 2 * s.max_blocks and s.dkv_blocks >= 2 * s.max_ctx_blocks and s.ctx_window == 65536
    assert run_sizes(None) == PoolSizes()
    with pytest.raises(ConfigError, match="max_seq_len"):
        run_sizes(0)
    with pytest.raises(ConfigError, match="max_seqs"):
        run_sizes(None, 0)


def test_utilization_is_refused_off_the_torch_gpu_path():
    from dflash_trt.runtime.load import UsageError, load_runtime

    for backend in ("torch", "ort"):
        with pytest.raises(UsageError, match="--gpu-memory-utilization sizes the pools of the torch backend on cuda"):
            load_runtime("models/target", "models/drafter", backend, gpu_memory_utilization=0.9)


def test_full_context_drafter_costs_one_sequence_of_pages_per_slot(shape27b):
    """A full-context drafter window never slides, so each slot's ctx table reserves an append beyond the target's,
    not a second sequence: 16 slots of Qwen3.5's 262,144 rows fit a 60 GiB pool budget."""
    t, d = shape27b
    s = pools_from_budget(t, d, 60 * GiB, max_seq_len=262144, max_seqs=16, kv_dtype="bfloat16", prefill_chunk=512)
    assert s.kv_blocks >= 2 * s.max_blocks
    assert s.dkv_blocks - s.kv_blocks == 16 * -(-(512 + MAX_K) // 16)
