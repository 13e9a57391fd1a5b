"""TorchDevice: the Device seam with pools as torch tensors (CPU or CUDA).

Same interface as runtime.devices.host.HostDevice. The commit kernels are the `dflash::` torch ops
(plugins/torch_ops.py): our NVRTC CUDA kernels on a GPU, the reference math on CPU — so the GPU
path's commit is the code TensorRT deployments use, and the CPU run of this class tests the wiring.
Pools are [L, ...] and contiguous; each commit is one op (one kernel launch) over all layers, in place.
"""
from __future__ import annotations

import numpy as np
import torch

from dflash_trt.plugins import torch_ops  # noqa: F401  (registers torch.ops.dflash.*)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchDevice:
    def __init__(self, device: str = "cuda"):
        self.device = torch.device(device)
        self.name = f"torch:{self.device}"

    def _t(self, a, dtype=None):
        t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(a))
        return t.to(self.device, dtype) if dtype is not None else t.to(self.device)

    def _i(self, a):
        return self._t(a, torch.int32)

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

    # ---- commit kernels (in place) --------------------------------------------------------
    def kv_write(self, pool, rows, block_table, start_row, n) -> None:
        """pool [L,2,blocks,bs,H,hd]; rows [L,2,B,T,H,hd]; row i -> logical row start_row[b]+i (all layers, one op)."""
        bt, pos, n = self._i(block_table), self._i(start_row), self._i(n)
        torch.ops.dflash.kv_write(pool, self._t(rows), bt, pos, n)

    def gdn_fold(self, pool, slots, k_hat, v, g, beta, n) -> None:
        """pool [L,slots,Hv,dk,dv]; fold data [L,B,T,...]; folds the first n[b] rows into slot[b] (all layers, one op)."""
        slots, n = self._i(slots), self._i(n)
        k_hat, v, g, beta = (self._t(x, torch.float32) for x in (k_hat, v, g, beta))
        torch.ops.dflash.gdn_fold(pool, slots, k_hat, v, g, beta, n)

    def gdn_set(self, pool, slots, state, n) -> None:
        keep = np.nonzero(np.asarray(self.to_host(n)).reshape(-1) > 0)[0]
        if keep.size:
            sl = torch.as_tensor(np.asarray(self.to_host(slots)).reshape(-1)[keep], device=self.device)
            pool[:, sl] = self._t(state)[:, torch.as_tensor(keep, device=self.device)].to(pool.dtype)

    def conv_roll(self, pool, slots, cols, n) -> None:
        """pool [L,slots,C,W-1]; cols [L,B,T,C] (all layers, one op)."""
        torch.ops.dflash.conv_roll(pool, self._i(slots), self._t(cols), self._i(n))
