"""Verification: the vectorised functions against slow loops, and the seeded sampler's output law.

Both verifiers take a whole target pass, flattened: sequence s owns ``counts[s] + 1`` consecutive
rows (its draft positions, then its bonus row, whose draft token is NO_TOKEN). Each is checked
against a one-sequence loop on random cases, and a batch of random sequences flattened into one call
must give exactly what each sequence gives alone.

Sampled verification draws the target's token at every row with the seeded sampler
(``agentspec.sampling``: an exponential race on noise keyed by the request's seed and the row's
output position) and accepts a draft token iff it is that draw. Checked here:
- the noise is its specification, ``reference_noise`` (plain Python), element by element, and is
  finite and positive, also at the extreme hash words;
- a draw is distributed as its row: a chi-square against the exact law, over the positions of one
  seed and over seeds at one position; draws at two positions, or of two seeds, are independent;
  samplers that ignore the noise, sharpen the row or reuse one position's noise fail the same tests;
- ``verify_sampling`` equals a reference loop per sequence, and a flattened pass each sequence alone;
- the committed tokens are a function of (distributions, keys) alone: decoding a toy model with
  drafts of any length and content (none, random, nearly right, a coupled draft model), alone and
  in batches, commits exactly the tokens plain (K = 0) sampling commits with the same seed.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter
from dataclasses import dataclass
from functools import cache

import pytest
import torch

from agentspec.engine.verify import NO_TOKEN, flatten, verify_greedy, verify_greedy_rows, verify_sampling
from agentspec.sampling import MASK32, MULTIPLIERS, TOKEN_MULTIPLIER, UNIFORM_BITS, fresh_seed, position_keys, position_noise, reference_mix32, reference_noise, sample

from .stats import chi2_sf_upper, chi_square

CPU = torch.device("cpu")
VOCAB_SIZE = 49152  # the default model's vocabulary

# -- reference loops ---------------------------------------------------------------------------------


def reference_draw(row: list[float], key: int) -> int:
    """The exponential race on Python floats: the first token with the largest p / E, E its noise
    (a token of probability 0 has ratio 0, so it never beats a possible one)."""
    return max(range(len(row)), key=lambda token: row[token] / reference_noise(key, token))


def reference_sampling(target_probs: torch.Tensor, draft_tokens: list[int], keys: list[int]) -> tuple[int, int]:
    """One sequence, one row at a time: accept while the draft token is the row's draw; the first row
    whose draw differs (or the bonus row) commits its draw.

    target_probs: [K+1, V]; draft_tokens: K ints; keys: K + 1 ints.
    """
    for i, token in enumerate(draft_tokens):
        draw = reference_draw(target_probs[i].tolist(), keys[i])
        if draw != token:
            return i, draw
    k = len(draft_tokens)
    return k, reference_draw(target_probs[k].tolist(), keys[k])


def reference_greedy(target_tokens, draft_tokens):
    for i, token in enumerate(draft_tokens.tolist()):
        if int(target_tokens[i]) != token:
            return i, int(target_tokens[i])
    k = len(draft_tokens)
    return k, int(target_tokens[k])


def broken_sampling(target_probs, draft_tokens, keys, counts):
    """A plausible bug, the law tests' negative control: every row drawn from norm(p**2) (as if the
    temperature were applied twice) instead of p.

    Same signature as ``verify_sampling``; the noise, the acceptance test and the commit are the real
    ones, only the distribution drawn from is wrong.
    """
    sharpened = target_probs.double() ** 2
    return verify_sampling(sharpened / sharpened.sum(dim=-1, keepdim=True), draft_tokens, keys, counts)


# -- one sequence ------------------------------------------------------------------------------------


def int32(keys) -> torch.Tensor:
    """Keys as the engine passes them: one int32 lane each."""
    return torch.tensor(list(keys), dtype=torch.int32)


def sample_one(function, target_probs: torch.Tensor, draft: list[int], keys: list[int]) -> tuple[int, int]:
    """A verifier with ``verify_sampling``'s signature, on one sequence (counts = [K])."""
    drafted, counts = flatten([draft], CPU)
    accepted, tokens = function(target_probs, drafted, int32(keys), counts)
    assert accepted.shape == tokens.shape == (1,)
    return int(accepted[0]), int(tokens[0])


