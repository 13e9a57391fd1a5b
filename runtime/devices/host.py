"""The Device seam: allocation, host transfer and the commit kernels.

`HostDevice` is the numpy twin of the GPU devices (`TorchDevice`): same interface, so all runtime logic is
tested on CPU. The commit kernels are the numpy twins of the op folders (plugins/<op>/host.py, attached from
the op registry); every commit kernel mutates a pool array IN PLACE, is vectorised over a batch
of B sequences, and takes `n` (int [B]): rows to commit per sequence (0 allowed = untouched).
numpy only (no torch / tensorrt).
"""

from __future__ import annotations

import contextlib

import numpy as np

from dflash_trt.plugins.registry import install_methods


class HostDevice:
    name = "host"
    graph_steps = False  # host steps only: nothing to capture

    def on_stream(self):
        """No stream: host work runs in program order."""
        return contextlib.nullcontext()

    def zero_slot(self, pool, slot: int) -> None:
        """pool[:, slot] = 0 (a fresh sequence's GDN / conv state)."""
        pool[:, int(slot)] = 0

    # ---- memory -----------------------------------------------------------------------
    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def pad_rows(self, x, rows: int) -> np.ndarray:
        """x [B,T,...] -> [B,rows,...] zero-padded (graphs with a static row count)."""
        out = np.zeros((x.shape[0], rows) + x.shape[2:], dtype=x.dtype)
        out[:, : x.shape[1]] = x
        return out

    def to_host(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    def from_host(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    def gather_rows(self, pool, block_table_row, start, count) -> np.ndarray:
        """Read logical rows [start, start+count) of one sequence's page list.

        pool [L, 2, num_blocks, bs, H, hd]; block_table_row [max_blocks]
        returns [L, 2, count, H, hd] (a copy)
        """
        bs = pool.shape[3]
        logical = int(start) + np.arange(int(count), dtype=np.int64)
        bt = np.asarray(block_table_row, dtype=np.int64)
        return pool[:, :, bt[logical // bs], logical % bs].copy()


install_methods(HostDevice, "host_twins", static=True)  # the commit kernels: plugins/<op>/host.py
