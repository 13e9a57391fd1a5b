"""TensorRT IPluginV3 of MoeExperts: signature, shape rules and kernel limits from spec.py; enqueue launches the
grouped-GEMM kernels (launch.py) on TensorRT's pointers and stream. Their scratch — the routing plan (int32),
h [N*k, I] in x's dtype and the per-pair outputs [N*k, H] fp32 — lives in TensorRT's workspace, sized from the
profile's max shapes; int64 expert ids are read as they are (the kernels take int32 or int64)."""
from __future__ import annotations

from dflash_trt.plugins.moe import launch
from dflash_trt.plugins.moe.spec import SPEC
from dflash_trt.plugins.trt_base import DflashPlugin, ws_align


class MoeExpertsPlugin(DflashPlugin):
    SPEC = SPEC

    @staticmethod
    def _parts(dims, types):
        """(plan bytes, h bytes, y_pair bytes, (N, k, E, H, I)) of these shapes; offsets are WORKSPACE_ALIGN'ed."""
        (N, H), (_, k), (E, I2, _) = dims[0], dims[1], dims[3]
        I = I2 // 2  # noqa: E741
        h_item = 4 if types[0] == "float32" else 2
        return (ws_align(4 * launch.workspace_ints(N, k, E)), ws_align(N * k * I * h_item), N * k * H * 4,
                (N, k, E, H, I))

    def workspace_bytes(self, dims, types):
        plan, h, y, _ = self._parts(dims, types)
        return plan + h + y

    def launch(self, d, it, ot, i, o, ws, stream):
        plan, h, _, (N, k, E, H, I) = self._parts(d, it)  # noqa: E741
        launch.moe_experts(i[0], i[1], i[2], i[3], i[4], o[0], ws, ws + plan, ws + plan + h, N=N, k=k, E=E, H=H,
                           I=I, dtype=it[0], idx_dtype=it[1], w_dtype=it[2], stream=stream)
