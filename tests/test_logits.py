"""The logits pipeline against straightforward per-row, per-token reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from agentspec.logits import LogitsPipeline
from agentspec.params import GenerationParams

CPU = torch.device("cpu")


# -- references: one row at a time, plain Python over a sorted list -------------------------------------


def ref_penalize(row: list[float], seen: set[int], penalty: float) -> list[float]:
    out = list(row)
    for token in seen:
        out[token] = out[token] * penalty if out[token] < 0 else out[token] / penalty
    return out


def ref_filter(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Temperature, then top-k, top-p, min-p (each on the survivors of the previous), then softmax."""
    scores = [x / temperature for x in row]
    kept = set(range(len(row)))
    order = sorted(kept, key=lambda t: -scores[t])
    if 0 < top_k < len(row):
        kept = set(order[:top_k])

    def softmax(tokens):
        top = max(scores[t] for t in tokens)
        weights = {t: math.exp(scores[t] - top) for t in tokens}
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    if top_p < 1.0:
        probs = softmax(kept)
        mass, survivors = 0.0, set()
        for t in sorted(kept, key=lambda t: -scores[t]):
            if survivors and mass >= top_p:  # the mass before t already reaches top_p: drop t
                break
            survivors.add(t)
            mass += probs[t]
        kept = survivors
    if min_p > 0.0:
        probs = softmax(kept)
        best = max(probs.values())
        kept = {t for t in kept if probs[t] >= min_p * best}
    probs = softmax(kept)
    return [probs.get(t, 0.0) for t in range(len(row))]


def reference_rows(logits, committed, draft, params):
    """Row i: the tokens seen are the committed ones plus draft[:i]."""
    penalized = []
    for i in range(logits.shape[0]):
        seen = set(committed) | set(draft[:i])
        row = logits[i].double().tolist()
        penalized.append(ref_penalize(row, seen, params.repetition_penalty) if params.repetition_penalty != 1.0 else row)
    return penalized


