"""Importing this module registers every ``dflash::`` torch custom op (CUDA -> our NVRTC kernels,
CPU -> the reference math); each op's signature is documented in its folder's torch_op.py."""
from dflash_trt.plugins.conv.torch_op import conv_roll, conv_verify
from dflash_trt.plugins.gdn.torch_op import gdn_fold, gdn_wy16
from dflash_trt.plugins.gemv.torch_op import gemv, gemv_swiglu
from dflash_trt.plugins.moe.torch_op import moe_experts, moe_route
from dflash_trt.plugins.paged_attention.torch_op import kv_write, paged_attention

__all__ = ["gdn_wy16", "gdn_fold", "conv_verify", "conv_roll", "paged_attention", "kv_write", "moe_experts",
           "moe_route", "gemv", "gemv_swiglu"]
