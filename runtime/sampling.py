"""Sampling at T > 0 (DESIGN §5): per-sequence parameters, and the one implementation of the sampling math that
both step executors use (runtime/host_step.py on the host path, runtime/backends/torch_fused_step.py inside
the GPU step's CUDA graph).

Parameters: `SamplingParams` (temperature, top_k, top_p, min_p, seed), validated when built; temperature 0
is greedy and takes today's greedy path, token-identical.

Math (torch; CPU and CUDA alike; no host syncs, no data-dependent shapes, no torch.Generator: capturable):
  probs             logits -> the sampling distribution: temperature, top-k, top-p (over the top-k
                    renormalised mass), min-p (relative to the top token), renormalised. Rows at temperature 0
                    get one-hot(argmax), so greedy rows of a mixed batch come out exactly as greedy.
  sample            one token by inverse CDF from one uniform; never a zero-mass token.
  speculative_accept  standard speculative rejection sampling over γ drafts drawn from q: accept draft i with
                    probability min(1, p_i(d)/q_i(d)) (as u·q < p: no division, exact where q = 0), at the first
                    rejection a token from normalize(max(0, p − q)), all accepted -> the bonus from p at the last
                    row. The emitted tokens are then distributed exactly as sampling from p one token at a time.
Randomness: `uniform(seed, position, purpose)`, a counter-based generator (splitmix64 finaliser chained over
the seed, the absolute position of the token being decided and the purpose of the draw) in int64 torch ops,
so it is a pure function: identical on CPU and GPU, reproducible for a fixed seed, and free of state a CUDA
graph would have to carry. A draw at position P is only ever consumed by the step that emits the token at P:
a later step re-uses keys only of positions past the last emitted token, which no emitted token depended on.
"""
from __future__ import annotations

import numbers
import secrets
from dataclasses import dataclass, replace

import numpy as np

from dflash_trt.optional import require_torch
from dflash_trt.runtime.logprobs import LOGPROBS_MAX

# draw purposes (the third key of uniform): independent streams per position
TOKEN, DRAFT, ACCEPT, RESIDUAL = 1, 2, 3, 4
SEED_BITS = 63  # seeds are non-negative int64


class SamplingError(ValueError):
    """Sampling parameters out of range (temperature < 0, top_p outside (0, 1], ...), or a backend whose graphs
    emit no logits asked to sample."""


