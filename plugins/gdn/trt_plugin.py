"""TensorRT IPluginV3 of GdnChunkWY16: signature, shape rules and kernel limits from spec.py; enqueue launches
gdn_wy16 (launch.py) on TensorRT's pointers and stream. Output order is the spec's: o, state_out, k_hat,
v_f32, g_f32, beta_f32."""
from __future__ import annotations

from dflash_trt.plugins.gdn import launch
from dflash_trt.plugins.gdn.spec import SPEC
from dflash_trt.plugins.trt_base import DflashPlugin


class GdnChunkWY16Plugin(DflashPlugin):
    SPEC = SPEC

    def launch(self, d, it, ot, i, o, ws, stream):
        (B, T, Hk, dk), (_, _, Hv, dv) = d[0], d[2]
        scale = self.attrs["scale"] or dk ** -0.5
        launch.gdn_wy16(i[0], i[1], i[2], i[3], i[4], i[5], 0, o[0], o[2], o[3], o[4], o[5], o[1], B=B, T=T, Hk=Hk,
                        Hv=Hv, dk=dk, dv=dv, in_dtype=it[0], gb_dtype=it[3], o_dtype=ot[0], state_dtype=it[5],
                        scale=scale, stream=stream)
