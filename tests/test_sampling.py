"""Sampling math (runtime/sampling.py) against independent oracles: the counter-based uniforms against a pure-Python
splitmix64, the logits transform against a per-row numpy reference, and speculative rejection sampling in
distribution: the first 3 tokens of a small order-2 Markov target (V = 5) sampled DFlash-style (drafts from a
non-autoregressive q per slot, rejection sampling against p, counter-based draws keyed like the runtime's) vs plain
sampling vs the exact distribution by enumeration: chi-square and total variation over 20k samples, for
T in {0.7, 1.0}, top-k / top-p / min-p on and off, a random, a good and a zero-mass drafter. A negative control
(drafts accepted without the test) must fail the same statistics. Deterministic (fixed seeds), a few seconds."""
import itertools

import numpy as np
import pytest
import torch

from dflash_trt.runtime import sampling as S

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V, GAMMA, N = 5, 2, 20000
BASE = 7  # absolute position of the first context token


# ---- oracles -----------------------------------------------------------------------------------
def splitmix_ref(seed: int, pos: int, purpose: int) -> float:
    m = (1 << 64) - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    return (mix(mix(mix(seed) ^ pos) ^ purpose) >> 40) / 2**24


def ref_probs(logits, t, k, tp, mp):
    """One row, float64, written as the definitions read: softmax(l/T) -> k most likely -> smallest prefix of
    mass >= top_p (renormalised after top-k) -> >= min_p x max -> renormalise. T = 0: one-hot argmax."""
    logits = np.asarray(logits, np.float64)
    if t == 0:
        out = np.zeros_like(logits)
        out[int(np.argmax(logits))] = 1
        return out
    p = np.exp((logits - logits.max()) / t)
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = order[:k] if k else order
    mass = sum(p[i] for i in kept)
    nucleus, acc = [], 0.0
    for i in kept:
        if tp < 1 and acc >= tp * mass:
            break
        nucleus.append(i)
        acc += p[i]
    top = max(p[i] for i in nucleus)
    final = [i for i in nucleus if p[i] >= mp * top]
    out = np.zeros_like(p)
    out[final] = p[final]
    return out / out.sum()


def chi2_pvalue(counts, expected):
    """Pearson chi-square over cells with expected >= 5 (the rest pooled into one cell); upper tail by the
    regularised incomplete gamma (torch.special.gammaincc)."""
    counts, expected = np.asarray(counts, np.float64), np.asarray(expected, np.float64)
    big = expected >= 5
    c = np.append(counts[big], counts[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    c, e = c[e > 0], e[e > 0]
    stat = float(((c - e) ** 2 / e).sum())
    df = len(e) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def tv_noise(p, n):
    """Expected total-variation distance of an n-sample empirical distribution from p (normal approximation)."""
    p = np.asarray(p, np.float64)
    return 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * n))))


# ---- the small world -----------------------------------------------------------------------------
GEN = torch.Generator().manual_seed(1234)
L = torch.randn(V, V, V, generator=GEN) * 1.5  # target logits of the next token after (a, b)
CTX = (3, 1)
CASES = [(0.7, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 3, 0.9, 0.1)]


def params(t, k, tp, mp, n=N):
    return {"temperature": torch.full((n,), t, dtype=torch.float64), "top_k": torch.full((n,), k, dtype=torch.int64),
            "top_p": torch.full((n,), tp, dtype=torch.float64), "min_p": torch.full((n,), mp, dtype=torch.float64),
            "seed": torch.arange(n, dtype=torch.int64) * 7919 + 11}


def drafter_logits(kind, prev, bonus):
    """q logits [n, γ, V] for the γ slots after `bonus` — a function of the context only, never of the drafts
    (DFlash drafts a block in one forward)."""
    n = bonus.shape[0]
    if kind == "random":
        tab = torch.randn(GAMMA, V, V, generator=torch.Generator().manual_seed(7)) * 2.0
        return tab[:, bonus].transpose(0, 1)
    if kind == "good":  # slot 1 close to the target's next-token logits, slot 2 a guess along its argmax
        noise = torch.randn(2, V, V, V, generator=torch.Generator().manual_seed(8)) * 0.2
        q1 = L[prev, bonus] + noise[0, prev, bonus]
        q2 = L[bonus, q1.argmax(-1)] + noise[1, prev, bonus]
        return torch.stack([q1, q2], 1)
    if kind == "zero":  # no mass at all on tokens 0 and 1, which the target gives mass
        q = torch.randn(n, GAMMA, V, generator=torch.Generator().manual_seed(9))
        q[:, :, :2] = float("-inf")
        return q
    raise ValueError(kind)