def _real(name, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(float(v)):
        raise SamplingError(f"{name} must be a finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens, and what it reports of them. temperature 0 = greedy (the other fields are
    then ignored); top_k 0 = off; top_p 1 = off; min_p 0 = off; seed None = drawn at random when the request is
    queued (`resolved()`), so every request has a seed that reproduces it. logprobs k (0..LOGPROBS_MAX): each emitted
    token's logprob and its position's top k under the target's raw distribution (runtime/logprobs.py); None: none."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self):
        t = _real("temperature", self.temperature)
        if t < 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        m = _real("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise SamplingError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < 2**SEED_BITS):
            raise SamplingError(f"seed must be an integer in [0, 2^{SEED_BITS}), got {s!r}")
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= LOGPROBS_MAX):
            raise SamplingError(f"logprobs must be an integer in [0, {LOGPROBS_MAX}] (alternatives per token), "
                                f"got {k!r}")
        for f, v in (("temperature", t), ("top_k", int(self.top_k)), ("top_p", p), ("min_p", m)):
            object.__setattr__(self, f, v)
        if s is not None:
            object.__setattr__(self, "seed", int(s))
        if k is not None:
            object.__setattr__(self, "logprobs", int(k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved(self) -> "SamplingParams":
        """These parameters with a seed (a fresh random one when none was given). Called when a request is queued,
        so a sampling request in an install without torch (the sampling math) is refused before any step runs."""
        if not self.greedy:
            require_torch("sampling (temperature > 0)", SamplingError)
        if self.logprobs is not None:
            require_torch("logprobs", SamplingError)
        return self if self.seed is not None or self.greedy else replace(self, seed=secrets.randbits(SEED_BITS))


GREEDY = SamplingParams()


def samples(rows) -> bool:
    """Whether a step over `rows` (Sequences or None for padding) has any sampling sequence."""
    return any(s is not None and s.sampling is not None and not s.sampling.greedy for s in rows)


def row_params(rows) -> dict:
    """Per-row parameters of a step as numpy arrays (padding and greedy rows: temperature 0)."""
    ps = [s.sampling if s is not None and s.sampling is not None else GREEDY for s in rows]
    return {"temperature": np.array([p.temperature for p in ps], np.float64),
            "top_k": np.array([p.top_k for p in ps], np.int64),
            "top_p": np.array([p.top_p for p in ps], np.float64),
            "min_p": np.array([p.min_p for p in ps], np.float64),
            "seed": np.array([p.seed or 0 for p in ps], np.int64)}


# ---- counter-based uniforms ---------------------------------------------------------------------
def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _srl(x, s: int):
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x):
    """splitmix64: x + golden, then its finaliser; int64 arithmetic wraps modulo 2^64."""
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def uniform(seed, position, purpose: int):
    """Uniforms in [0, 1) (float32, 24 bits) keyed by (seed, absolute position, purpose); broadcasting int64
    tensors. A pure function of its keys: same on every device and run."""
    import torch  # lazily, as everywhere here: the runtime core imports this module without torch

    h = _mix(_mix(_mix(seed) ^ position) ^ purpose)
    return _srl(h, 40).to(torch.float32) * (2.0 ** -24)


# ---- distributions ------------------------------------------------------------------------------
def cumsum_last(x):
    """torch.cumsum(x, -1) as one opaque op (runtime/backends/opaque_ops.py says why)."""
    from dflash_trt.runtime.backends import opaque_ops

    return opaque_ops.cumsum_last(x)


def probs(logits, temperature, top_k, top_p, min_p):
    """logits [B, ..., V] -> sampling probabilities [B, ..., V] float32 (rows sum to 1); per-row parameters [B]
    (temperature float, top_k int64, top_p / min_p float). Temperature-0 rows: one-hot(argmax(logits))."""
    import torch

    lg = logits.float()
    V = lg.shape[-1]
    shape = (-1,) + (1,) * (lg.dim() - 1)
    t = temperature.to(torch.float32).view(shape)
    greedy = t <= 0
    p = torch.softmax(lg / torch.where(greedy, torch.ones_like(t), t), -1)
    ps, idx = torch.sort(p, stable=True, dim=-1, descending=True)
    rank = torch.arange(V, device=lg.device)
    k = top_k.to(torch.int64).view(shape)
    keep = (k <= 0) | (rank < k)
    ps = ps * keep
    tp = top_p.to(torch.float32).view(shape)
    before = cumsum_last(ps) - ps  # mass ranked above: the smallest set reaching top_p
    keep = keep & ((tp >= 1) | (before < tp * ps.sum(-1, keepdim=True)))
    ps = ps * keep
    keep = keep & (ps >= min_p.to(torch.float32).view(shape) * ps[..., :1])
    ps = ps * keep
    p = torch.zeros_like(p).scatter_(-1, idx, ps)
    p = p / p.sum(-1, keepdim=True)
    onehot = torch.nn.functional.one_hot(lg.argmax(-1), V).to(p.dtype)
    return torch.where(greedy, onehot, p)


def sample(p, u):
    """One token per row of p [..., V] (non-negative, need not be normalised) by inverse CDF at u [...] in [0, 1);
    int64 [...]. A zero-mass token is never returned (rounding at the top end falls back to the argmax)."""
    import torch

    cdf = cumsum_last(p)
    x = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1).contiguous()
    i = torch.searchsorted(cdf.contiguous(), x, right=True).clamp(max=p.shape[-1] - 1)
    ok = p.gather(-1, i) > 0
    return torch.where(ok, i, p.argmax(-1, keepdim=True)).squeeze(-1)


def draft_tokens(q, seed, positions):
    """Drafts from the drafter's per-slot q [B, γ, V] for the tokens at positions [B, γ]."""
    return sample(q, uniform(seed[:, None], positions, DRAFT))


def draft_positions(seq_len, g: int):
    """[B, g]: the absolute positions of a step's γ = g drafts (slot j of the block predicts seq_len + j)."""
    import torch

    return seq_len[:, None] + 1 + torch.arange(g, device=seq_len.device)


def selector_draws(rp: dict, seq_len, g: int):
    """A DFlash2 drafter draws its drafts inside drafter_block: (temperature [B], u [B, γ]) float32, u from the
    same DRAFT stream draft_tokens uses."""
    import torch

    return rp["temperature"].to(torch.float32), uniform(rp["seed"][:, None], draft_positions(seq_len, g), DRAFT)


def selector_q(dout: dict):
    """The DFlash2 drafts' q [B, γ, V]: the selector's distributions cand_q over its candidates cand (distinct
    ids per slot), zero elsewhere, so speculative_accept's residual max(0, p - q) is the reference's."""
    import torch

    cand, cq = dout["cand"], dout["cand_q"].float()
    q = torch.zeros(*cand.shape[:2], dout["logits"].shape[-1], dtype=cq.dtype, device=cq.device)
    return q.scatter(-1, cand, cq)


def speculative_accept(p, q, drafts, seed, positions):
    """Rejection sampling of γ drafts. p [B, γ+1, V]: the target's probabilities at the verify rows (row j
    predicts the token at positions[:, j]); q [B, γ, V]: the distributions the drafts [B, γ] were drawn from;
    seed [B]; positions [B, γ+1]. Returns (tokens [B, γ+1], n [B]): the emitted tokens are tokens[b, :n[b]]
    (the accepted drafts, then the residual or bonus token), n = accepted + 1."""
    import torch

    B, g = drafts.shape
    pd = p[:, :g].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    ok = uniform(seed[:, None], positions[:, :g], ACCEPT) * qd < pd  # P = min(1, pd/qd); qd = 0 < pd: accept
    acc = ok.to(torch.int64).cumprod(1).sum(1)
    resid = (p[:, :g] - q).clamp(min=0)
    # p == q (up to rounding) leaves no residual mass: then a rejection is a rounding artefact; draw from p
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p[:, :g])
    dist = torch.cat([resid, p[:, g:]], 1)
    rows = torch.arange(B, device=drafts.device)
    final = sample(dist[rows, acc], uniform(seed, positions[rows, acc], RESIDUAL))
    tokens = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1).scatter(1, acc[:, None], final[:, None])
    return tokens, acc + 1


