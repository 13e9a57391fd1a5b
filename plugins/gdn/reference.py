"""GdnChunkWY16 and gdn_fold in plain torch: the exact math (DESIGN §3) the ONNX body, the CUDA kernels
and the TensorRT plugin are tested against; also the CPU implementation of the dflash:: torch ops.

Clarity over speed; inputs are never mutated. Dtypes: all state math runs in float32, or in float64
when any input is float64 (so tests can check the algebra exactly). `o` is returned in q's dtype (like
HF's torch_recurrent_gated_delta_rule); states and fold data stay in the compute dtype.
Shapes: see spec.py (q,k [B,T,Hk,dk]; v [B,T,Hv,dv]; g, beta [B,T,Hv]; state [B,Hv,dk,dv]).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_trt.plugins.gdn.spec import CHUNK, L2NORM_EPS

__all__ = ["GdnOut", "gdn_gates", "l2norm", "expand_heads", "gdn_recurrent", "gdn_chunk_wy16", "gdn_fold",
           "gdn_fold_layers"]


def _cdtype(*ts):
    """Compute dtype: float64 if any floating input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def expand_heads(x, hv):
    """[B,T,Hk,d] -> [B,T,Hv,d]: value head h reads key head h // (Hv // Hk)."""
    hk = x.shape[2]
    assert hv % hk == 0, f"Hv={hv} not a multiple of Hk={hk}"
    return x if hv == hk else x.repeat_interleave(hv // hk, dim=2)


def gdn_gates(a, b, A_log, dt_bias):
    """The model's gates before the op: a, b [..., Hv] -> (g, beta) in float32 (float64 if any input is float64).
    g = -exp(A_log) * softplus(a + dt_bias) is the per-token log-decay (<= 0); beta = sigmoid(b). The CUDA op
    computes the same inside the kernel when handed A_log and dt_bias (torch_op.py)."""
    dt = _cdtype(a, b, A_log, dt_bias)
    g = -torch.exp(A_log.to(dt)) * F.softplus(a.to(dt) + dt_bias.to(dt))
    return g, torch.sigmoid(b.to(dt))


def l2norm(x, eps=L2NORM_EPS):
    # Same form as HF Qwen3Next's l2norm (eps inside the rsqrt, not max(norm, eps)).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, state, scale):
    """Shared prologue: cast to compute dtype, l2-normalise q/k, scale q, expand k-heads."""
    dt = _cdtype(q, k, v, g, beta, state)
    dk = q.shape[-1]
    if scale is None:
        scale = dk ** -0.5
    k_hat = l2norm(k.to(dt))  # per K-head (this is what the fold data stores)
    q_hat = l2norm(q.to(dt)) * scale
    hv = v.shape[2]
    return (dt, expand_heads(q_hat, hv), k_hat, expand_heads(k_hat, hv),
            v.to(dt), g.to(dt), beta.to(dt), state.to(dt))


def _recurrent_row(S, k_hat, v, g, beta):
    """One token of the gated delta rule per v-head (the update gdn_recurrent and gdn_fold share):
    S' = e^g S; u = beta (v - S'^T k̂); S = S' + k̂ u^T.
    S [B,Hv,dk,dv]; k_hat [B,Hv,dk]; v [B,Hv,dv]; g, beta [B,Hv]."""
    S = S * torch.exp(g)[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", S, k_hat))
    return S + k_hat[..., :, None] * u[..., None, :]


def gdn_recurrent(q, k, v, g, beta, state, scale=None):
    """Token-by-token gated delta rule (the ground truth, DESIGN §2 step 5).

    Per v-head: S' = e^g S; u = beta (v - S'^T k̂); S = S' + k̂ u^T; o = S^T q̂.
    Returns (o [B,T,Hv,dv] in q's dtype, final_state [B,Hv,dk,dv]).
    """
    dt, qh, _, kh, v, g, beta, S = _prep(q, k, v, g, beta, state, scale)
    T = q.shape[1]
    outs = []
    for t in range(T):
        S = _recurrent_row(S, kh[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qh[:, t]))        # o = S^T q̂
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o.to(q.dtype), S


class GdnOut(NamedTuple):
    o: torch.Tensor        # [B,T,Hv,dv] (q's dtype)
    state: torch.Tensor    # [B,Hv,dk,dv] final state
    k_hat: torch.Tensor    # [B,T,Hk,dk] l2-normalised k, per K-head
    v: torch.Tensor        # [B,T,Hv,dv] v rows   } fold data: the recurrence's inputs of each row, in the
    g: torch.Tensor        # [B,T,Hv] log-gates   } compute dtype (gdn_fold replays the rows the commit
    beta: torch.Tensor     # [B,T,Hv] betas       } accepts one at a time)


def _inv_unit_lower(A):
    """(I + A)^-1 for strictly lower A of size C <= 16, as (I-A)(I+A^2)(I+A^4)(I+A^8).

    Why: A is nilpotent (A^16 = 0), so (I+A)(I-A)(I+A^2)(I+A^4)(I+A^8) = I - A^16 = I. This is
    three squarings + three matmuls, no triangular solve -- the form the ONNX body uses (standard ops only);
    the CUDA kernel computes the same inverse by forward substitution (one column per lane).
    """
    C = A.shape[-1]
    assert C <= 16
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    Tm = eye - A
    P = A
    for _ in range(3):
        P = P @ P                                                        # A^2, A^4, A^8
        Tm = Tm @ (eye + P)
    return Tm


def gdn_chunk_wy16(q, k, v, g, beta, state, scale=None, chunk=CHUNK):
    """Chunked WY form of the gated delta rule (DESIGN §3, GdnChunkWY16).

    Per chunk of C <= 16 rows with local γ = cumsum(g):
      A_ij = β_i (k̂_i·k̂_j) e^{γ_i-γ_j} (i>j), T = (I+A)^-1,
      W = T diag(β e^γ) K, U = T diag(β) V, V' = U - W S,
      O = diag(e^γ) Q S + ((Q K^T) ⊙ M) V'  (M_ij = e^{γ_i-γ_j}, i>=j),
      S_next = e^{γ_C} S + K^T diag(e^{γ_C-γ}) V'.
    Returns GdnOut(o, state, k_hat, v, g, beta): the fold data are this op's per-row inputs (v, g, beta as the
    recurrence reads them), not the chunk's V' -- see gdn_fold.
    """
    assert 1 <= chunk <= CHUNK, "log-depth inverse is exact only for chunk <= 16"
    dt, qh, k_hat, kh, v, g, beta, S = _prep(q, k, v, g, beta, state, scale)
    B, T, Hv, dv = v.shape
    # Work head-major: [B,Hv,T,d].
    qh, kh, v = (x.transpose(1, 2) for x in (qh, kh, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    o_chunks = []
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        C = c1 - c0
        Qc, Kc, Vc = qh[:, :, c0:c1], kh[:, :, c0:c1], v[:, :, c0:c1]
        bc = beta[:, :, c0:c1]
        gam = torch.cumsum(g[:, :, c0:c1], dim=-1)                     # local γ [B,Hv,C]
        diff = gam[..., :, None] - gam[..., None, :]                    # γ_i - γ_j
        # Mask the exponent before exp so the (never used) upper triangle cannot overflow.
        lower_eq = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        decay = torch.exp(torch.where(lower_eq, diff, diff.new_tensor(float("-inf"))))  # M
        strict = decay.tril(-1)
        A = bc[..., :, None] * (Kc @ Kc.transpose(-1, -2)) * strict
        Tinv = _inv_unit_lower(A)
        W = Tinv @ ((bc * torch.exp(gam))[..., None] * Kc)
        U = Tinv @ (bc[..., None] * Vc)
        Vn = U - W @ S                                                  # V' rows == u_i
        O = torch.exp(gam)[..., None] * (Qc @ S) + ((Qc @ Kc.transpose(-1, -2)) * decay) @ Vn
        gC = gam[..., -1:]                                              # γ_C [B,Hv,1]
        S = torch.exp(gC)[..., None] * S + Kc.transpose(-1, -2) @ (torch.exp(gC - gam)[..., None] * Vn)
        o_chunks.append(O)
    o = torch.cat(o_chunks, dim=2).transpose(1, 2) if T else v.transpose(1, 2).clone()
    return GdnOut(o.to(q.dtype), S, k_hat, v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2))


def gdn_fold(state, k_hat, v, g, beta, n):
    """State after the first n rows of a verify, from its fold data (DESIGN §3, fold-accepted): the rows replayed
    one at a time by the recurrence's own update (_recurrent_row), so folding n rows at once gives the state of n
    one-row steps exactly, bit for bit -- speculative and plain decoding carry the same GDN state (the fp32 state of
    a multi-row closed form differs in its last bits, which bf16 logits then amplify in the verify/decode KL).
    state [B,Hv,dk,dv]; k_hat [B,T,Hk,dk]; v [B,T,Hv,dv]; g, beta [B,T,Hv]; n int [B] (rows past n[b] are
    not read: n = 0 leaves S0)."""
    dt = _cdtype(state, k_hat, v, g, beta)
    B, T, Hv, _ = v.shape
    S, kh = state.to(dt), expand_heads(k_hat.to(dt), Hv)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    n = n.to(device=state.device, dtype=torch.long).reshape(B)
    for i in range(int(n.max()) if B else 0):
        nxt = _recurrent_row(S, kh[:, i], v[:, i], g[:, i], beta[:, i])
        S = torch.where((i < n).view(B, 1, 1, 1), nxt, S)                 # rows past n[b]: no update
    return S


def gdn_fold_layers(state, k_hat, v, g, beta, n):
    """gdn_fold over L layers at once: state [L,B,Hv,dk,dv]; fold data [L,B,T,...]; n [B] (same per layer)."""
    L, B = k_hat.shape[:2]
    flat = lambda x: x.reshape(L * B, *x.shape[2:])  # noqa: E731  layers are independent: fold as L*B rows
    n = n.to(device=state.device, dtype=torch.long).reshape(1, B).expand(L, B).reshape(L * B)
    out = gdn_fold(flat(state), flat(k_hat), flat(v), flat(g), flat(beta), n)
    return out.reshape(L, B, *out.shape[1:])