def greedy_one(target, draft) -> tuple[int, int]:
    accepted, tokens = verify_greedy(target, torch.cat([draft, torch.tensor([NO_TOKEN])]), torch.tensor([len(draft)]))
    assert accepted.shape == tokens.shape == (1,)
    return int(accepted[0]), int(tokens[0])


# -- greedy ------------------------------------------------------------------------------------------

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
    """The whole table flattened into one call: each row's verdict, as alone; the host's loop (what
    an engine on a CPU runs) gives the same."""
    target = torch.tensor([t for row, _, _ in GREEDY_TABLE for t in row])
    drafted = torch.tensor([t for _, d, _ in GREEDY_TABLE for t in (*d, NO_TOKEN)])
    counts = torch.tensor([len(d) for _, d, _ in GREEDY_TABLE])
    accepted, tokens = verify_greedy(target, drafted, counts)
    assert list(zip(accepted.tolist(), tokens.tolist())) == [e for _, _, e in GREEDY_TABLE]
    assert verify_greedy_rows(target.tolist(), [d for _, d, _ in GREEDY_TABLE]) == [e for _, _, e in GREEDY_TABLE]


@pytest.mark.parametrize("rows", [[1, 2], [1, 2, 3, 4]])
def test_the_host_verifier_refuses_rows_the_drafts_do_not_lay_out(rows):
    with pytest.raises(ValueError, match="lay out 3 rows"):
        verify_greedy_rows(rows, [[1, 2]])


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
        assert verify_greedy_rows(target.tolist(), [d.tolist() for _, d in cases]) == together
        seen.update((len(d) == 0, n == len(d)) for (n, _), (_, d) in zip(together, cases))
    assert seen == {(True, True), (False, True), (False, False)}


# -- the noise: the specified hash, Exp(1), finite and positive ------------------------------------------

# float32 rounds u = (h + 0.5) / 2**24 near 1, and its log, by a few units of 2**-24: where the noise
# -log(u) is near 0 that is its whole size, so the comparison needs an absolute part
NOISE_RTOL, NOISE_ATOL = 1e-6, 2.0**-23


def assert_noise_matches(noise: torch.Tensor, keys: list[int], tokens: list[int]) -> None:
    """noise: [len(keys), len(tokens)] ``position_noise``'s values at those keys and tokens."""
    want = torch.tensor([[reference_noise(key, token) for token in tokens] for key in keys], dtype=torch.float64)
    assert noise.dtype == torch.float32 and noise.shape == want.shape
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert torch.allclose(noise.double(), want, rtol=NOISE_RTOL, atol=NOISE_ATOL), float((noise.double() - want).abs().max())


def test_noise_is_the_reference_hash():
    """Element by element against the plain-Python specification: every token of a small vocabulary
    and scattered tokens of the default model's, at the keys of random seeds and positions and at
    the int32 extremes."""
    rng = random.Random(0)
    keys = [position_keys(rng.getrandbits(63), [rng.randrange(10**6)])[0] for _ in range(200)]
    keys += [0, 1, -1, -(2**31), 2**31 - 1]
    assert_noise_matches(position_noise(int32(keys), 16), keys, list(range(16)))

    large = position_noise(int32(keys[:8]), VOCAB_SIZE)  # [8, V]
    tokens = [0, 1, 255, 256, 32767, 32768, VOCAB_SIZE - 1, *rng.sample(range(VOCAB_SIZE), 25)]
    assert_noise_matches(large[:, tokens], keys[:8], tokens)
    # the noise of a token does not depend on the vocabulary's size
    assert torch.equal(large[:, :16], position_noise(int32(keys[:8]), 16))


def unmix(word: int) -> int:
    """The inverse of ``reference_mix32``: x ^ (x >> 16) undoes itself on 32 bits, an odd multiplier has an inverse."""
    word ^= word >> 16
    for multiplier in reversed(MULTIPLIERS):
        word = (word * pow(multiplier, -1, 2**32)) & MASK32
        word ^= word >> 16
    return word


def key_hitting(word: int, token: int) -> int:
    """The key (as an int32) whose hash word at ``token`` is ``word``: the noise there is chosen."""
    key = (unmix(word) - reference_mix32(token * TOKEN_MULTIPLIER & MASK32)) & MASK32
    return key - (1 << 32) if key >= 1 << 31 else key


