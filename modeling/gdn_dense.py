"""The gated delta rule over whole sequences for the training forward (TargetModel.forward_train): batched and
differentiable, where the step's kernels (plugins/gdn) run the 16-row WY chunks a step needs and have no backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trt.plugins.gdn.reference import l2norm


def gdn_chunk_dense(q, k, v, g, beta, state=None, chunk: int = 64):
    """The gated delta rule (DESIGN §2 steps 4-5) for the training forward: chunked WY form with every
    chunk's intra-chunk work batched (triangular solve, chunk up to 64) and only the state hand-off
    looped, differentiable. Same math as the GdnChunkWY16 reference (gdn_chunk_wy16 / gdn_recurrent),
    which tests/test_train.py checks it against; the reference's 16-row chunks and per-chunk loop are
    what the plugin computes, this form is what makes training on whole 512-token windows fast.
    q, k [B,T,Hk,dk]; v [B,T,Hv,dv]; g, beta [B,T,Hv]; state [B,Hv,dk,dv] or None (zeros).
    Returns (o [B,T,Hv,dv], final state), fp32 (fp64 when q is). Autocast is off inside: the state math
    stays fp32 under bf16 training. Padding rows (beta = 0, g = 0) change nothing."""
    with torch.autocast(q.device.type, enabled=False):
        B, T, Hk, dk = q.shape
        Hv, dv = v.shape[2], v.shape[3]
        f = torch.float64 if q.dtype == torch.float64 else torch.float32
        qh, kh = l2norm(q.to(f)) * dk**-0.5, l2norm(k.to(f))
        if Hv != Hk:  # v-head j reads k-head j // (Hv/Hk)
            qh, kh = qh.repeat_interleave(Hv // Hk, 2), kh.repeat_interleave(Hv // Hk, 2)
        v, g, beta = v.to(f), g.to(f), beta.to(f)
        C = min(chunk, T)
        pad = (-T) % C
        if pad:
            qh, kh, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qh, kh, v))
            g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        N = (T + pad) // C

        def heads(x):  # [B,Tp,Hv,(d)] -> [B,Hv,N,C,(d)]
            x = x.transpose(1, 2)
            return x.reshape(B, Hv, N, C, *x.shape[3:])

        Q, K, V, G, Bt = heads(qh), heads(kh), heads(v), heads(g), heads(beta)
        gam = G.cumsum(-1)  # chunk-local cumulative log-decay
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # mask the exponent before exp so the unused upper triangle cannot overflow
        decay = torch.exp((gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")))
        A = Bt[..., :, None] * (K @ K.transpose(-1, -2)) * decay.tril(-1)
        eye = torch.eye(C, dtype=f, device=q.device)
        Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
        eg = torch.exp(gam)
        W = Tinv @ ((Bt * eg)[..., None] * K)
        U = Tinv @ (Bt[..., None] * V)
        QK = (Q @ K.transpose(-1, -2)) * decay
        gC = gam[..., -1]
        tail = torch.exp(gC[..., None] - gam)[..., None]
        S = torch.zeros(B, Hv, dk, dv, dtype=f, device=q.device) if state is None else state.to(f)
        outs = []
        for n in range(N):
            Vn = U[:, :, n] - W[:, :, n] @ S  # V' rows of chunk n
            outs.append(eg[:, :, n, :, None] * (Q[:, :, n] @ S) + QK[:, :, n] @ Vn)
            S = torch.exp(gC[:, :, n])[..., None, None] * S + K[:, :, n].transpose(-1, -2) @ (tail[:, :, n] * Vn)
        o = torch.stack(outs, 2).reshape(B, Hv, N * C, dv)[:, :, :T].transpose(1, 2)
    return o, S
