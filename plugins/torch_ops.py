"""Importing this module registers every ``dflash::`` torch custom op (CUDA -> our NVRTC kernels,
CPU -> the reference math): each op folder's torch_op.py, as its bundle names it; each op's signature is
documented there."""
from dflash_trt.plugins.registry import bundles

for _b in bundles():
    _b.register_torch_ops()