def uniform_word(bits: int) -> int:
    """A hash word whose uniform (its top UNIFORM_BITS bits) is ``bits``; the low bits are noise-free."""
    return bits << (32 - UNIFORM_BITS)


TOP = 2**UNIFORM_BITS - 1  # the largest uniform's bits: u just below 1, the smallest noise there is
HALF = 2 ** (UNIFORM_BITS - 1)  # u = 1/2


@pytest.mark.parametrize("bits", [0, 1, HALF - 1, HALF, HALF + 1, TOP - 2, TOP - 1, TOP])
def test_noise_at_the_extreme_uniforms(bits):
    """Keys built to hit the smallest and largest uniforms (and both sides of 1/2, where float32's
    spacing changes): finite, positive noise, the reference's value."""
    tokens = [0, 7, VOCAB_SIZE - 1]
    keys = [key_hitting(uniform_word(bits), token) for token in tokens]
    for key, token in zip(keys, tokens):  # the keys do hit: the specification's own value
        assert reference_noise(key, token) == -math.log((bits + 0.5) / 2**UNIFORM_BITS)
    noise = position_noise(int32(keys), VOCAB_SIZE)  # [3, V]
    for row, (key, token) in enumerate(zip(keys, tokens)):
        assert_noise_matches(noise[row : row + 1, [token]], [key], [token])


def test_a_token_of_probability_zero_is_never_drawn_even_where_its_noise_is_smallest():
    """Filtered tokens (top-k, top-p: probability exactly 0) at the key that gives them the smallest
    noise there is: still never drawn. A possible token there wins, as in the reference race."""
    for token in (0, 1234, VOCAB_SIZE - 1):
        key = key_hitting(uniform_word(TOP) | 0xFF, token)
        probs = torch.zeros(1, VOCAB_SIZE)
        probs[0, [5, 6]] = torch.tensor([0.7, 0.3])
        assert int(sample(probs, int32([key]))[0]) in (5, 6), token
        probs[0, token] = 0.5
        expected = reference_draw(probs[0].tolist(), key)
        assert expected == token  # its ratio p / E is enormous
        assert int(sample(probs, int32([key]))[0]) == expected


def test_noise_is_exponential():
    """exp(-E) is uniform on (0, 1): a chi-square over 32 equal bins, 64 positions x 1024 tokens."""
    noise = position_noise(int32(position_keys(99, range(64))), 1024).double()
    bins = Counter((torch.exp(-noise) * 32).floor().long().clamp(0, 31).flatten().tolist())
    assert law_p_value(bins, {b: 1 / 32 for b in range(32)}) > ALPHA


# -- keys: a function of (seed, position), different across both ---------------------------------------


def test_keys_and_noise_differ_across_positions_and_seeds():
    along = position_keys(7, range(1000))  # positions 0..999 of one seed
    across = [position_keys(seed, [42])[0] for seed in range(1000)]  # seeds 0..999 at one position
    for keys in (along, across):
        assert all(-(2**31) <= key < 2**31 for key in keys)  # an int32 lane each
        assert len(set(keys)) == len(keys)
        rows = position_noise(int32(keys), 16)
        assert len({tuple(row) for row in rows.tolist()}) == len(keys)
    # a key depends on (seed, position) alone, not on the other positions asked for with it
    assert position_keys(7, [500, 3]) == [along[500], along[3]]
    assert len({fresh_seed() for _ in range(16)}) == 16


# -- the output law ----------------------------------------------------------------------------------------

DRAWS = 20_000
ALPHA = 1e-4  # chance that a correct sampler fails a law test (the keys are fixed: it never flakes)

LAWS = {
    "zeros after": [0.5, 0.25, 0.15, 0.1, 0.0, 0.0],
    "zeros around": [0.0, 0.0, 0.3, 0.0, 0.7, 0.0],
    "skewed": [0.9, 0.06, 0.03, 0.01],
    "uniform": [0.125] * 8,
    "unnormalised": [3.0, 1.0, 0.0, 2.0],  # the race is scale-free: drawn as [1/2, 1/6, 0, 1/3]
}


