"""TensorRT IPluginV3 of CausalConvVerify: signature, shape rules and kernel limits from spec.py; enqueue
launches conv_verify (launch.py) on TensorRT's pointers and stream."""
from __future__ import annotations

from dflash_trt.plugins.conv import launch
from dflash_trt.plugins.conv.spec import SPEC
from dflash_trt.plugins.trt_base import DflashPlugin


class CausalConvVerifyPlugin(DflashPlugin):
    SPEC = SPEC

    def launch(self, d, it, ot, i, o, ws, stream):
        (B, T, C), W = d[0], d[2][1]
        launch.conv_verify(i[0], i[1], 0, i[2], o[0], B=B, T=T, C=C, W=W, x_dtype=it[0], s_dtype=it[1],
                           w_dtype=it[2], y_dtype=ot[0], stream=stream)
