"""kv_write as a method of the torch device (runtime/devices/torch_device.py): the dflash:: op, all layers in one
call, in place. `dev` supplies the tensor conversions (_t, _i)."""
from __future__ import annotations

import torch


def kv_write(dev, pool, rows, block_table, start_row, n) -> None:
    """pool [L,2,blocks,bs,H,hd]; rows [L,2,B,T,H,hd]; row i -> logical row start_row[b]+i (all layers, one op)."""
    bt, pos, n = dev._i(block_table), dev._i(start_row), dev._i(n)
    torch.ops.dflash.kv_write(pool, dev._t(rows), bt, pos, n)