@cache
def keying(name: str) -> torch.Tensor:
    """[DRAWS] keys: the positions of one seed, or many seeds at one position."""
    if name == "positions of one seed":
        return int32(position_keys(12345, range(DRAWS)))
    return int32(position_keys(seed, [17])[0] for seed in range(DRAWS))


KEYINGS = ["positions of one seed", "seeds at one position"]


def law_p_value(outcomes: Counter, law: dict) -> float:
    """An upper bound on the chance of a chi-square statistic this large if ``outcomes`` follow
    ``law`` (outcome -> probability, positive ones only: the callers check the others never occur)."""

    assert min(law.values()) * sum(outcomes.values()) >= 5  # a valid chi-square test
    statistic, df = chi_square(outcomes, law)
    return chi2_sf_upper(statistic, df)


def exact_law(row: list[float]) -> dict[int, float]:
    total = sum(row)
    return {token: mass / total for token, mass in enumerate(row) if mass > 0}


def draws_of(sampler, row: list[float], keys: torch.Tensor) -> Counter:
    """How often ``sampler`` ([T, V] distributions, [T] keys -> [T] tokens) drew each token from
    ``row`` at each of the keys."""
    return Counter(sampler(torch.tensor(row).expand(len(keys), -1), keys).tolist())


@pytest.mark.parametrize("keys", KEYINGS)
@pytest.mark.parametrize("law", LAWS)
def test_a_draw_is_distributed_as_its_row(law, keys):
    outcomes = draws_of(sample, LAWS[law], keying(keys))
    exact = exact_law(LAWS[law])
    assert set(outcomes) <= set(exact), outcomes  # never a token of probability 0
    assert law_p_value(outcomes, exact) > ALPHA, (outcomes, exact)


def test_a_one_hot_row_always_gives_its_token():
    for vocab, token, rows in ((1, 0, 2000), (6, 0, 2000), (6, 5, 2000), (VOCAB_SIZE, 31337, 16)):
        probs = torch.zeros(rows, vocab)
        probs[:, token] = 1.0
        assert (sample(probs, keying(KEYINGS[0])[:rows]) == token).all(), (vocab, token)


def ignores_the_noise(probs, keys):
    return probs.argmax(dim=-1)


def samples_p_squared(probs, keys):
    return sample(probs**2 / (probs**2).sum(dim=-1, keepdim=True), keys)


@pytest.mark.parametrize(
    ("sampler", "law"),
    [(ignores_the_noise, law) for law in LAWS] + [(samples_p_squared, law) for law in LAWS if law != "uniform"],  # p**2 of a uniform row is that row
)
def test_the_law_test_rejects_a_broken_sampler(sampler, law):
    outcomes = draws_of(sampler, LAWS[law], keying(KEYINGS[0]))
    assert law_p_value(outcomes, exact_law(LAWS[law])) < ALPHA, outcomes


PAIRINGS = {
    # name: seed -> the keys of two draws
    "next positions of one seed": lambda seed: position_keys(seed, [40, 41]),
    "far positions of one seed": lambda seed: position_keys(seed, [3, 3 + 2**20]),
    "one position of two seeds": lambda seed: [position_keys(2 * seed, [9])[0], position_keys(2 * seed + 1, [9])[0]],
}


def joint_draws(pairing, row: list[float]) -> Counter:
    """The pairs of tokens drawn from ``row`` at the two keys of each of DRAWS seeds."""
    keys = int32(key for seed in range(DRAWS) for key in pairing(seed))  # [2 * DRAWS]: pairs side by side
    tokens = sample(torch.tensor(row).expand(len(keys), -1), keys).view(DRAWS, 2)
    return Counter(map(tuple, tokens.tolist()))


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_draws_at_two_positions_or_of_two_seeds_are_independent(pairing):
    """The joint law of two draws (from one row: a sampler that reused one position's noise would
    draw the same token twice) is the product of the marginals."""
    marginal = exact_law(LAWS["zeros after"])
    product = {(a, b): pa * pb for a, pa in marginal.items() for b, pb in marginal.items()}
    outcomes = joint_draws(PAIRINGS[pairing], LAWS["zeros after"])
    assert set(outcomes) <= set(product)
    assert law_p_value(outcomes, product) > ALPHA, outcomes


