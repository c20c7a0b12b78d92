"""Verification: the vectorised functions against slow loops, and rejection sampling's output law.

The output of ``verify_sampling`` must be distributed exactly as the target: checked analytically
(its randomness replaced by controlled values, so every branch's probability is read off the
function itself), then empirically, with a bound that a deliberately wrong residual fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentspec import verify as verify_module
from agentspec.verify import verify_greedy, verify_sampling

# -- reference loops ---------------------------------------------------------------------------------


def reference_sampling(target_probs, draft_tokens, draft_probs, generator):
    """Leviathan et al. Algorithm 1, one position at a time.

    Same random draws in the same order as the documented contract: K uniforms, then one categorical.
    """
    k = len(draft_tokens)
    uniforms = torch.rand(k, generator=generator)
    for i in range(k):
        x = int(draft_tokens[i])
        p = float(target_probs[i, x])
        q = float(draft_probs[i, x]) if draft_probs is not None else 1.0
        # accept with probability min(1, p / q); u * q < p is that test without dividing
        # (float32 * float32 is exact in float64)
        if float(uniforms[i]) * q < p:
            continue
        if draft_probs is not None:
            q_row = draft_probs[i]
        else:
            q_row = torch.zeros_like(target_probs[i])
            q_row[x] = 1.0
        residual = (target_probs[i] - q_row).clamp_min(0.0)
        distribution = residual / residual.sum() if residual.sum() > 0 else target_probs[i]
        return i, int(torch.multinomial(distribution, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def reference_greedy(target_tokens, draft_tokens):
    for i, token in enumerate(draft_tokens.tolist()):
        if int(target_tokens[i]) != token:
            return i, int(target_tokens[i])
    k = len(draft_tokens)
    return k, int(target_tokens[k])


def broken_sampling(target_probs, draft_tokens, draft_probs, generator):
    """A plausible bug: the recovered token drawn from p instead of norm(max(p - q, 0))."""
    k = draft_tokens.shape[0]
    positions = torch.arange(k)
    p_draft = target_probs[positions, draft_tokens]
    q_draft = draft_probs[positions, draft_tokens] if draft_probs is not None else torch.ones_like(p_draft)
    uniforms = torch.rand(k, generator=generator)
    rejected = (uniforms * q_draft >= p_draft).nonzero()
    accepted = int(rejected[0]) if rejected.numel() else k
    token = torch.multinomial(target_probs[accepted], 1, generator=generator)
    return accepted, int(token)


# -- random cases --------------------------------------------------------------------------------------


def random_distribution(vocab: int, gen: torch.Generator, zeros: bool) -> torch.Tensor:
    weights = -torch.rand(vocab, generator=gen).log()  # Dirichlet(1)
    if zeros:  # filtered tokens (top-k/top-p) have probability exactly 0
        mask = torch.rand(vocab, generator=gen) < 0.4
        mask[torch.randint(vocab, (1,), generator=gen)] = False
        weights[mask] = 0.0
    return weights / weights.sum()


def random_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(2, 9, (1,), generator=gen))
    k = int(torch.randint(0, 6, (1,), generator=gen))
    zeros = bool(torch.rand(1, generator=gen) < 0.5)
    target = torch.stack([random_distribution(vocab, gen, zeros) for _ in range(k + 1)])
    with_probs = bool(torch.rand(1, generator=gen) < 0.5)
    if with_probs:
        draft_probs = torch.stack([random_distribution(vocab, gen, zeros) for _ in range(k)]) if k else torch.zeros(0, vocab)
        draft = torch.stack([torch.multinomial(draft_probs[i], 1, generator=gen)[0] for i in range(k)]) if k else torch.zeros(0, dtype=torch.long)
    else:
        draft_probs = None
        # mostly the target's favourite (so runs get accepted), sometimes anything (incl. p = 0)
        favourite = target[:k].argmax(dim=-1)
        anything = torch.randint(vocab, (k,), generator=gen)
        draft = torch.where(torch.rand(k, generator=gen) < 0.6, favourite, anything)
    return target, draft.long(), draft_probs


@pytest.mark.parametrize("block", range(8))
def test_sampling_matches_reference_loop(block):
    outcomes = set()
    for seed in range(block * 250, (block + 1) * 250):
        target, draft, draft_probs = random_case(seed)
        g1 = torch.Generator().manual_seed(10_000 + seed)
        g2 = torch.Generator().manual_seed(10_000 + seed)
        got = verify_sampling(target, draft, draft_probs, g1)
        want = reference_sampling(target, draft, draft_probs, g2)
        assert got == want, (seed, target, draft, draft_probs)
        # both consumed the same random numbers
        assert torch.equal(g1.get_state(), g2.get_state())
        outcomes.add((got[0] == len(draft), draft_probs is None))
    # every combination of (all accepted?, one-hot drafts?) was exercised
    assert outcomes == {(True, True), (True, False), (False, True), (False, False)}


def test_sampling_with_default_generator_is_reproducible():
    target, draft, probs = random_case(3)
    torch.manual_seed(7)
    first = verify_sampling(target, draft, probs, None)
    torch.manual_seed(7)
    assert verify_sampling(target, draft, probs, None) == first


# (target argmax per position, draft) -> (accepted, token), worked out by hand
GREEDY_TABLE = [
    ([4], [], (0, 4)),
    ([1, 2, 3], [1, 2], (2, 3)),
    ([1, 2, 3], [1, 5], (1, 2)),
    ([1, 2, 3], [0, 2], (0, 1)),
    ([7, 7, 7, 7], [7, 7, 7], (3, 7)),
    ([7, 8, 7, 7], [7, 7, 7], (1, 8)),
]


@pytest.mark.parametrize(("target", "draft", "expected"), GREEDY_TABLE)
def test_greedy_table(target, draft, expected):
    assert verify_greedy(torch.tensor(target), torch.tensor(draft, dtype=torch.long)) == expected


def test_greedy_matches_reference_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        k = int(torch.randint(0, 7, (1,), generator=gen))
        vocab = int(torch.randint(1, 4, (1,), generator=gen))  # tiny vocabularies: many matches
        target = torch.randint(vocab, (k + 1,), generator=gen)
        draft = torch.randint(vocab, (k,), generator=gen)
        assert verify_greedy(target, draft) == reference_greedy(target, draft)


# -- the output law --------------------------------------------------------------------------------------

P = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0])  # a target with filtered (zero) tokens
Q = torch.tensor([0.1, 0.2, 0.3, 0.1, 0.3, 0.0])  # a draft putting mass where p has none
BONUS = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])  # the K+1-th row: irrelevant to the first token

DRAFTERS = {
    # name: (distribution the drafted token is drawn from, draft_probs row or None for one-hot drafts)
    "one-hot-favourite": (torch.tensor([1.0, 0, 0, 0, 0, 0]), None),
    "one-hot-zero-prob": (torch.tensor([0, 0, 0, 0, 1.0, 0]), None),
    # not uniform: with uniformly random one-hot drafts the wrong residual below happens to give p
    "one-hot-random": (torch.tensor([0.4, 0.3, 0.1, 0.05, 0.1, 0.05]), None),
    "q": (Q, Q),
}


class _Controlled:
    """Replaces torch.rand / torch.multinomial inside ``agentspec.verify`` with chosen values."""

    def __init__(self, uniform: float):
        self.uniform = uniform
        self.categorical: torch.Tensor | None = None

    def rand(self, k, generator=None, device=None):
        return torch.full((k,), self.uniform)

    def multinomial(self, distribution, n, generator=None):
        self.categorical = distribution.clone()
        return torch.zeros(n, dtype=torch.long)


def first_token_law(function, monkeypatch, x: int, draft_probs) -> torch.Tensor:
    """The exact distribution of the first committed token given the drafted token x (K = 1).

    The uniform is swept to find the acceptance threshold (acceptance is "u below a threshold"),
    and the categorical distribution each branch samples from is captured.
    """
    target = torch.stack([P, BONUS])
    draft = torch.tensor([x])
    probs = draft_probs.unsqueeze(0) if draft_probs is not None else None

    def run(uniform: float):
        controlled = _Controlled(uniform)
        monkeypatch.setattr(verify_module.torch, "rand", controlled.rand)
        monkeypatch.setattr(verify_module.torch, "multinomial", controlled.multinomial)
        try:
            accepted, _ = function(target, draft, probs, None)
        finally:
            monkeypatch.undo()
        return accepted, controlled.categorical

    accepted_at_zero, _ = run(0.0)
    accepted_below_one, rejected_law = run(1.0 - 1e-7)
    if accepted_at_zero == 0:  # never accepted
        accept = 0.0
    elif accepted_below_one == 1:  # always accepted
        accept = 1.0
    else:  # bisect the threshold
        lo, hi = 0.0, 1.0 - 1e-7
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if run(mid)[0] == 1 else (lo, mid)
        accept = lo
    # the assumption behind the sweep: accepted exactly when u is below the threshold
    for u in torch.linspace(0, 1 - 1e-7, 41).tolist():
        assert run(u)[0] == int(u < accept) or abs(u - accept) < 1e-9
    law = torch.zeros(len(P), dtype=torch.float64)
    law[x] += accept
    if accept < 1.0:
        law += (1.0 - accept) * rejected_law.double() / rejected_law.double().sum()
    return law


def exact_output_law(function, monkeypatch, drafter: str) -> torch.Tensor:
    draw_from, draft_probs = DRAFTERS[drafter]
    law = torch.zeros(len(P), dtype=torch.float64)
    for x in range(len(P)):
        if draw_from[x] > 0:
            law += float(draw_from[x]) * first_token_law(function, monkeypatch, x, draft_probs)
    return law


def analytic_output_law(draw_from: torch.Tensor, draft_probs) -> torch.Tensor:
    """P(out = y) = sum_x q(x) [a(x) 1(y = x) + (1 - a(x)) r_x(y)], a = min(1, p/q), r_x = norm(max(p - q_x, 0))."""
    p = P.double()
    law = torch.zeros_like(p)
    for x in range(len(p)):
        qx = float(draw_from[x])
        if qx == 0:
            continue
        q_row = draft_probs.double() if draft_probs is not None else torch.nn.functional.one_hot(torch.tensor(x), len(p)).double()
        a = min(1.0, float(p[x]) / float(q_row[x]))
        residual = (p - q_row).clamp_min(0)
        r = residual / residual.sum() if residual.sum() > 0 else p
        law[x] += qx * a
        law += qx * (1 - a) * r
    return law


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_exact_output_law_is_the_target(drafter, monkeypatch):
    draw_from, draft_probs = DRAFTERS[drafter]
    analytic = analytic_output_law(draw_from, draft_probs)
    assert torch.allclose(analytic, P.double(), atol=1e-12)  # the algorithm is lossless ...
    law = exact_output_law(verify_sampling, monkeypatch, drafter)
    assert torch.allclose(law, analytic, atol=1e-6), law  # ... and the function implements it


@pytest.mark.parametrize("drafter", ["one-hot-favourite", "one-hot-random", "q"])
def test_exact_output_law_of_a_wrong_residual_is_not_the_target(drafter, monkeypatch):
    law = exact_output_law(broken_sampling, monkeypatch, drafter)
    assert 0.5 * float((law - P.double()).abs().sum()) > 0.05, law


DRAWS = 20_000
DELTA = 1e-6  # allowed chance that a correct implementation fails the bound


def tv_bound(p: torch.Tensor, n: int, delta: float) -> float:
    """A bound that the total variation between p and an n-sample empirical law exceeds w.p. <= delta.

    E[TV] <= 1/2 sum_y sqrt(p(y)(1-p(y))/n) (Jensen), and TV changes by at most 1/n when one draw
    changes, so McDiarmid: P(TV > E[TV] + t) <= exp(-2 n t^2).
    """
    mean = 0.5 * float((p * (1 - p) / n).sqrt().sum())
    return mean + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical_first_token(function, drafter: str, seed: int) -> torch.Tensor:
    draw_from, draft_probs = DRAFTERS[drafter]
    target = torch.stack([P, BONUS])
    probs = draft_probs.unsqueeze(0) if draft_probs is not None else None
    drafts = torch.multinomial(draw_from, DRAWS, replacement=True, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(len(P), dtype=torch.float64)
    for x in drafts.tolist():
        accepted, token = function(target, torch.tensor([x]), probs, generator)
        counts[x if accepted == 1 else token] += 1
    return counts / DRAWS


@pytest.mark.parametrize("drafter", ["one-hot-random", "q"])
def test_empirical_first_token_law(drafter):
    bound = tv_bound(P.double(), DRAWS, DELTA)
    assert bound < 0.03  # the bound is tight enough to mean something
    correct = empirical_first_token(verify_sampling, drafter, seed=1)
    assert 0.5 * float((correct - P.double()).abs().sum()) <= bound
    assert float(correct[4:].sum()) == 0.0  # never a token the target filtered out
    # power: the same harness rejects a wrong residual
    wrong = empirical_first_token(broken_sampling, drafter, seed=1)
    assert 0.5 * float((wrong - P.double()).abs().sum()) > bound
