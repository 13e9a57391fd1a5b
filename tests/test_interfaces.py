"""Every backend, executor and device class declares every member of its protocol (runtime/interfaces.py), so a
missing member fails here rather than behind a getattr default; and the one executor choice picks by declared
capabilities."""
import types

import pytest

from dflash_trt.runtime import interfaces as I
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.ort_backend import OrtBackend
from dflash_trt.runtime.backends.torch_backend import ModuleGraphs, TorchBackend
from dflash_trt.runtime.backends.trt import EngineGraphs, TrtBackend
from dflash_trt.runtime.devices.cuda import CudaDevice
from dflash_trt.runtime.devices.host import HostDevice
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.devices.torch_device import TorchDevice
from dflash_trt.runtime.executors import choose_executor
from dflash_trt.runtime.host_step import HostStepExecutor


def members(proto) -> set:
    """The names a protocol requires: its annotated attributes and its methods, bases included."""
    out = set()
    for base in proto.__mro__:
        if base in (object, I.Protocol) or base.__module__ != I.__name__:
            continue
        out |= set(vars(base).get("__annotations__", {}))
        out |= {k for k, v in vars(base).items() if callable(v) and not k.startswith("_")}
    return out


def declared(cls, name: str) -> bool:
    """A class attribute / method, or an annotation set per instance (kv_dtype, device)."""
    return hasattr(cls, name) or any(name in vars(b).get("__annotations__", {}) for b in cls.__mro__)


@pytest.mark.parametrize("proto, classes", [
    (I.Backend, [TorchBackend, OrtBackend, TrtBackend]),
    (I.Executor, [HostStepExecutor, GraphStepExecutor]),
    (I.Device, [HostDevice, TorchDevice, TorchCpuDevice, CudaDevice]),
    (I.StepDevice, [TorchCpuDevice, CudaDevice]),
    (I.StepGraphs, [ModuleGraphs, EngineGraphs]),
])
def test_every_class_declares_its_protocol(proto, classes):
    need = members(proto)
    assert need, proto
    for cls in classes:
        missing = sorted(n for n in need if not declared(cls, n))
        assert not missing, f"{cls.__name__} lacks {missing} of {proto.__name__}"


def test_protocol_members_are_the_contract():
    """The members the runtime and the scheduler read (a rename here must be a rename everywhere)."""
    assert {"runs_ahead", "max_inflight", "launch", "launch_prefill", "collect", "landed", "settle", "quiesce",
            "zero_slot", "adopt"} <= members(I.Executor)
    assert {"name", "kv_dtype", "want_logits", "concurrent_prefill", "any_prefill_width", "fused_steps",
            "run", "step_widths"} <= members(I.Backend)
    assert {"graph_steps", "on_stream", "zero_slot", "kv_write"} <= members(I.Device)
    assert HostStepExecutor.runs_ahead is False and GraphStepExecutor.runs_ahead is True


def test_a_class_missing_a_member_is_caught():
    class Partial(I.BackendDefaults):
        kv_dtype = "float32"

    assert not declared(Partial, "run")  # what the parametrized test would report
    assert isinstance(TorchCpuDevice(), I.StepDevice) and isinstance(HostDevice(), I.Device)


@pytest.mark.parametrize("graph_steps, fused, want", [
    (False, None, HostStepExecutor), (False, object(), HostStepExecutor), (True, None, HostStepExecutor),
    (True, object(), GraphStepExecutor)])
def test_choose_executor_by_declared_capabilities(monkeypatch, graph_steps, fused, want):
    made = []
    monkeypatch.setattr(GraphStepExecutor, "__init__", lambda self, rt, inflight=1: made.append(inflight))
    rt = types.SimpleNamespace(device=types.SimpleNamespace(graph_steps=graph_steps, on_stream=None),
                               backend=types.SimpleNamespace(fused_steps=fused))
    ex = choose_executor(rt)
    assert type(ex) is want
    assert made == ([1] if want is GraphStepExecutor else [])


def test_make_backend_is_one_registry():
    from dflash_trt.runtime.backends import BACKEND_FACTORIES, BACKENDS, make_backend

    assert BACKENDS == ("torch", "ort", "trt") and set(BACKEND_FACTORIES) == set(BACKENDS)
    with pytest.raises(ValueError, match=r"unknown backend 'onnx' \(available: torch, ort, trt\)"):
        make_backend("onnx")