def test_the_independence_test_rejects_reused_noise():
    """A sampler keyed by the seed alone (the position ignored) draws each pair's tokens alike."""
    marginal = exact_law(LAWS["zeros after"])
    product = {(a, b): pa * pb for a, pa in marginal.items() for b, pb in marginal.items()}
    outcomes = joint_draws(lambda seed: position_keys(seed, [40, 40]), LAWS["zeros after"])
    assert law_p_value(outcomes, product) < ALPHA


@pytest.mark.parametrize(("verifier", "correct"), [(verify_sampling, True), (broken_sampling, False)])
def test_the_first_committed_token_is_distributed_as_the_target(verifier, correct):
    """DRAWS sequences, one per seed, K = 2 drafts from an unrelated law (so both accepted and rejected
    first tokens are common), all in one flattened call: the first committed token, accepted or
    drawn, follows the first row. The same test rejects ``broken_sampling`` (norm(p**2))."""
    row = LAWS["zeros after"]
    gen = torch.Generator().manual_seed(3)
    drafter = torch.tensor([0.4, 0.1, 0.1, 0.1, 0.2, 0.1])  # it proposes impossible tokens too
    drafts = torch.multinomial(drafter, 2 * DRAWS, replacement=True, generator=gen).view(DRAWS, 2)
    drafted, counts = flatten(drafts.tolist(), CPU)
    keys = int32(key for seed in range(DRAWS) for key in position_keys(seed, range(5, 8)))
    target = torch.tensor([row, LAWS["zeros around"], [1 / 6] * 6]).repeat(DRAWS, 1)  # [3 * DRAWS, 6]
    accepted, tokens = verifier(target, drafted, keys, counts)
    assert 0.1 * DRAWS < int((accepted > 0).sum()) < 0.9 * DRAWS
    first = torch.where(accepted > 0, drafts[:, 0], tokens)
    outcomes, exact = Counter(first.tolist()), exact_law(row)
    assert set(outcomes) <= set(exact)  # a drafted impossible token is never accepted
    assert (law_p_value(outcomes, exact) > ALPHA) == correct, outcomes


# -- verify_sampling against the reference loop, alone and flattened --------------------------------------


def random_distribution(vocab: int, gen: torch.Generator, zeros: bool) -> torch.Tensor:
    weights = -torch.rand(vocab, generator=gen).log()  # Dirichlet(1)
    if zeros:  # filtered tokens (top-k/top-p) have probability exactly 0
        mask = torch.rand(vocab, generator=gen) < 0.4
        mask[torch.randint(vocab, (1,), generator=gen)] = False
        weights[mask] = 0.0
    return weights / weights.sum()


DRAFT_KINDS = ["the draws", "the draws, one changed", "random"]


def random_sampling_case(gen: torch.Generator, vocab: int) -> tuple[str, tuple[torch.Tensor, list[int], list[int]]]:
    """A draft kind, and one sequence: target [K+1, V], draft (K tokens), keys (K + 1) of a random
    seed from a random output position."""
    k = int(torch.randint(0, 7, (1,), generator=gen))
    zeros = bool(torch.rand(1, generator=gen) < 0.5)
    target = torch.stack([random_distribution(vocab, gen, zeros) for _ in range(k + 1)])
    seed, start = int(torch.randint(2**62, (1,), generator=gen)), int(torch.randint(10**6, (1,), generator=gen))
    keys = position_keys(seed, range(start, start + k + 1))
    kind = DRAFT_KINDS[int(torch.randint(len(DRAFT_KINDS), (1,), generator=gen))]
    if kind == "random":  # any token, possible or not
        draft = torch.randint(vocab, (k,), generator=gen).tolist()
    else:
        draft = [reference_draw(target[i].tolist(), keys[i]) for i in range(k)]
    if kind == "the draws, one changed" and k:
        i = int(torch.randint(k, (1,), generator=gen))
        draft[i] = (draft[i] + int(torch.randint(1, vocab, (1,), generator=gen))) % vocab
    return kind, (target, draft, keys)


