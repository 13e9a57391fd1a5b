"""The MoE launchers (plugins/moe/launch.py) pass each kernel the arguments its entry declares: with the launch
stubbed, every call's argument kinds (pointers, ints) equal the parameter list NVRTC compiled for that entry (PTX
for compute_90), for every path (grouped, decode, FP8, a fused shared expert, the router). A wrong count or order
would otherwise only show on a GPU, as garbage."""
import re

import pytest

from dflash_trt.plugins import cuda_launch, nvrtc
from dflash_trt.plugins.moe import launch

KIND = {cuda_launch.P: ".u64", cuda_launch.I: ".u32", cuda_launch.F: ".f32"}
DIMS = dict(E=256, H=2048, I=512)


@pytest.fixture(scope="module")
def entries():
    """{entry name: [param type, ...]} of the moe module's PTX."""
    ptx = nvrtc.compile_source("moe", "compute_90").decode()
    return {m.group(1): re.findall(r"\.param\s+(\.\w+)", m.group(2))
            for m in re.finditer(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)}


@pytest.fixture
def calls(monkeypatch):
    got = []
    monkeypatch.setattr(launch, "get_function", lambda family, name: name)
    monkeypatch.setattr(launch, "launch", lambda fn, grid, block, smem, stream, args: got.append((fn, args)))
    return got


def _check(calls, entries):
    assert calls
    for name, args in calls:
        assert [KIND[kind] for _, kind in args] == entries[name], name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_decode_path(entries, calls, dtype, fp8, shared):
    scales = (11, 12) if fp8 else None
    sh = ((21, 22, 23, 5) + ((31, 32) if fp8 else ())) if shared else None
    launch.moe_experts_decode(1, 2, 3, 4, 5, 6, 7, N=2, k=8, **DIMS, dtype=dtype, w_dtype=dtype, scales=scales,
                              shared=sh)
    _check(calls, entries)
    gate_up, down = (args for _, args in calls)
    assert [v for v, _ in gate_up][-1 - fp8] == (21 if shared else 0)  # the shared gate_up after h
    assert [v for v, _ in down][-2:] == ([23, 5] if shared else [0, 0])  # its gate logit and row stride last


@pytest.mark.parametrize("dtype,fp8", [("bfloat16", False), ("float16", False), ("float32", False),
                                       ("bfloat16", True), ("float16", True)])
def test_grouped_path(entries, calls, dtype, fp8):
    launch.moe_experts(1, 2, 3, 4, 5, 6, 7, 8, 9, N=16, k=8, **DIMS, dtype=dtype, w_dtype=dtype,
                       scales=(11, 12) if fp8 else None)
    _check(calls, entries)
    assert [name for name, _ in calls][0] == "moe_plan" and calls[-1][0] == "moe_combine"


def test_router(entries, calls):
    launch.moe_route(1, 2, 3, N=4, E=256, k=8, norm=True, l_dtype="bfloat16", w_dtype="bfloat16")
    _check(calls, entries)
