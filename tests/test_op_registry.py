"""The op registry: every op folder is listed once, and the shared tables (ONNX functions, TensorRT plugins, the
models' seam, the devices' commit methods) are exactly what the bundles declare."""
import os
import sys
import types

import pytest

from dflash_trt.plugins import registry
from dflash_trt.plugins.opspec import OpBundle

PLUGINS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins")


def test_every_kernel_folder_is_registered_once():
    with_kernel = {d for d in os.listdir(PLUGINS_DIR) if os.path.exists(os.path.join(PLUGINS_DIR, d, "kernel.cu"))}
    assert len(registry.OP_FOLDERS) == len(set(registry.OP_FOLDERS))
    assert set(registry.OP_FOLDERS) == with_kernel
    assert [b.folder for b in registry.bundles()] == list(registry.OP_FOLDERS)


def test_tables_follow_the_bundles():
    from dflash_trt.plugins import nvrtc, onnx_functions, ops, trt_plugins

    names = [b.spec.name for b in registry.onnx_bundles()]
    assert names == ["GdnChunkWY16", "CausalConvVerify", "PagedAttention", "MoeExperts"]
    assert list(onnx_functions.SPECS) == names == list(trt_plugins.PLUGINS)
    assert list(nvrtc.SPECS) == list(registry.OP_FOLDERS)
    assert ops.__all__ == ["conv_verify", "gdn_chunk", "gdn_decode_commit", "moe_experts", "paged_attention"]


def test_host_and_torch_devices_have_the_same_commit_methods():
    from dflash_trt.runtime.devices.host import HostDevice
    from dflash_trt.runtime.devices.torch_device import TorchDevice

    for b in registry.bundles():
        assert [r.rpartition(":")[2] for r in b.host_twins] == [r.rpartition(":")[2] for r in b.device_ops]
    commit = {"kv_write", "gdn_fold", "gdn_set", "conv_roll"}
    assert all(callable(getattr(HostDevice, m)) and callable(getattr(TorchDevice, m)) for m in commit)


def test_a_new_folder_is_one_line(monkeypatch):
    """A bundle registered by its folder name alone reaches the seam and the host device."""
    from dflash_trt.plugins.gemv.spec import SPEC

    pkg = types.ModuleType("dflash_trt.plugins.toy")
    twin = types.ModuleType("dflash_trt.plugins.toy.host")
    twin.toy_write = lambda pool, n: pool.append(n)
    pkg.BUNDLE = OpBundle("toy", SPEC, host_twins=("host:toy_write",))
    monkeypatch.setitem(sys.modules, pkg.__name__, pkg)
    monkeypatch.setitem(sys.modules, twin.__name__, twin)
    monkeypatch.setattr(registry, "OP_FOLDERS", registry.OP_FOLDERS + ("toy",))

    class Dev:
        pass

    registry.install_methods(Dev, "host_twins", static=True)
    pool = []
    Dev().toy_write(pool, 3)
    assert pool == [3] and hasattr(Dev, "kv_write")

    class Taken:
        def toy_write(self):
            pass

    with pytest.raises(RuntimeError, match="toy names host_twins 'toy_write', which Taken already has"):
        registry.install_methods(Taken, "host_twins", static=True)
