"""Verification: the vectorised functions against slow loops, and rejection sampling's output law.

Both verifiers take a whole target pass, flattened: sequence s owns ``counts[s] + 1`` consecutive
rows (its draft positions, then its bonus row, whose draft token is NO_TOKEN). Each is checked
against a one-sequence loop on random cases, and a batch of random sequences flattened into one call
must give exactly what each sequence gives alone.

The output of ``verify_sampling`` must be distributed exactly as the target: checked analytically
(its randomness is an input, the uniforms, so every branch's probability is read off the function
itself by sweeping them), then empirically, with a bound that a deliberately wrong residual fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentspec.engine.verify import NO_TOKEN, draft_distributions, verify_greedy, verify_sampling

# -- reference loops ---------------------------------------------------------------------------------


def inverse_cdf(distribution: list[float], u: float) -> int:
    """The token y with F(y-) <= u * total < F(y), F the running sum: a draw from the normalised
    distribution when u ~ U[0, 1). A plain loop over the distribution (no torch.searchsorted)."""
    total = 0.0
    for mass in distribution:
        total += mass
    threshold = u * total
    cumulative, last = 0.0, None
    for y, mass in enumerate(distribution):
        if mass <= 0:
            continue  # an impossible token is never drawn
        cumulative += mass
        last = y
        if threshold < cumulative:
            return y
    return last  # u * total rounded up to the total: the last possible token


def reference_sampling(target_probs, draft_tokens, draft_probs, uniforms):
    """Leviathan et al. Algorithm 1 for one sequence, one position at a time.

    target_probs: [K+1, V]; draft_tokens: [K]; draft_probs: [K, V] a draft model's rows, or None for
    deterministic (one-hot) drafts; uniforms: [K+1]. The documented contract: uniforms[i] tests draft
    token i, the last one draws the recovered or bonus token by inverse CDF.
    """
    k = len(draft_tokens)
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
        distribution = residual if residual.sum() > 0 else target_probs[i]
        return i, inverse_cdf(distribution.tolist(), float(uniforms[k]))
    return k, inverse_cdf(target_probs[k].tolist(), float(uniforms[k]))


def reference_greedy(target_tokens, draft_tokens):
    for i, token in enumerate(draft_tokens.tolist()):
        if int(target_tokens[i]) != token:
            return i, int(target_tokens[i])
    k = len(draft_tokens)
    return k, int(target_tokens[k])


def broken_sampling(target_probs, draft_tokens, draft_probs, uniforms, counts):
    """A plausible bug: the recovered token drawn from p instead of norm(max(p - q, 0)).

    Same signature as ``verify_sampling``; the acceptance test and the draw (inverse CDF with each
    sequence's last uniform) are the real ones, only the residual is wrong.
    """
    accepted, _ = verify_sampling(target_probs, draft_tokens, draft_probs, uniforms, counts)
    ends = torch.cumsum(counts + 1, 0) - 1  # each sequence's bonus row
    p = target_probs[ends - counts + accepted]  # [S, V] the target at each first rejected (or bonus) row
    # every sequence reduced to a bonus row alone, whose draft distribution is zero: a draw from p
    _, tokens = verify_sampling(p, torch.full_like(counts, NO_TOKEN), torch.zeros_like(p), uniforms[ends], torch.zeros_like(counts))
    return accepted, tokens


# -- one sequence, and many flattened into one pass ----------------------------------------------------


def flatten(sequences):
    """One pass's inputs from per-sequence cases (target [K+1, V], draft [K], the draft model's rows
    [K, V] or None, uniforms [K+1]), as the engine builds them."""
    vocab = sequences[0][0].shape[1]
    target = torch.cat([target for target, _, _, _ in sequences])
    drafted = torch.cat([torch.cat([draft, torch.tensor([NO_TOKEN])]) for _, draft, _, _ in sequences])
    rows = torch.cat([draft_distributions(draft, probs, vocab) for _, draft, probs, _ in sequences])
    uniforms = torch.cat([uniforms for _, _, _, uniforms in sequences])
    counts = torch.tensor([len(draft) for _, draft, _, _ in sequences])
    return target, drafted, rows, uniforms, counts


def sample_one(function, target, draft, draft_probs, uniforms) -> tuple[int, int]:
    """A verifier with ``verify_sampling``'s signature, on one sequence (counts = [K])."""
    accepted, tokens = function(*flatten([(target, draft, draft_probs, uniforms)]))
    assert accepted.shape == tokens.shape == (1,)
    return int(accepted[0]), int(tokens[0])


