"""TorchCpuDevice: torch-tensor pools on the CPU with the step-IO interface of CudaDevice, so the GPU step
executor (runtime/backends/graph_executor.py) runs its whole logic eagerly on CPU — staging buffers,
device-side accept, per-slot state, steps kept in flight — without a GPU. No streams, no graphs.

`TorchStepIO` is the part both torch-pool devices share: the commit pieces the TorchDevice base lacks in a
capturable (sync-free) form.
"""
from __future__ import annotations

import numpy as np
import torch

from dflash_trt.runtime.devices.torch_device import TorchDevice


class TorchStepIO:
    def gdn_set(self, pool, slots, state, n) -> None:
        """pool[:, slot[b]] <- state[:, b] where n[b] > 0, with no host sync (prefill commits in a graph). Every row
        writes, so a slot that several rows name (a batched prefill's padding rows share slot 0 with whichever
        sequence holds it) must get the same value from all of them: each row writes the state of the row with
        n > 0 that names its slot (live slots are distinct), or what the slot holds when there is none."""
        sl = self._t(slots, torch.int64).reshape(-1)
        keep = self._t(n).reshape(-1) > 0
        owner = (sl[:, None] == sl[None, :]) & keep[None, :]  # [row, row]: which kept row names my slot
        src = self._t(state).to(pool.dtype)[:, owner.to(torch.int64).argmax(1)]
        pool[:, sl] = torch.where(owner.any(1).view((1, -1) + (1,) * (pool.dim() - 2)), src, pool[:, sl])

    def zero_slot(self, pool, slot: int) -> None:
        with self.on_stream():
            pool[:, int(slot)] = 0

    def device_buffer(self, numel: int):
        return torch.zeros(int(numel), dtype=torch.int64, device=self.device)


class TorchCpuDevice(TorchStepIO, TorchDevice):
    graph_steps = False  # steps run eagerly
    stream_handle = 0  # no stream: stand-in engines ignore it

    def __init__(self):
        super().__init__("cpu")

    def staging(self, numel: int) -> np.ndarray:
        return np.zeros(int(numel), dtype=np.int64)

    def h2d(self, dst, src: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(src))

    def d2h(self, dst: np.ndarray, src) -> None:
        dst[:] = src.reshape(-1).numpy()

    def new_event(self, timing: bool = False):
        return None

    def record(self, event) -> None:
        pass

    def wait(self, event) -> None:
        pass

    def done(self, event) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def side_stream(self) -> "TorchCpuDevice":
        return self  # one (host) order: nothing runs beside anything

    def stream_wait(self, event) -> None:
        pass

    def sync_all(self) -> None:
        pass

    def capture(self, fn, hook=None):
        return None
