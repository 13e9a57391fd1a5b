"""torch.library custom ops ``dflash::*`` (CUDA -> our NVRTC kernels, CPU -> reference math).

Importing this module registers the ops; see _ops_impl.py for their signatures.
"""
from dflash_trt.plugins._ops_impl import conv_roll, conv_verify, gdn_fold, gdn_wy16, kv_write, paged_attention

__all__ = ["gdn_wy16", "gdn_fold", "conv_verify", "conv_roll", "paged_attention", "kv_write"]
