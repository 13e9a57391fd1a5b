"""gdn_fold and gdn_set as methods of the torch device (runtime/devices/torch_device.py): the fold is the dflash::
op, all layers in one call, in place. `dev` supplies the tensor conversions (_t, _i, to_host) and the device."""
from __future__ import annotations

import numpy as np
import torch


def gdn_fold(dev, pool, slots, k_hat, v, g, beta, n) -> None:
    """pool [L,slots,Hv,dk,dv]; fold data [L,B,T,...]; folds the first n[b] rows into slot[b] (all layers, one op)."""
    slots, n = dev._i(slots), dev._i(n)
    k_hat, v, g, beta = (dev._t(x, torch.float32) for x in (k_hat, v, g, beta))
    torch.ops.dflash.gdn_fold(pool, slots, k_hat, v, g, beta, n)


def gdn_set(dev, pool, slots, state, n) -> None:
    keep = np.nonzero(np.asarray(dev.to_host(n)).reshape(-1) > 0)[0]
    if keep.size:
        sl = torch.as_tensor(np.asarray(dev.to_host(slots)).reshape(-1)[keep], device=dev.device)
        pool[:, sl] = dev._t(state)[:, torch.as_tensor(keep, device=dev.device)].to(pool.dtype)
