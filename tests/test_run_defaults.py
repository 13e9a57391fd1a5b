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