def dflash_first3(rp, kind, accept=S.speculative_accept):
    """Prefill sample of x1, then speculative steps of γ drafts until 3 tokens: the runtime's keys (token at
    absolute position P decided by draws at P)."""
    n = rp["seed"].shape[0]
    rows = torch.arange(n)
    hist = torch.zeros(n, 2 + 3 + GAMMA + 1, dtype=torch.int64)
    hist[:, 0], hist[:, 1] = CTX
    hist[:, 2] = S.sample(S.token_probs(L[hist[:, 0], hist[:, 1]], rp), S.uniform(rp["seed"], BASE + 2, S.TOKEN))
    length = torch.full((n,), 3, dtype=torch.int64)
    while (length < 5).any():
        prev, bonus = hist[rows, length - 2], hist[rows, length - 1]
        pos0 = BASE + length - 1  # the bonus token's position
        q = S.token_probs(drafter_logits(kind, prev, bonus), rp)
        drafts = S.draft_tokens(q, rp["seed"], pos0[:, None] + 1 + torch.arange(GAMMA))
        seq = torch.cat([prev[:, None], bonus[:, None], drafts], 1)
        p = S.token_probs(L[seq[:, :-1], seq[:, 1:]], rp)  # row j: next token after (seq[j], seq[j+1])
        tok, cnt = accept(p, q, drafts, rp["seed"], pos0[:, None] + 1 + torch.arange(GAMMA + 1))
        active = length < 5
        for j in range(GAMMA + 1):
            w = active & (j < cnt)
            hist[rows[w], length[w] + j] = tok[w, j]
        length = length + cnt * active
    return hist[:, 2:5]


def plain_first3(rp):
    n = rp["seed"].shape[0]
    toks = [torch.full((n,), CTX[0]), torch.full((n,), CTX[1])]
    for i in range(3):
        pr = S.token_probs(L[toks[-2], toks[-1]], rp)
        toks.append(S.sample(pr, S.uniform(rp["seed"], BASE + 2 + i, S.TOKEN)))
    return torch.stack(toks[2:], 1)


def exact_first3(t, k, tp, mp):
    out = np.zeros(V ** 3)
    for x1, x2, x3 in itertools.product(range(V), repeat=3):
        out[(x1 * V + x2) * V + x3] = (ref_probs(L[CTX[0], CTX[1]], t, k, tp, mp)[x1]
                                       * ref_probs(L[CTX[1], x1], t, k, tp, mp)[x2]
                                       * ref_probs(L[x1, x2], t, k, tp, mp)[x3])
    return out


def counts(first3):
    idx = (first3[:, 0] * V + first3[:, 1]) * V + first3[:, 2]
    return np.bincount(idx.numpy(), minlength=V ** 3)


# ---- tests ---------------------------------------------------------------------------------------


def test_uniform_is_splitmix64_keyed_by_seed_position_purpose():
    seeds = [0, 1, 12345, 2**62 + 17, 2**63 - 1]
    for s in seeds:
        for pos in (0, 1, 1000, 2**40):
            for purpose in (S.TOKEN, S.DRAFT, S.ACCEPT, S.RESIDUAL):
                got = float(S.uniform(torch.tensor(s), torch.tensor(pos), purpose))
                assert got == splitmix_ref(s, pos, purpose)
    u = S.uniform(torch.arange(100000), torch.tensor(5), S.TOKEN)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005


def test_probs_match_the_reference_transform():
    lg = torch.randn(64, 3, 11, generator=torch.Generator().manual_seed(3)) * 2
    for t, k, tp, mp in [(1.0, 0, 1.0, 0.0), (0.5, 4, 1.0, 0.0), (1.3, 0, 0.7, 0.0), (0.8, 6, 0.9, 0.05),
                         (1.0, 0, 1.0, 0.2), (0.0, 3, 0.5, 0.3), (2.0, 1, 1.0, 0.0), (1.0, 20, 0.3, 0.0)]:
        got = S.token_probs(lg, params(t, k, tp, mp, 64)).double().numpy()
        ref = np.stack([np.stack([ref_probs(lg[b, j], t, k, tp, mp) for j in range(3)]) for b in range(64)])
        assert np.abs(got - ref).max() < 1e-6, (t, k, tp, mp)