@pytest.mark.parametrize("block", range(4))
def test_sampling_batch_equals_each_sequence_alone_and_the_reference_loop(block):
    """Random passes of 1 to 8 sequences (mixed K, K = 0 included) flattened into one call give
    exactly what each gives alone, which is the reference loop's."""
    seen = set()
    for batch in range(block * 100, (block + 1) * 100):
        gen = torch.Generator().manual_seed(30_000 + batch)
        vocab = int(torch.randint(2, 9, (1,), generator=gen))
        kinds, cases = zip(*[random_sampling_case(gen, vocab) for _ in range(int(torch.randint(1, 9, (1,), generator=gen)))])
        drafted, counts = flatten([draft for _, draft, _ in cases], CPU)
        keys = int32(key for _, _, case_keys in cases for key in case_keys)
        accepted, tokens = verify_sampling(torch.cat([target for target, _, _ in cases]), drafted, keys, counts)
        assert accepted.shape == tokens.shape == (len(cases),)
        together = list(zip(accepted.tolist(), tokens.tolist()))
        alone = [sample_one(verify_sampling, *case) for case in cases]
        assert together == alone == [reference_sampling(*case) for case in cases], batch
        for kind, (n, _), (_, draft, _) in zip(kinds, together, cases):
            if kind == "the draws":
                assert n == len(draft)  # drafting the target's own draws: all accepted
            seen.add((len(draft) == 0, n == len(draft), kind))
    # K = 0 sequences, drafts accepted whole and cut short, of every kind, all took part
    assert {(True, True, kind) for kind in DRAFT_KINDS} <= seen
    assert {(False, True, "the draws"), (False, False, "the draws, one changed"), (False, True, "random"), (False, False, "random")} <= seen


def test_the_verdict_is_a_function_of_the_distributions_and_keys():
    """The same inputs give the same verdict; rows (and keys) after the one that decides do not matter."""
    checked = 0
    for case in range(200):
        gen = torch.Generator().manual_seed(50_000 + case)
        _, (target, draft, keys) = random_sampling_case(gen, 5)
        verdict = sample_one(verify_sampling, target, draft, keys)
        assert sample_one(verify_sampling, target.clone(), list(draft), list(keys)) == verdict
        decided = verdict[0]  # the row that committed the last token
        if decided < len(draft):
            later = target.clone()
            later[decided + 1 :] = torch.stack([random_distribution(5, gen, False) for _ in range(len(draft) - decided)])
            other_keys = keys[: decided + 1] + position_keys(fresh_seed(), range(len(draft) - decided))
            assert sample_one(verify_sampling, later, draft, other_keys) == verdict
            checked += 1
    assert checked > 50


# -- draft lengths and contents do not change the committed tokens ----------------------------------------

TOY_VOCAB = 6
OUTPUT_TOKENS = 20


class ToyModel:
    """Next-token distributions as a function of the whole context, with exact zeros: a stand-in for a
    model, so that a wrong draft token changes the rows verified after it."""

    def __init__(self, salt: str, scale: float = 2.5) -> None:
        self.salt, self.scale = salt, scale
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(self, context: tuple[int, ...]) -> torch.Tensor:
        """[V] the distribution of the token after ``context``."""
        if context not in self._rows:
            gen = torch.Generator().manual_seed(zlib.crc32(repr((self.salt, context)).encode()))
            logits = torch.randn(TOY_VOCAB, generator=gen) * self.scale
            dropped = torch.rand(TOY_VOCAB, generator=gen) < 0.4
            dropped[logits.argmax()] = False
            self._rows[context] = logits.masked_fill(dropped, float("-inf")).softmax(dim=0)
        return self._rows[context]


TARGET = ToyModel("target")
DRAFT_MODEL = ToyModel("draft", scale=1.0)


def draft_model_probs(context: tuple[int, ...]) -> torch.Tensor:
    """A draft model close to the target (it has the target's zeros, and some of its own mass)."""
    target = TARGET.probs(context)
    return torch.where(target > 0, 0.6 * target + 0.4 * DRAFT_MODEL.probs(context), 0.0)


@dataclass
class Request:
    prompt: tuple[int, ...]
    seed: int
    plain: list[int]  # plain sampling's output with this seed: what a perfect drafter would propose


def plain_decode(prompt: tuple[int, ...], seed: int, n: int) -> list[int]:
    """Plain sampling: one token per position, drawn with the request's key for that position."""
    out: list[int] = []
    for position in range(n):
        out.append(int(sample(TARGET.probs(prompt + tuple(out)).unsqueeze(0), int32(position_keys(seed, [position])))[0]))
    return out