def greedy_one(target, draft) -> tuple[int, int]:
    accepted, tokens = verify_greedy(target, torch.cat([draft, torch.tensor([NO_TOKEN])]), torch.tensor([len(draft)]))
    assert accepted.shape == tokens.shape == (1,)
    return int(accepted[0]), int(tokens[0])


# -- random cases --------------------------------------------------------------------------------------


def random_distribution(vocab: int, gen: torch.Generator, zeros: bool) -> torch.Tensor:
    weights = -torch.rand(vocab, generator=gen).log()  # Dirichlet(1)
    if zeros:  # filtered tokens (top-k/top-p) have probability exactly 0
        mask = torch.rand(vocab, generator=gen) < 0.4
        mask[torch.randint(vocab, (1,), generator=gen)] = False
        weights[mask] = 0.0
    return weights / weights.sum()


def random_case(seed: int, vocab: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    drawn = int(torch.randint(2, 9, (1,), generator=gen))
    vocab = drawn if vocab is None else vocab
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


def case_uniforms(seed: int, draft: torch.Tensor) -> torch.Tensor:
    """K + 1 uniforms, drawn as the engine draws them."""
    return torch.rand(len(draft) + 1, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block", range(8))
def test_sampling_matches_reference_loop(block):
    outcomes = set()
    for seed in range(block * 250, (block + 1) * 250):
        target, draft, draft_probs = random_case(seed)
        uniforms = case_uniforms(10_000 + seed, draft)
        got = sample_one(verify_sampling, target, draft, draft_probs, uniforms)
        want = reference_sampling(target, draft, draft_probs, uniforms)
        assert got == want, (seed, target, draft, draft_probs, uniforms)
        # both read the same uniforms: those of the rows tested and the last one, no other
        accepted, k = got[0], len(draft)
        if accepted + 1 < k:
            unread = uniforms.clone()
            unread[accepted + 1 : k] = torch.rand(k - accepted - 1, generator=torch.Generator().manual_seed(20_000 + seed))
            assert sample_one(verify_sampling, target, draft, draft_probs, unread) == got, seed
        outcomes.add((accepted == k, draft_probs is None))
    # every combination of (all accepted?, one-hot drafts?) was exercised
    assert outcomes == {(True, True), (True, False), (False, True), (False, False)}


def test_sampling_is_a_function_of_its_uniforms():
    target, draft, probs = random_case(3)
    uniforms = case_uniforms(7, draft)
    first = sample_one(verify_sampling, target, draft, probs, uniforms)
    assert sample_one(verify_sampling, target, draft, probs, uniforms.clone()) == first
    # drawn the engine's way from the same seed: the same verdict
    assert sample_one(verify_sampling, target, draft, probs, case_uniforms(7, draft)) == first


@pytest.mark.parametrize("block", range(4))
def test_sampling_batch_equals_each_sequence_alone(block):
    """Many random sequences (mixed K, K = 0 included, one-hot and model drafts) flattened into one
    call give exactly what each gives alone, which is the reference's."""
    seen = set()
    for batch in range(block * 60, (block + 1) * 60):
        gen = torch.Generator().manual_seed(30_000 + batch)
        vocab = int(torch.randint(2, 9, (1,), generator=gen))
        size = int(torch.randint(1, 9, (1,), generator=gen))
        sequences = []
        for j in range(size):
            target, draft, draft_probs = random_case(100_000 + 16 * batch + j, vocab)
            sequences.append((target, draft, draft_probs, torch.rand(len(draft) + 1, generator=gen)))
        accepted, tokens = verify_sampling(*flatten(sequences))
        assert accepted.shape == tokens.shape == (size,)
        together = list(zip(accepted.tolist(), tokens.tolist()))
        alone = [sample_one(verify_sampling, *sequence) for sequence in sequences]
        assert together == alone, (batch, sequences)
        assert alone == [reference_sampling(*sequence) for sequence in sequences], batch
        for (n, _), (_, draft, draft_probs, _) in zip(together, sequences):
            seen.add((len(draft) == 0, n == len(draft), draft_probs is None))
    # K = 0 sequences, drafts accepted whole and cut short, one-hot and model drafts all took part
    assert {(True, True, True), (True, True, False)} <= seen
    assert {(False, a, b) for a in (True, False) for b in (True, False)} <= seen


def test_draft_distributions_rows():
    vocab = 5
    draft = torch.tensor([3, 0, 4])
    one_hot = draft_distributions(draft, None, vocab)
    assert one_hot.shape == (4, vocab)
    assert torch.equal(one_hot[:3], torch.nn.functional.one_hot(draft, vocab).float())
    assert torch.equal(one_hot[3], torch.zeros(vocab))  # the bonus row: nothing proposed
    model = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.0, 0.0, 0.5, 0.0, 0.5]])
    mixed = draft_distributions(draft, model, vocab)  # a grammar token, then two of a draft model's
    assert torch.equal(mixed[0], one_hot[0])
    assert torch.equal(mixed[1:3], model)
    assert torch.equal(mixed[3], torch.zeros(vocab))
    assert torch.equal(draft_distributions(torch.zeros(0, dtype=torch.long), None, vocab), torch.zeros(1, vocab))
    assert torch.equal(draft_distributions(torch.zeros(0, dtype=torch.long), torch.zeros(0, vocab), vocab), torch.zeros(1, vocab))


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
    assert greedy_one(torch.tensor(target), torch.tensor(draft, dtype=torch.long)) == expected