def row_tensors(params: dict, device):
    """row_params' numpy arrays (or the device's int64 step-buffer views, floats as float64 bits) -> tensors."""
    import torch

    out = {}
    for k, v in params.items():
        if isinstance(v, torch.Tensor):  # a step buffer view: int64 storage, floats bit-cast
            out[k] = v if k in ("top_k", "seed") else v.view(torch.float64)
        else:
            out[k] = torch.from_numpy(np.ascontiguousarray(v)).to(device)
    return out


def token_probs(logits, rp: dict):
    """probs() with the parameters of row_tensors."""
    return probs(logits, rp["temperature"], rp["top_k"], rp["top_p"], rp["min_p"])


class HostSampler:
    """The host executor's adapter: graph outputs (numpy, or torch tensors) in, numpy tokens out, over the same
    functions the fused step calls. One per step; it keeps the drafts' q between drafts() and accept()."""

    def __init__(self, params: dict):
        self.params = params
        self.q = None

    def _t(self, x):
        import torch

        return x.float() if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x)).float()

    def _rp(self, like):
        return row_tensors(self.params, like.device)

    def first(self, logits, pos) -> np.ndarray:
        """One token per row from logits [B, V]; pos [B]: the absolute position of the token."""
        import torch

        lg = self._t(logits)
        rp = self._rp(lg)
        pos = torch.as_tensor(np.asarray(pos, dtype=np.int64), device=lg.device)
        return sample(token_probs(lg, rp), uniform(rp["seed"], pos, TOKEN)).cpu().numpy()

    def drafts(self, dlogits, seq_len) -> np.ndarray:
        """γ drafts from the drafter's slot logits [B, γ, V] (slot j -> the token at seq_len + 1 + j)."""
        import torch

        lg = self._t(dlogits)
        rp = self._rp(lg)
        self.q = token_probs(lg, rp)
        pos = draft_positions(torch.as_tensor(np.asarray(seq_len), device=lg.device), lg.shape[1])
        return draft_tokens(self.q, rp["seed"], pos).cpu().numpy()

    def draws(self, seq_len, g: int) -> tuple:
        """selector_draws as numpy (the DFlash2 drafter_block inputs temperature, draft_u)."""
        import torch

        sl = torch.as_tensor(np.asarray(seq_len, dtype=np.int64))
        t, u = selector_draws(self._rp(sl), sl, g)
        return t.numpy(), u.numpy()

    def selected(self, dout) -> np.ndarray:
        """The DFlash2 drafts the graph's selector drew; keeps their q (selector_q) for accept()."""
        self.q = selector_q({k: self._t(dout[k]) if k != "cand" else self._ids(dout[k]) for k in
                             ("cand", "cand_q", "logits")})
        return np.asarray(self._ids(dout["drafts"]).cpu().numpy())

    def _ids(self, x):
        import torch

        return x.long() if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x)).long()

    def accept(self, logits, drafts, seq_len):
        """speculative_accept on the verify logits [B, γ+1, V] -> (tokens [B, γ+1], n [B]) numpy."""
        import torch

        lg = self._t(logits)
        rp = self._rp(lg)
        d = torch.as_tensor(np.asarray(drafts), device=lg.device)
        pos = torch.as_tensor(np.asarray(seq_len), device=lg.device)[:, None] + 1 + \
            torch.arange(lg.shape[1], device=lg.device)
        tok, n = speculative_accept(token_probs(lg, rp), self.q.to(lg.device), d, rp["seed"], pos)
        return tok.cpu().numpy(), n.cpu().numpy()
