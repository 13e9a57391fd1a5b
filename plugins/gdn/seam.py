"""gdn_chunk, as the models call it through plugins.ops."""
from __future__ import annotations

import torch

from dflash_trt.plugins import seam_base as S
from dflash_trt.plugins.gdn import reference as gdn_ref
from dflash_trt.plugins.gdn.spec import IDENTITY_GATE, SPEC


def gdn_chunk(q, k, v, a, b, A_log, dt_bias, state, scale=None, slot=None, valid_len=None):
    """The model's gates (reference.gdn_gates of the raw columns a, b [B,T,Hv] with A_log, dt_bias [Hv]), then
    GdnChunkWY16: returns GdnOut(o, state, k_hat, v, g, beta); `state` is read-only: [B,Hv,dk,dv], or with `slot`
    [B] a pool layer [slots,Hv,dk,dv] whose rows slot[b] are the states. q, k, v in the model's dtype. The op computes
    in fp32 (q, k, v cast as the spec's reference does); o comes back in q's dtype on CUDA (the kernel rounds its
    fp32 sums once, as the cast of an fp32 o would) and fp32 elsewhere.
    valid_len [B] (prefill): rows t >= valid_len[b] are padding; their raw gates become spec.IDENTITY_GATE (g = 0,
    beta = 0: the row leaves the state as it is), so GdnOut.state is the state after the valid rows.
    CUDA: one kernel, gates included: it reads q, k, v in place (slices of the conv output), a and b in place
    (columns of the input projection) and the state straight from the pool slot: no gate, cast, gather or copy
    kernel before it. Export keeps the gates as plain ops before the GdnChunkWY16 node (the op's spec)."""
    if valid_len is not None:
        pad = (torch.arange(a.shape[1], device=a.device)[None, :] >= valid_len.reshape(-1, 1))[..., None]
        a, b = a.masked_fill(pad, IDENTITY_GATE), b.masked_fill(pad, IDENTITY_GATE)
    dflash = None if S.exporting() else S.cuda_ops(q)
    if dflash is not None:
        o, k_hat, v_f, g_f, b_f, fs = dflash.gdn_wy16(q, k, v, a, b, state.float(), S.i32(slot), scale,
                                                      valid_len is not None, A_log, dt_bias)
        return gdn_ref.GdnOut(o, fs if valid_len is not None else None, k_hat, v_f, g_f, b_f)
    g, beta = gdn_ref.gdn_gates(a, b, A_log, dt_bias)
    q, k, v, g, beta, state = (t.float() for t in (q, k, v, g, beta, S.rows_of(state, slot)))
    if S.exporting():
        dk = q.shape[3]
        attrs = {"scale": dk ** -0.5 if scale is None else scale}
        return gdn_ref.GdnOut(*S.node(SPEC, (q, k, v, g, beta, state), attrs))
    return gdn_ref.gdn_chunk_wy16(q, k, v, g, beta, state, scale=scale)


def gdn_decode_commit(q, k, v, a, b, A_log, dt_bias, pool, layer: int, slot, n, scale=None):
    """gdn_chunk at T = 1 whose row is committed where the state is read: returns o [B,1,Hv,dv]; pool [L,slots,Hv,dk,dv]
    (all GDN layers, fp32) gets, in rows slot[b] of its layer `layer` where n[b] > 0, the state the commit's gdn_fold
    of that row would leave. The torch backend's plain decode step calls it (one read and one write of the state on
    CUDA, where gdn_chunk + gdn_fold take three passes); exported graphs keep read-only pools (gdn_chunk + the
    runtime's fold), so it has no ONNX form. CPU: gdn_wy16's reference then gdn_fold's, the same functions as the
    graph + commit path."""
    if S.exporting():
        raise RuntimeError("gdn_decode_commit mutates the state pool; exported graphs run gdn_chunk and the commit")
    from dflash_trt.plugins import torch_ops  # noqa: F401  registers torch.ops.dflash.*

    return torch.ops.dflash.gdn_decode(q, k, v, a, b, pool, layer, S.i32(slot), n, scale, A_log, dt_bias)