def test_greedy_table_as_one_pass():
    """The whole table flattened into one call: each row's verdict, as alone."""
    target = torch.tensor([t for row, _, _ in GREEDY_TABLE for t in row])
    drafted = torch.tensor([t for _, d, _ in GREEDY_TABLE for t in (*d, NO_TOKEN)])
    counts = torch.tensor([len(d) for _, d, _ in GREEDY_TABLE])
    accepted, tokens = verify_greedy(target, drafted, counts)
    assert list(zip(accepted.tolist(), tokens.tolist())) == [e for _, _, e in GREEDY_TABLE]


def random_greedy_case(gen: torch.Generator):
    k = int(torch.randint(0, 7, (1,), generator=gen))
    vocab = int(torch.randint(1, 4, (1,), generator=gen))  # tiny vocabularies: many matches
    return torch.randint(vocab, (k + 1,), generator=gen), torch.randint(vocab, (k,), generator=gen)


def test_greedy_matches_reference_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        target, draft = random_greedy_case(gen)
        assert greedy_one(target, draft) == reference_greedy(target, draft)


def test_greedy_batch_equals_each_sequence_alone():
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(300):
        cases = [random_greedy_case(gen) for _ in range(int(torch.randint(1, 9, (1,), generator=gen)))]
        target = torch.cat([t for t, _ in cases])
        drafted = torch.cat([torch.cat([d, torch.tensor([NO_TOKEN])]) for _, d in cases])
        accepted, tokens = verify_greedy(target, drafted, torch.tensor([len(d) for _, d in cases]))
        assert accepted.shape == tokens.shape == (len(cases),)
        together = list(zip(accepted.tolist(), tokens.tolist()))
        assert together == [greedy_one(t, d) for t, d in cases] == [reference_greedy(t, d) for t, d in cases]
        seen.update((len(d) == 0, n == len(d)) for (n, _), (_, d) in zip(together, cases))
    assert seen == {(True, True), (False, True), (False, False)}


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