def test_sample_never_picks_zero_mass():
    p = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 4)
    u = torch.tensor([0.0, 0.3, 0.9999, 1 - 2**-24])
    assert S.sample(p, u).tolist() == [1, 3, 3, 3]
    assert S.sample(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([1 - 2**-24])).tolist() == [2]


def test_temperature_zero_rejection_sampling_is_greedy_accept():
    g = torch.Generator().manual_seed(5)
    B, gamma = 256, 6
    tl, dl = torch.randn(B, gamma + 1, 7, generator=g), torch.randn(B, gamma, 7, generator=g)
    dl[: B // 2] = tl[: B // 2, :gamma] + 0.01 * dl[: B // 2]  # half the rows: drafter mostly right
    rp = params(0.0, 0, 1.0, 0.0, B)
    q = S.token_probs(dl, rp)
    pos = torch.arange(B)[:, None] * 100 + 1 + torch.arange(gamma + 1)
    drafts = S.draft_tokens(q, rp["seed"], pos[:, :gamma])
    assert torch.equal(drafts, dl.argmax(-1))
    tok, n = S.speculative_accept(S.token_probs(tl, rp), q, drafts, rp["seed"], pos)
    am = tl.argmax(-1)
    acc = torch.cumprod((drafts == am[:, :gamma]).long(), 1).sum(1)  # the greedy accept of the runtime
    assert torch.equal(n, acc + 1) and len(set(n.tolist())) > 2
    for b in range(B):
        assert tok[b, : n[b]].tolist() == am[b, : n[b]].tolist()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-k{}-p{}-m{}".format(*c))
@pytest.mark.parametrize("drafter", ["random", "good", "zero"])
def test_first_three_tokens_exact_in_distribution(case, drafter):
    exact = exact_first3(*case)
    rp = params(*case)
    got = dflash_first3(rp, drafter)
    plain = plain_first3(params(*case))
    bound = 1.5 * tv_noise(exact, N)
    for name, first3 in (("dflash", got), ("plain", plain)):
        c = counts(first3)
        tv = 0.5 * np.abs(c / N - exact).sum()
        pv = chi2_pvalue(c, exact * N)
        assert tv < bound and pv > 1e-4, (name, drafter, case, tv, bound, pv)
    tv2 = 0.5 * np.abs(counts(got) / N - counts(plain) / N).sum()
    assert tv2 < 2 * bound, (drafter, case, tv2)


def test_negative_control_accepting_drafts_blindly_is_caught():
    """The statistics have power: a 'speculative' step that keeps every draft (no rejection) is detected."""
    def blind(p, q, drafts, seed, positions):
        final = S.sample(p[:, -1], S.uniform(seed, positions[:, -1], S.RESIDUAL))
        return torch.cat([drafts, final[:, None]], 1), torch.full_like(seed, drafts.shape[1] + 1)

    case = CASES[1]
    exact = exact_first3(*case)
    c = counts(dflash_first3(params(*case), "random", accept=blind))
    assert chi2_pvalue(c, exact * N) < 1e-6 and 0.5 * np.abs(c / N - exact).sum() > 3 * tv_noise(exact, N)


def test_same_seed_same_draws_different_seed_different():
    rp = params(1.0, 0, 1.0, 0.0, 2000)
    a, b = dflash_first3(rp, "random"), dflash_first3(rp, "random")
    assert torch.equal(a, b)
    rp2 = dict(rp, seed=rp["seed"] + 1)
    assert (dflash_first3(rp2, "random") != a).any(1).float().mean() > 0.3


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(min_p=-0.1), dict(min_p=1.5), dict(seed=-3), dict(temperature=float("nan")),
                                 dict(top_k=2.5), dict(seed=2**63)])
def test_bad_params_refused(bad):
    with pytest.raises(S.SamplingError):
        S.SamplingParams(**bad)
    assert issubclass(S.SamplingError, ValueError)


def test_params_seed_resolution():
    assert S.SamplingParams().resolved().seed is None  # greedy needs none
    a = S.SamplingParams(temperature=0.5).resolved()
    assert a.seed is not None and a.resolved() is a
    assert S.SamplingParams(temperature=0.5, seed=9).resolved().seed == 9
