"""TensorRT IPluginV3 of PagedAttention: signature, shape rules and kernel limits from spec.py; enqueue
launches paged_attention (launch.py) on TensorRT's pointers and stream. The kernel reads int32 indices:
int64 index inputs are narrowed into TensorRT's workspace first (no allocation, no sync); the split-KV
partials follow them in the same workspace, sized from the max profile shapes."""
from __future__ import annotations

import math

from dflash_trt.plugins import trt_base
from dflash_trt.plugins.paged_attention import launch, spec
from dflash_trt.plugins.paged_attention.spec import INDEX_INPUTS, SPEC
from dflash_trt.plugins.trt_base import DflashPlugin, ws_align


class PagedAttentionPlugin(DflashPlugin):
    SPEC = SPEC

    @staticmethod
    def _index_slots(dims, types):
        """(input index, element count, workspace offset) for each int64 index input."""
        out, off = [], 0
        for idx in INDEX_INPUTS:
            if types[idx] == "int64":
                n = math.prod(dims[idx])
                out.append((idx, n, off))
                off += ws_align(4 * n)
        return out, off

    def workspace_bytes(self, dims, types):
        # split-KV partials after the narrowed index inputs; sized from the profile's max shapes, so the
        # bound holds for every smaller runtime shape (spec.workspace_bound)
        (B, T, Hq, hd) = dims[0]
        return self._index_slots(dims, types)[1] + spec.workspace_bound(B, T, Hq, hd)

    def launch(self, d, it, ot, i, o, ws, stream):
        (B, T, Hq, hd), Hkv = d[0], d[1][2]
        L, _, NB, BS = d[3][:4]
        idx = {k: i[k] for k in INDEX_INPUTS}
        for k, n, off in self._index_slots(d, it)[0]:
            trt_base.narrow_i64(ws + off, i[k], n, stream)
            idx[k] = ws + off
        bt, ks, kl = (idx[k] for k in INDEX_INPUTS)
        part = ws + self._index_slots(d, it)[1]  # WORKSPACE_ALIGN-aligned
        scale = self.attrs["scale"] or hd ** -0.5
        launch.paged_attention(i[0], i[1], i[2], i[3], bt, ks, kl, o[0], B=B, T=T, Hq=Hq, Hkv=Hkv, hd=hd,
                               layer=self.attrs["layer"], num_blocks=NB, block_size=BS, max_blocks=d[4][1],
                               causal=bool(self.attrs["causal"]), scale=scale, window=int(self.attrs["window"]),
                               q_dtype=it[0], n_dtype=it[1],
                               p_dtype=it[3], o_dtype=ot[0], workspace=part, stream=stream)
