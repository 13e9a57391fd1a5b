"""torch.library custom ops ``dflash::*`` (CUDA -> our NVRTC kernels, CPU -> reference math).

See _ops_impl.py for the op signatures. This shim makes the registration happen once per process
even when the checkout is imported both as ``plugins`` (repo root on sys.path) and as
``dflash_trt.plugins``: torch.library refuses to define an op twice.
"""
import sys as _sys

_twin = "plugins.torch_ops" if __name__.startswith("dflash_trt.") else "dflash_trt.plugins.torch_ops"
if _twin in _sys.modules:
    _impl = _sys.modules[_twin]
else:
    from . import _ops_impl as _impl

gdn_wy16 = _impl.gdn_wy16
gdn_fold = _impl.gdn_fold
conv_verify = _impl.conv_verify
conv_roll = _impl.conv_roll
paged_attention = _impl.paged_attention
kv_write = _impl.kv_write
__all__ = ["gdn_wy16", "gdn_fold", "conv_verify", "conv_roll", "paged_attention", "kv_write"]
