"""conv_roll as a method of the torch device (runtime/devices/torch_device.py): the dflash:: op, all layers in one
call, in place. `dev` supplies the tensor conversions (_t, _i)."""
from __future__ import annotations

import torch


def conv_roll(dev, pool, slots, cols, n) -> None:
    """pool [L,slots,C,W-1]; cols [L,B,T,C] (all layers, one op)."""
    torch.ops.dflash.conv_roll(pool, dev._i(slots), dev._t(cols), dev._i(n))