def no_draft(rng: random.Random, k: int, request: Request, out: list[int]) -> list[int]:
    return []


def random_draft(rng: random.Random, k: int, request: Request, out: list[int]) -> list[int]:
    return [rng.randrange(TOY_VOCAB) for _ in range(k)]


def nearly_right_draft(rng: random.Random, k: int, request: Request, out: list[int]) -> list[int]:
    return [rng.randrange(TOY_VOCAB) if rng.random() < 0.25 else token for token in request.plain[len(out) : len(out) + k]]


def coupled_draft(rng: random.Random, k: int, request: Request, out: list[int]) -> list[int]:
    """A draft model sampling its own distribution with the request's noise at each position."""
    draft: list[int] = []
    for key in position_keys(request.seed, range(len(out), len(out) + k)):
        row = draft_model_probs(request.prompt + tuple(out + draft))
        draft.append(int(sample(row.unsqueeze(0), int32([key]))[0]))
    return draft


def mixed_draft(rng: random.Random, k: int, request: Request, out: list[int]) -> list[int]:
    return rng.choice([no_draft, random_draft, nearly_right_draft, coupled_draft])(rng, k, request, out)


DRAFTERS = {"none": no_draft, "random": random_draft, "nearly right": nearly_right_draft, "coupled draft model": coupled_draft, "mixed": mixed_draft}


def speculative_decode(requests: list[Request], drafter, rng: random.Random) -> tuple[list[list[int]], Counter]:
    """Decode every request to OUTPUT_TOKENS tokens in lockstep: each step, each unfinished request
    drafts K in 0..8 tokens, the target's rows are computed after each draft prefix, and the whole
    batch is verified in one flattened call keyed by (seed, output position). Returns the outputs
    and how the drafted tokens fared."""
    outs: list[list[int]] = [[] for _ in requests]
    fate: Counter = Counter()
    while live := [i for i, out in enumerate(outs) if len(out) < OUTPUT_TOKENS]:
        drafts, rows, keys = [], [], []
        for i in live:
            request, out = requests[i], outs[i]
            draft = drafter(rng, rng.randint(0, 8), request, out)
            drafts.append(draft)
            rows += [TARGET.probs(request.prompt + tuple(out + draft[:j])) for j in range(len(draft) + 1)]
            keys += position_keys(request.seed, range(len(out), len(out) + len(draft) + 1))
        drafted, counts = flatten(drafts, CPU)
        accepted, tokens = verify_sampling(torch.stack(rows), drafted, int32(keys), counts)
        for i, draft, n, token in zip(live, drafts, accepted.tolist(), tokens.tolist()):
            outs[i] += draft[:n] + [token]
            fate.update(accepted=n, rejected=int(n < len(draft)))
    return [out[:OUTPUT_TOKENS] for out in outs], fate


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_draft_lengths_and_contents_do_not_change_the_committed_tokens(drafter):
    """Whatever the drafts' lengths and contents, alone or batched with other requests (the same
    request twice included), every request commits exactly plain sampling's tokens for its seed."""
    gen = random.Random(0)
    prompts = [tuple(gen.randrange(TOY_VOCAB) for _ in range(3)) for _ in range(3)]
    specs = [(prompts[0], 1), (prompts[0], 2), (prompts[0], 1), (prompts[1], 1), (prompts[2], 2**63 - 1)]
    requests = [Request(prompt, seed, plain_decode(prompt, seed, OUTPUT_TOKENS + 8)) for prompt, seed in specs]
    plain = [request.plain[:OUTPUT_TOKENS] for request in requests]
    assert plain[0] != plain[1]  # another seed, another output
    assert plain[0] == plain[2]  # the same seed, the same output

    rng = random.Random(drafter)
    fate: Counter = Counter()
    for attempt in range(3):  # each request alone, then all together, twice (other drafts each time)
        batches = [[request] for request in requests] if attempt == 0 else [requests]
        outputs = []
        for batch in batches:
            decoded, counted = speculative_decode(batch, DRAFTERS[drafter], rng)
            outputs += decoded
            fate += counted
        assert outputs == plain, (drafter, attempt)
    if drafter != "none":  # drafts were both accepted and cut short
        assert fate["accepted"] > 0 and fate["rejected"] > 0, fate