BELOW_ONE = 1.0 - 1e-7  # the largest uniform swept


def draw_law(token_at) -> torch.Tensor:
    """The exact law of ``token_at(u)`` for u ~ U[0, 1), an inverse-CDF draw.

    Such a draw is non-decreasing in u (checked on a grid), so each token's bucket is an interval;
    its ends are found by bisection wherever two probes disagree, and the law is the bucket widths.
    """
    grid = [i / 256 for i in range(256)] + [BELOW_ONE]
    tokens = [token_at(u) for u in grid]
    assert tokens == sorted(tokens), tokens  # the assumption behind the bisection

    def jumps(a: float, ta: int, b: float, tb: int) -> list[tuple[float, int]]:
        """(where, new token) for every change of token in (a, b]."""
        if ta == tb:  # non-decreasing: constant in between
            return []
        if b - a < 1e-10:
            return [(b, tb)]
        mid = (a + b) / 2
        tm = token_at(mid)
        return jumps(a, ta, mid, tm) + jumps(mid, tm, b, tb)

    changes = [change for a, ta, b, tb in zip(grid, tokens, grid[1:], tokens[1:]) for change in jumps(a, ta, b, tb)]
    law = torch.zeros(len(P), dtype=torch.float64)
    start, token = 0.0, tokens[0]
    for where, new in changes:
        law[token] += where - start
        start, token = where, new
    law[token] += 1.0 - start
    return law


def first_token_law(function, x: int, draft_probs) -> torch.Tensor:
    """The exact distribution of the first committed token given the drafted token x (K = 1).

    The acceptance uniform is swept to find the threshold (acceptance is "u below a threshold"), and
    the law of the token drawn at a rejection is read off the last uniform (``draw_law``).
    """
    target = torch.stack([P, BONUS])
    draft = torch.tensor([x])
    probs = draft_probs.unsqueeze(0) if draft_probs is not None else None

    def run(uniform: float, last: float = 0.5) -> tuple[int, int]:
        return sample_one(function, target, draft, probs, torch.tensor([uniform, last]))

    accepted_at_zero, _ = run(0.0)
    accepted_below_one, _ = run(BELOW_ONE)
    if accepted_at_zero == 0:  # never accepted
        accept = 0.0
    elif accepted_below_one == 1:  # always accepted
        accept = 1.0
    else:  # bisect the threshold
        lo, hi = 0.0, BELOW_ONE
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if run(mid)[0] == 1 else (lo, mid)
        accept = lo
    # the assumption behind the sweep: accepted exactly when u is below the threshold
    for u in torch.linspace(0, BELOW_ONE, 41).tolist():
        assert run(u)[0] == int(u < accept) or abs(u - accept) < 1e-9
    law = torch.zeros(len(P), dtype=torch.float64)
    law[x] += accept
    if accept < 1.0:  # rejected at u = BELOW_ONE (above the threshold), whatever the last uniform
        def rejected_token(last: float) -> int:
            accepted, token = run(BELOW_ONE, last)
            assert accepted == 0
            return token

        law += (1.0 - accept) * draw_law(rejected_token)
    return law


def exact_output_law(function, drafter: str) -> torch.Tensor:
    draw_from, draft_probs = DRAFTERS[drafter]
    law = torch.zeros(len(P), dtype=torch.float64)
    for x in range(len(P)):
        if draw_from[x] > 0:
            law += float(draw_from[x]) * first_token_law(function, x, draft_probs)
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


