"""What a run gets without options: on a GPU the torch backend compiles its steps and computes in the checkpoint's
own 16-bit dtype (the path the benchmarks measure); the CPU, ort and trt keep float32 and eager steps."""
import argparse
import json

import pytest

from dflash_trt.runtime.load import UsageError, default_dtype
from dflash_trt.tools.generate import add_compile_arg, compile_choice


def _checkpoint(tmp_path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("cfg, want", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "float16"}, "float16"),  # transformers 5 spelling
    ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"),  # Qwen3.5's nested text model
    ({"torch_dtype": "float32"}, "float32"),
    ({}, "float32"),
])
def test_gpu_torch_runs_take_the_checkpoint_dtype(tmp_path, cfg, want):
    d = _checkpoint(tmp_path, cfg)
    assert default_dtype(d, "torch", "cuda") == want
    assert default_dtype(d, "torch", "cuda:1") == want
    for backend, device in (("torch", "cpu"), ("ort", "cpu"), ("trt", "cuda")):
        assert default_dtype(d, backend, device) == "float32"


def _args(*argv, device="cuda", backend="torch"):
    p = argparse.ArgumentParser()
    add_compile_arg(p)
    a = p.parse_args(list(argv))
    a.device, a.backend = device, backend
    return a


def test_steps_compile_by_default_where_they_can():
    assert compile_choice(_args()) is True
    assert compile_choice(_args(device="cuda:0")) is True
    assert compile_choice(_args("--no-compile")) is False
    assert compile_choice(_args("--compile")) is True
    for device, backend in (("cpu", "torch"), ("cuda", "trt"), ("cpu", "ort")):
        assert compile_choice(_args(device=device, backend=backend)) is False
        assert compile_choice(_args("--no-compile", device=device, backend=backend)) is False
        with pytest.raises(UsageError, match="--compile compiles the torch backend's GPU steps"):
            compile_choice(_args("--compile", device=device, backend=backend))


def test_prefill_chunk_comes_from_the_model(tmp_path):
    """A large model prefills 512 rows a launch (its weight reads amortised over enough rows for the tensor cores),
    a small one 64; the CLI's pools keep that chunk when --max-seq-len / --max-seqs raise them."""
    from dflash_trt.abi import PoolSizes
    from dflash_trt.runtime.load import default_sizes
    from dflash_trt.tools.bench_dense import dense_target_config
    from dflash_trt.tools.generate import run_sizes

    large = _checkpoint(tmp_path, dense_target_config(4))  # Qwen3.5-27B's widths, hidden 5120
    assert default_sizes(large) == PoolSizes(prefill_chunk=512)
    assert default_sizes("models/target").prefill_chunk == 64  # the shipped pair: hidden 256
    raised = run_sizes(32768, 8, 512)
    assert (raised.prefill_chunk, raised.max_seq_len, raised.max_seqs) == (512, 32768, 8)
    assert run_sizes(None, None, 512) == PoolSizes(prefill_chunk=512)
    assert run_sizes(None, None) == PoolSizes()


def test_ctx_window_option_bounds_what_the_drafter_attends():
    """--ctx-window N (generate / serve / build --backend torch): the runtime's drafter keeps and attends the last N
    rows (its ctx pages sized for them), the tokens are the full-context run's; 0 is refused, not read as 'full'."""
    import argparse

    import pytest

    from dflash_trt.config import ConfigError
    from dflash_trt.tools.generate import add_args, run_sizes, runtime_of

    s = run_sizes(None, None, 64, 32)
    assert s.ctx_window == 32 and s.max_seq_len == 2048 and s.dkv_blocks >= s.max_ctx_blocks * s.max_seqs
    with pytest.raises(ConfigError, match=r"ctx_window \(--ctx-window\) must be a positive integer, got 0"):
        run_sizes(None, None, 64, 0)
    p = argparse.ArgumentParser()
    add_args(p)
    base = ["--model", "models/target", "--drafter", "models/drafter", "--prompt", "x", "--gamma", "7"]
    runs = {}
    for extra in ([], ["--ctx-window", "24"]):
        rt, codec = runtime_of(p.parse_args(base + extra))
        seen = []
        req = rt.add_request(codec.encode("def parse_args(argv):\n    "), 64, gamma=7)
        rt.scheduler.on_step = lambda rt_, r, plan, res, b: seen.append((r.seq.seq_len, r.seq.ctx.ctx_len))
        while rt.scheduler.has_work:
            rt.step()
        runs[rt.sizes.ctx_window] = (req.tokens, seen)
    assert set(runs) == {2048, 24}
    assert runs[24][0] == runs[2048][0]
    assert all(c == min(n, 24) for n, c in runs[24][1]) and max(c for _, c in runs[24][1]) == 24
    assert all(c == n for n, c in runs[2048][1])
