"""conv_verify, as the models call it through plugins.ops."""
from __future__ import annotations

from dflash_trt.plugins import seam_base as S
from dflash_trt.plugins.conv import reference as conv_ref
from dflash_trt.plugins.conv.spec import SPEC


def conv_verify(x, conv_state, weight, slot=None):
    """CausalConvVerify: silu(depthwise causal conv over [conv_state | x]); conv_state read-only: [B,C,W-1], or with
    `slot` [B] a pool layer [slots,C,W-1] whose rows slot[b] are the states (CUDA reads them in place)."""
    dflash = None if S.exporting() else S.cuda_ops(x)
    if dflash is not None:
        if conv_state.dtype != x.dtype:  # the kernel's output dtype follows its inputs': cast the rows first
            conv_state, slot = S.rows_of(conv_state, slot).to(x.dtype), None
        return dflash.conv_verify(x, conv_state, weight, S.i32(slot))
    conv_state = S.rows_of(conv_state, slot).to(x.dtype)
    if S.exporting():
        return S.node(SPEC, (x, conv_state, weight), {})[0]
    return conv_ref.conv_verify(x, conv_state, weight)