def random_logits(positions: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(positions, vocab, generator=gen) * 3  # mixed signs: both penalty branches


def pipeline(params: GenerationParams, vocab: int, committed) -> LogitsPipeline:
    pipe = LogitsPipeline(params, vocab, CPU)
    # observed in two calls, as the engine does (prompt, then committed output)
    pipe.observe(committed[: len(committed) // 2])
    pipe.observe(committed[len(committed) // 2 :])
    return pipe


# -- repetition penalty -------------------------------------------------------------------------------


def test_penalty_row_i_sees_committed_plus_draft_prefix():
    vocab = 12
    committed = [1, 2]
    draft = [3, 2, 4, 3]  # 2 repeats a committed token, 3 repeats a draft token
    logits = random_logits(len(draft) + 1, vocab, seed=0)
    params = GenerationParams(temperature=1.0, repetition_penalty=1.7)
    got = pipeline(params, vocab, committed)._penalize(logits, draft)
    # by hand: which tokens each row penalises
    expected_seen = [{1, 2}, {1, 2, 3}, {1, 2, 3}, {1, 2, 3, 4}, {1, 2, 3, 4}]
    for i, seen in enumerate(expected_seen):
        for token in range(vocab):
            x = float(logits[i, token])
            want = (x * 1.7 if x < 0 else x / 1.7) if token in seen else x
            assert float(got[i, token]) == pytest.approx(want, rel=1e-6), (i, token)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("penalty", [0.8, 1.3])
def test_penalty_matches_reference(seed, penalty):
    gen = torch.Generator().manual_seed(100 + seed)
    vocab = 20
    committed = torch.randint(vocab, (int(torch.randint(0, 8, (1,), generator=gen)),), generator=gen).tolist()
    draft = torch.randint(vocab, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
    logits = random_logits(len(draft) + 1, vocab, seed)
    params = GenerationParams(temperature=1.0, repetition_penalty=penalty)
    got = pipeline(params, vocab, committed)._penalize(logits, draft)
    want = torch.tensor(reference_rows(logits, committed, draft, params), dtype=torch.float64)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    # the input is not modified in place
    assert torch.equal(logits, random_logits(len(draft) + 1, vocab, seed))


def test_penalty_does_not_leak_between_calls():
    vocab = 8
    params = GenerationParams(temperature=1.0, repetition_penalty=2.0)
    pipe = pipeline(params, vocab, [0])
    logits = torch.ones(3, vocab)
    pipe.probs(logits, [5, 6])  # a draft that was later rejected
    # nothing of that draft is remembered: only the committed token 0 is penalised in row 0
    penalized = pipe._penalize(logits[:1], [])
    assert penalized[0].tolist() == [0.5] + [1.0] * (vocab - 1)
    pipe.observe([6])  # now 6 is committed
    assert pipe._penalize(logits[:1], [])[0].tolist() == [0.5, 1, 1, 1, 1, 1, 0.5, 1]


# -- sampling filters -----------------------------------------------------------------------------------

FILTERS = [
    # temperature, top_k, top_p, min_p, repetition_penalty
    (1.0, 0, 1.0, 0.0, 1.0),
    (0.5, 0, 1.0, 0.0, 1.0),
    (2.0, 0, 1.0, 0.0, 1.0),
    (1.0, 1, 1.0, 0.0, 1.0),
    (0.7, 5, 1.0, 0.0, 1.0),
    (1.0, 40, 1.0, 0.0, 1.0),  # top_k >= vocab: no filter
    (1.0, 0, 0.5, 0.0, 1.0),
    (0.8, 0, 0.9, 0.0, 1.0),
    (1.0, 0, 0.01, 0.0, 1.0),  # only the top token survives
    (1.0, 0, 1.0, 0.1, 1.0),
    (1.5, 0, 1.0, 0.3, 1.0),
    (0.9, 8, 0.8, 0.05, 1.0),
    (0.6, 6, 0.95, 0.2, 1.3),
    (1.2, 0, 0.7, 0.0, 0.9),
    (1.0, 3, 1.0, 0.0, 1.5),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p", "penalty"), FILTERS)
def test_probs_match_reference(temperature, top_k, top_p, min_p, penalty):
    vocab = 30
    params = GenerationParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty)
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        committed = torch.randint(vocab, (5,), generator=gen).tolist()
        draft = torch.randint(vocab, (3,), generator=gen).tolist()
        logits = random_logits(len(draft) + 1, vocab, 1000 + seed)
        got = pipeline(params, vocab, committed).probs(logits, draft).double()
        rows = reference_rows(logits, committed, draft, params)
        want = torch.tensor([ref_filter(row, temperature, top_k, top_p, min_p) for row in rows], dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-6), (seed, got, want)
        # filtered tokens get exactly 0, and each row is a distribution
        assert torch.equal(got == 0, want == 0)
        assert torch.allclose(got.sum(dim=-1), torch.ones(len(rows), dtype=torch.float64), atol=1e-6)
        # the top token (after the penalty) always survives
        best = torch.tensor(rows).argmax(dim=-1)
        assert bool((got[torch.arange(len(rows)), best] > 0).all())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999, 0.9999999])
@pytest.mark.parametrize("spread", [0.2, 1.0, 4.0, 30.0])
def test_top_p_on_a_wide_vocabulary_keeps_what_sorting_all_keeps(top_p, spread):
    """On a vocabulary of SmolLM2's size the nucleus is looked for among the most likely tokens first
    (``NUCLEUS_FIRST``, then eight times as many, up to all): it keeps as many tokens as sorting the
    whole row does, the most likely ones — nuclei of one token, of hundreds, of thousands (flat rows),
    of all, rows masked by a grammar, rows of one pass needing different widths — with the float64
    reference's probabilities."""
    from agentspec.logits import NUCLEUS_FIRST

    vocab = 49_152
    gen = torch.Generator().manual_seed(int(spread * 10) + int(top_p * 1000))
    logits = torch.randn(4, vocab, generator=gen) * spread
    logits[1, : vocab // 2] = float("-inf")  # a grammar allows half the vocabulary
    logits[2] = torch.randn(vocab, generator=gen) * 0.01  # nearly flat: the nucleus is most of the row
    logits[3, 7] = 40.0  # one token far above the rest
    params = GenerationParams(temperature=1.0, top_p=top_p)
    got = LogitsPipeline(params, vocab, CPU).probs(logits, [0, 0, 0])
    kept, probs = got > 0, logits.softmax(dim=-1)
    # as many as the whole row sorted keeps (a token is dropped once the mass before it reaches
    # top_p), and the most likely ones: which of equally likely tokens at the edge is either's choice
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    widths = (sorted_probs.cumsum(dim=-1) - sorted_probs < top_p).sum(dim=-1)
    assert torch.equal(kept.sum(dim=-1), widths)
    assert bool((probs.masked_fill(~kept, 2.0).amin(dim=-1) >= probs.masked_fill(kept, -1.0).amax(dim=-1)).all())
    if top_p >= 0.999:  # the flat row's nucleus is far wider than the first look
        assert widths[2] > 8 * NUCLEUS_FIRST
    want = kept.double() * logits.double().softmax(dim=-1)
    assert torch.allclose(got.double(), want / want.sum(dim=-1, keepdim=True), atol=1e-6)


def test_top_p_keeps_a_rows_nucleus_whatever_rows_share_its_pass():
    """A row whose nucleus ends inside a run of equally likely tokens keeps the same ones alone (a plain
    step) and beside a row whose nucleus is far wider (a verification): which of the tied tokens is
    kept depends on how far the search looked, so each row's search is its own."""
    vocab = 49_152
    tied = torch.zeros(vocab)
    tied[1000:1200] = 8.0  # 200 equally likely tokens; top-p 0.5 keeps about half of them
    flat = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 0.01  # a nucleus of ~24,000
    params = GenerationParams(temperature=1.0, top_p=0.5)
    alone = LogitsPipeline(params, vocab, CPU).probs(tied[None], [])[0]
    beside = LogitsPipeline(params, vocab, CPU).probs(torch.stack([tied, flat]), [0])
    assert 0 < int((alone > 0).sum()) < 200
    assert torch.equal(alone, beside[0])
    assert torch.equal(beside[1], LogitsPipeline(params, vocab, CPU).probs(flat[None], [])[0])


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "survivors"),
    [
        # softmax of [3, 2, 1, 0] * ln 2 is [8, 4, 2, 1] / 15
        (2, 1.0, 0.0, 2),
        (0, 0.5, 0.0, 1),  # mass before token 2 is 8/15 >= 0.5
        (0, 0.6, 0.0, 2),  # 8/15 < 0.6 <= 12/15
        (0, 0.85, 0.0, 3),  # 12/15 < 0.85 <= 14/15
        (0, 0.95, 0.0, 4),  # 14/15 < 0.95
        (0, 1.0, 0.2, 3),  # 1/8 < 0.2 <= 2/8
        (0, 1.0, 0.45, 2),  # 4/8 >= 0.45 > 2/8
        (3, 0.7, 0.0, 2),  # top-3 renormalised: [8, 4, 2] / 14, mass before token 2 is 12/14 >= 0.7
        (3, 1.0, 0.3, 2),  # min-p after top-k: 2/8 < 0.3
    ],
)
def test_filters_worked_example(top_k, top_p, min_p, survivors):
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]) * math.log(2)
    params = GenerationParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = LogitsPipeline(params, 4, CPU).probs(logits, [])[0]
    weights = torch.tensor([8.0, 4.0, 2.0, 1.0])[:survivors]
    expected = torch.cat([weights / weights.sum(), torch.zeros(4 - survivors)])
    assert torch.allclose(probs, expected, atol=1e-6), probs


# -- greedy ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("penalty", [1.0, 1.5, 3.0])
def test_greedy_is_argmax_of_penalized_logits(seed, penalty):
    vocab = 16
    gen = torch.Generator().manual_seed(seed)
    committed = torch.randint(vocab, (6,), generator=gen).tolist()
    draft = torch.randint(vocab, (4,), generator=gen).tolist()
    logits = random_logits(len(draft) + 1, vocab, 2000 + seed)
    params = GenerationParams(repetition_penalty=penalty)
    got = pipeline(params, vocab, committed).greedy(logits, draft).tolist()
    rows = reference_rows(logits, committed, draft, params)
    assert got == [max(range(vocab), key=lambda t: row[t]) for row in rows]


def test_penalty_changes_the_greedy_choice():
    # token 0 is best, but it was generated before: with the penalty, token 1 wins, in row 0 only
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    params = GenerationParams(repetition_penalty=2.0)
    pipe = LogitsPipeline(params, 3, CPU)
    pipe.observe([0])
    assert pipe.greedy(logits, [2]).tolist() == [1, 1]
    pipe2 = LogitsPipeline(params, 3, CPU)
    pipe2.observe([2])
    assert pipe2.greedy(logits, [0]).tolist() == [0, 1]  # row 1 sees the draft token 0
