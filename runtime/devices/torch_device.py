"""TorchDevice: the Device seam with pools as torch tensors (CPU or CUDA).

Same interface as runtime.devices.host.HostDevice. The commit kernels are the `dflash::` torch ops
(plugins/torch_ops.py): our NVRTC CUDA kernels on a GPU, the reference math on CPU — so the GPU
path's commit is the code TensorRT deployments use, and the CPU run of this class tests the wiring.
Pools are [L, ...] and contiguous; each commit is one op (one kernel launch) over all layers, in place. The commit
methods come from the op folders (plugins/<op>/device.py, through the op registry).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from dflash_trt.plugins import torch_ops  # noqa: F401  (registers torch.ops.dflash.*)
from dflash_trt.plugins.registry import install_methods

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchDevice:
    name: str  # "torch:<device>"
    device: torch.device
    graph_steps = False  # the host executor's device: graphs run eagerly, one launch each

    def __init__(self, device: str = "cuda"):
        self.device = torch.device(device)
        self.name = f"torch:{self.device}"

    def _t(self, a, dtype=None):
        t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(a))
        return t.to(self.device, dtype) if dtype is not None else t.to(self.device)

    def _i(self, a):
        return self._t(a, torch.int32)

    def on_stream(self):
        """torch's current stream: no stream of its own."""
        return contextlib.nullcontext()

    def zero_slot(self, pool, slot: int) -> None:
        """pool[:, slot] = 0 (a fresh sequence's GDN / conv state)."""
        pool[:, int(slot)] = 0

    # ---- memory -----------------------------------------------------------------------
    def zeros(self, shape, dtype="float32"):
        return torch.zeros(shape, dtype=_DTYPES[str(dtype)], device=self.device)

    def pad_rows(self, x, rows: int):
        x = self._t(x)
        out = x.new_zeros((x.shape[0], rows) + tuple(x.shape[2:]))
        out[:, : x.shape[1]] = x
        return out

    def to_host(self, a) -> np.ndarray:
        return a.detach().float().cpu().numpy() if isinstance(a, torch.Tensor) else np.array(a)

    def from_host(self, a):
        return self._t(a)

    def gather_rows(self, pool, block_table_row, start, count) -> np.ndarray:
        bs = pool.shape[3]
        rows = np.arange(start, start + count)
        pages = np.asarray(block_table_row)[rows // bs]
        return self.to_host(pool[:, :, torch.as_tensor(pages), torch.as_tensor(rows % bs)])


install_methods(TorchDevice, "device_ops")  # the commit kernels: plugins/<op>/device.py
