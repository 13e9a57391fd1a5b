"""Programmatic dependent launch (cuda_launch.launch(pdl=True), common.cuh pdl_wait).

A kernel launched with pdl=True may start while the kernel before it still runs; it must read nothing an earlier
kernel writes before its pdl_wait() (gemv loads its first weights before it). The chain below feeds each gemv the
previous kernel's output at once (gemv -> gemv, gemv -> torch kernel -> gemv), eager and in a CUDA graph whose
outputs are pre-filled with stale values, and compares it bit for bit with the same chain launched without PDL.
The whole-step check is tests/test_gpu_compiled_steps.py and the GPU runtime tests, which run with PDL on.
CPU: the switch."""
import os

import pytest
import torch

from dflash_trt.plugins import cuda_launch


def test_pdl_switch_off_by_env_or_before_sm90(monkeypatch):
    monkeypatch.setattr(cuda_launch, "_pdl", {})
    monkeypatch.setattr(cuda_launch, "_context", lambda: 1)
    monkeypatch.setattr(cuda_launch, "device_arch", lambda: (9, 0))
    monkeypatch.setenv("DFLASH_TRT_PDL", "0")
    assert not cuda_launch.pdl_enabled()
    monkeypatch.setattr(cuda_launch, "_pdl", {})
    monkeypatch.delenv("DFLASH_TRT_PDL")
    assert cuda_launch.pdl_enabled()
    monkeypatch.setattr(cuda_launch, "_pdl", {})
    monkeypatch.setattr(cuda_launch, "device_arch", lambda: (8, 6))  # no griddepcontrol before sm_90
    assert not cuda_launch.pdl_enabled()


def _chain(ws, x0):
    """x -> gemv -> gemv -> a torch kernel -> gemv -> gemv -> ...: each link reads the previous kernel's output."""
    outs, x = [], x0
    for i, w in enumerate(ws):
        y = torch.ops.dflash.gemv(x, w)
        outs.append(y)
        x = y if i % 2 == 0 else (y * 0.5 + 0.25)
    return outs


def _run(pdl_on: bool, graph: bool, ws, x0):
    cuda_launch._pdl.clear()
    old = os.environ.get("DFLASH_TRT_PDL")
    os.environ["DFLASH_TRT_PDL"] = "1" if pdl_on else "0"
    try:
        assert cuda_launch.pdl_enabled() == (pdl_on and torch.cuda.get_device_capability() >= (9, 0))
        if not graph:
            outs = _chain(ws, x0)
            torch.cuda.synchronize()
            return [o.clone() for o in outs]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _chain(ws, x0)  # warm-up: kernels loaded before the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = _chain(ws, x0)
        for o in outs:
            o.fill_(7.0)  # stale values a too-early read would pick up
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        return [o.clone() for o in outs]
    finally:
        cuda_launch._pdl.clear()
        if old is None:
            os.environ.pop("DFLASH_TRT_PDL", None)
        else:
            os.environ["DFLASH_TRT_PDL"] = old


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gemv_chain_with_pdl_equals_without(graph):
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::gemv)

    g = torch.Generator(device="cuda").manual_seed(0)
    D = 2048  # square: each gemv's output is the next one's input; 128 tiles, one persistent pass per CTA
    ws = [(torch.randn(D, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16) for _ in range(12)]
    x0 = torch.randn(1, D, device="cuda", generator=g).to(torch.bfloat16)
    off, on = _run(False, graph, ws, x0), _run(True, graph, ws, x0)
    for i, (a, b) in enumerate(zip(off, on)):
        assert torch.equal(a, b), f"link {i}: PDL changed the result (max diff {(a.float() - b.float()).abs().max()})"
    ref = x0.double()
    for i, w in enumerate(ws):  # and the chain is the math, not stale 7s
        ref = ref @ w.double().T
        assert torch.allclose(on[i].double(), ref, rtol=0.05, atol=0.05), f"link {i} is not x @ w.T"
        ref = on[i].double() if i % 2 == 0 else on[i].double() * 0.5 + 0.25