def test_the_bonus_token_law_is_the_target():
    """After K accepted tokens the bonus token is drawn from p (here K = 0: the last uniform alone)."""
    for row in (P, BONUS, torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])):
        law = draw_law(lambda last: sample_one(verify_sampling, row.unsqueeze(0), torch.zeros(0, dtype=torch.long), None, torch.tensor([last]))[1])
        assert torch.allclose(law, row.double(), atol=1e-6), law


def test_the_draw_never_lands_on_an_impossible_token():
    """The inverse CDF at the ends of [0, 1) (torch.rand can return 0) and across it: exactly the
    reference's token, always one with positive mass, whatever zeros surround the support."""
    rows = torch.tensor([
        [0.0, 0.0, 0.3, 0.0, 0.7, 0.0],
        [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        [0.2, 0.0, 0.0, 0.0, 0.0, 0.8],
        [1e-6, 0.0, 0.5, 0.0, 0.0, 0.0],  # unnormalised: the draw normalises
    ])  # fmt: skip
    largest_below_one = 1.0 - 2.0**-24
    for row in rows:
        for u in [0.0, 2.0**-24, *torch.linspace(0, 1, 101)[:-1].tolist(), largest_below_one]:
            token = sample_one(verify_sampling, row.unsqueeze(0), torch.zeros(0, dtype=torch.long), None, torch.tensor([u]))[1]
            assert row[token] > 0 and token == inverse_cdf(row.tolist(), u), (row, u, token)
    # a recovered token: the drafted token 0 is rejected, the residual is p without it
    target = torch.stack([rows[3], BONUS])
    for u in [0.0, largest_below_one]:
        assert sample_one(verify_sampling, target, torch.tensor([0]), None, torch.tensor([largest_below_one, u])) == (0, 5)


def test_an_empty_residual_falls_back_to_the_target():
    """p = q and a drafted token impossible under both (rejected, since u * 0 >= 0): max(p - q, 0)
    is all zeros, and the recovered token is drawn from p."""
    p = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    target = torch.stack([p, BONUS])
    law = draw_law(lambda last: sample_one(verify_sampling, target, torch.tensor([0]), p.unsqueeze(0), torch.tensor([0.0, last]))[1])
    assert torch.allclose(law, p.double(), atol=1e-6), law


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_exact_output_law_is_the_target(drafter):
    draw_from, draft_probs = DRAFTERS[drafter]
    analytic = analytic_output_law(draw_from, draft_probs)
    assert torch.allclose(analytic, P.double(), atol=1e-12)  # the algorithm is lossless ...
    law = exact_output_law(verify_sampling, drafter)
    assert torch.allclose(law, analytic, atol=1e-6), law  # ... and the function implements it


@pytest.mark.parametrize("drafter", ["one-hot-favourite", "one-hot-random", "q"])
def test_exact_output_law_of_a_wrong_residual_is_not_the_target(drafter):
    law = exact_output_law(broken_sampling, drafter)
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
    """DRAWS independent sequences (K = 1), all verified in one flattened call."""
    draw_from, draft_probs = DRAFTERS[drafter]
    probs = draft_probs.unsqueeze(0) if draft_probs is not None else None
    drafts = torch.multinomial(draw_from, DRAWS, replacement=True, generator=torch.Generator().manual_seed(seed))
    uniforms = torch.rand(DRAWS * 2, generator=torch.Generator().manual_seed(seed + 1))  # K + 1 = 2 each
    # the engine's flattened inputs, each sequence's rows looked up by its drafted token
    rows = torch.stack([draft_distributions(torch.tensor([x]), probs, len(P)) for x in range(len(P))])  # [V, 2, V]
    drafted = torch.stack([drafts, torch.full_like(drafts, NO_TOKEN)], dim=1).flatten()
    target = torch.stack([P, BONUS]).repeat(DRAWS, 1)
    accepted, tokens = function(target, drafted, rows[drafts].flatten(0, 1), uniforms, torch.ones_like(drafts))
    first = torch.where(accepted == 1, drafts, tokens)
    return torch.bincount(first, minlength=len(P)).double() / DRAWS


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
