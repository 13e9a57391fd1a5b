"""DFlash2's additions to the DFlash drafter (z-lab checkpoint format), in torch with static shapes only, so the
block graph exports to ONNX as standard ops and runs inside a CUDA graph as it is.

GroupedConv (`layers.N.attention_conv`, `layers.N.mlp_conv`): a dynamic causal convolution over the block's
  slots wrapped around attention and around the MLP. From the sublayer's normed input x [.., L, H]:
    dyn = kernel_projection(x) viewed [.., L, 2, ks, G]  (G = H / conv_group_size groups)
    conv_s(y)[t] = sum_{o<ks} (base_kernel[s, o] + dyn[t, s, o, group]) * y[t-o]   (y[t<0] = 0: per block)
  prepare(x) = (conv_0(x), dyn[..., 1]); finish(sublayer(conv_0(x)), dyn[..., 1]) = conv_1 of the output.
CandidateSelector (`candidate_selector`): picks the γ drafts from the top-k of the drafter's logits at each slot,
  left to right starting at the bonus token:
    score_j[c] = logit_j[c] + <pred[prev] * hidden_projection(h_j), succ[c]>   (pred, succ: [V, rank] codebooks)
  temperature 0: c = argmax score_j; T > 0: c ~ softmax(score_j / T) drawn by inverse CDF at the uniform u_j,
  and q_j = that softmax over the k candidates is the draft distribution the rejection test uses.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import DrafterConfig
from dflash_trt.modeling.fuse import Linear


def _shift(x, o: int):
    """x [.., L, H] shifted o slots later along L, zeros in front (the conv's causal padding)."""
    if o == 0:
        return x
    return torch.cat([torch.zeros_like(x[..., :o, :]), x[..., :-o, :]], -2)


class GroupedConv(nn.Module):
    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def _conv(self, y, dyn, s: int):
        """conv_s of y [.., L, H] with the dynamic taps dyn [.., L, ks, G]."""
        shape = y.shape
        yg = y.reshape(*shape[:-1], self.groups, self.group_size)
        base = self.base_kernel[s].to(y.dtype).view(self.kernel_size, self.groups, self.group_size)
        out = torch.zeros_like(yg)
        for o in range(self.kernel_size):
            v = _shift(y, o).reshape(yg.shape)
            out = out + (base[o] + dyn[..., o, :, None]) * v
        return out.reshape(shape)

    def prepare(self, x):
        """x [.., L, H] -> (conv_0(x), the taps finish() uses)."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._conv(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def finish(self, y, dyn):
        return self._conv(y, dyn, 1)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DrafterConfig, vocab: int):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(vocab, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(vocab, cfg.selector_rank)
        self.hidden_projection = Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def forward(self, hidden, logits, anchor, temperature=None, u=None):
        """hidden [B,γ,H] (the drafter's normed output at the draft slots), logits [B,γ,V] (their final logits),
        anchor [B] (the bonus token); temperature [B] float (<= 0: argmax; None: all greedy), u [B,γ] uniforms.
        Returns (drafts [B,γ] int64, candidates [B,γ,k] int64, q [B,γ,k] float32: the draw's distribution over
        the candidates, one-hot on greedy rows)."""
        unary, cand = torch.topk(logits.float(), self.top_k, dim=-1)
        hp = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()
        succ = self.successor_codebook(cand).float()  # [B,γ,k,r]
        # Every score the path can need, before it is walked: slot 0 after the anchor [B,k], and slot j after
        # candidate i of slot j-1 [B,γ-1,k,k]. The walk is then one gather per slot (few launches in the graph).
        first = unary[:, 0] + (succ[:, 0] @ (self.predecessor_codebook(anchor).float() * hp[:, 0])[:, :, None])[..., 0]
        after = self.predecessor_codebook(cand[:, :-1]).float() * hp[:, 1:, None, :]  # [B,γ-1,k,r]
        pair = unary[:, 1:, None, :] + after @ succ[:, 1:].transpose(-1, -2)
        if temperature is None:
            temperature = torch.zeros(anchor.shape[0], device=anchor.device)
        t = temperature.to(torch.float32)[:, None]
        greedy = t <= 0
        t = torch.where(greedy, torch.ones_like(t), t)
        picks, qs, scores = [], [], first
        for j in range(cand.shape[1]):
            if j:  # the row of slot j's pair scores that follows slot j-1's pick
                scores = pair[:, j - 1].gather(1, picks[-1][:, None, None].expand(-1, 1, self.top_k))[:, 0]
            best = scores.argmax(-1)
            if u is not None:
                q = torch.softmax(scores / t, -1)
                picks.append(torch.where(greedy[:, 0], best, _inverse_cdf(q, u[:, j])))
                qs.append(torch.where(greedy, nn.functional.one_hot(best, self.top_k).to(q.dtype), q))
            else:
                picks.append(best)
        drafts = cand.gather(-1, torch.stack(picks, 1)[..., None])[..., 0]
        return drafts, cand, torch.stack(qs, 1) if qs else None


def _inverse_cdf(q, u):
    """One index per row of q [B,k] (normalised) at u [B] in [0, 1): the first whose cumulative mass exceeds u,
    counted with comparisons (ONNX-exportable; k is small); a zero-mass pick (rounding at the top) falls back to
    the argmax."""
    cdf = torch.cumsum(q, -1)
    i = (cdf <= (u.to(cdf.dtype) * cdf[:, -1])[:, None]).sum(-1).clamp(max=q.shape[-1] - 1)
    return torch.where(q.gather(-1, i[:, None])[:, 0] > 0, i, q.argmax(-1))
