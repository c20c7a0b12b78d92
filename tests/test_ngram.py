"""N-gram drafting: worked examples of ``propose_ngram``, the incremental index against it, the drafter.

Every expected value in the tables below was worked out by hand from the rule "for n from max_n down
to min_n, take the most recent *earlier* occurrence of the last n tokens and propose what followed".
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.drafting.base import Draft
from agentspec.drafting.ngram import NgramDrafter, NgramIndex, propose_ngram

# (tokens, k, min_n, max_n, expected draft, expected n)
CASES = [
    # the docstring example: suffix [5, 6] occurred at 0..1, followed by 7, 8, 9
    pytest.param([5, 6, 7, 8, 9, 5, 6], 3, 1, 4, [7, 8, 9], 2, id="docstring"),
    # longest match wins: [2, 3] (n=2, followed by 4, 9) beats the more recent [3] (n=1, followed by 5, 2)
    pytest.param([1, 2, 3, 4, 9, 3, 5, 2, 3], 2, 1, 4, [4, 9], 2, id="longest-wins"),
    # ... and with max_n=1 only the single token [3] counts: most recent earlier 3 is at index 5
    pytest.param([1, 2, 3, 4, 9, 3, 5, 2, 3], 2, 1, 1, [5, 2], 1, id="longest-capped-by-max_n"),
    # most recent occurrence wins: [1, 2] occurs at 0 (then 7) and at 3 (then 8)
    pytest.param([1, 2, 7, 1, 2, 8, 1, 2], 1, 1, 4, [8], 2, id="most-recent-wins"),
    pytest.param([1, 2, 7, 1, 2, 8, 1, 2], 3, 1, 4, [8, 1, 2], 2, id="most-recent-k3"),
    # continuation shorter than k: [4, 5] at 0 is followed by only 6, 4, 5 (the continuation may overlap the suffix)
    pytest.param([4, 5, 6, 4, 5], 5, 1, 4, [6, 4, 5], 2, id="short-continuation-overlap"),
    # [3] most recently (and earlier than the suffix) at index 2, followed by just the last token
    pytest.param([1, 2, 3, 3], 4, 1, 4, [3], 1, id="short-continuation-one"),
    # a run of one token: suffix [7, 7, 7] occurs at 0, followed by the last 7
    pytest.param([7, 7, 7, 7], 3, 1, 3, [7], 3, id="run"),
    pytest.param([7, 7, 7, 7], 3, 1, 4, [7], 3, id="run-max_n-above-length"),
    # no match at all
    pytest.param([1, 2, 3, 4], 3, 1, 4, [], 0, id="no-match"),
    pytest.param([], 3, 1, 4, [], 0, id="empty"),
    pytest.param([9], 3, 1, 4, [], 0, id="single-token"),
    # k = 0 (and negative) never proposes, even when there is a match
    pytest.param([5, 6, 7, 5, 6], 0, 1, 4, [], 0, id="k0"),
    pytest.param([5, 6, 7, 5, 6], -1, 1, 4, [], 0, id="k-negative"),
    # min_n: [9, 3] never occurred earlier; only the 1-gram [3] (at 2, followed by 9, 3) matches
    pytest.param([1, 2, 3, 9, 3], 2, 1, 4, [9, 3], 1, id="min_n-1"),
    pytest.param([1, 2, 3, 9, 3], 2, 2, 4, [], 0, id="min_n-2-rejects-1gram"),
    # max_n: the 4-gram [1, 2, 3, 4] at 0 is followed by 5; the 3-gram [2, 3, 4] most recently at 6, by 6
    pytest.param([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 1, 2, 3, 4], 1, 1, 4, [5], 4, id="max_n-4"),
    pytest.param([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 1, 2, 3, 4], 1, 1, 3, [6], 3, id="max_n-3"),
    # max_n is capped by the length: [3, 3] has only a 1-gram to match
    pytest.param([3, 3], 3, 1, 4, [3], 1, id="length-2"),
    # min_n = max_n = 2: the 3-gram match [1, 2, 3] is not considered, the 2-gram [2, 3] at 5 is (then 0)
    pytest.param([1, 2, 3, 8, 9, 2, 3, 0, 1, 2, 3], 1, 2, 2, [0], 2, id="exact-n"),
    pytest.param([1, 2, 3, 8, 9, 2, 3, 0, 1, 2, 3], 1, 1, 3, [8], 3, id="exact-n-3gram"),
]


@pytest.mark.parametrize(("tokens", "k", "min_n", "max_n", "draft", "n"), CASES)
def test_propose_ngram_worked_examples(tokens, k, min_n, max_n, draft, n):
    assert propose_ngram(tokens, k, min_n=min_n, max_n=max_n) == (draft, n)


@pytest.mark.parametrize(("tokens", "k", "min_n", "max_n", "draft", "n"), CASES)
def test_index_worked_examples(tokens, k, min_n, max_n, draft, n):
    index = NgramIndex(min_n=min_n, max_n=max_n)
    index.extend(tokens)
    assert index.propose(k) == (draft, n)


def test_propose_ngram_accepts_any_sequence():
    assert propose_ngram((5, 6, 7, 8, 9, 5, 6), 2) == ([7, 8], 2)


@st.composite
def chunked_tokens(draw):
    """A token sequence over a small alphabet (so n-grams repeat) cut into random chunks."""
    alphabet = draw(st.integers(1, 5))
    tokens = draw(st.lists(st.integers(0, alphabet - 1), max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=8)))
    bounds = [0, *cuts, len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(
    chunks=chunked_tokens(),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    ks=st.lists(st.integers(0, 6), min_size=1, max_size=3),
)
def test_index_equals_reference_after_every_chunk(chunks, min_n, extra, ks):
    max_n = min_n + extra
    index = NgramIndex(min_n=min_n, max_n=max_n)
    seen: list[int] = []
    for chunk in [[], *chunks]:
        index.extend(chunk)
        seen.extend(chunk)
        assert index.tokens == seen
        for k in ks:
            assert index.propose(k) == propose_ngram(seen, k, min_n=min_n, max_n=max_n)


def test_drafter_reset_propose_observe():
    drafter = NgramDrafter(min_n=1, max_n=4)
    drafter.reset([5, 6, 7, 8, 9, 5, 6])
    assert drafter.propose(3) == Draft(tokens=[7, 8, 9], source="ngram", evidence=2)
    # committed 7, 8: suffix [5, 6, 7, 8] (n=4) occurred at 0, followed by 9, 5, 6
    drafter.observe([7, 8])
    assert drafter.propose(3) == Draft(tokens=[9, 5, 6], source="ngram", evidence=4)
    assert drafter.propose(0) == Draft(tokens=[], source="ngram", evidence=0)
    # reset forgets everything observed before: a fresh prompt with no repeat proposes nothing
    drafter.reset([1, 2, 3])
    assert drafter.propose(3) == Draft(tokens=[], source="ngram", evidence=0)
    drafter.observe([1])
    assert drafter.propose(3) == Draft(tokens=[2, 3, 1], source="ngram", evidence=1)


def test_drafter_respects_its_bounds():
    drafter = NgramDrafter(min_n=2, max_n=2)
    drafter.reset([1, 2, 3, 9, 3])  # only a 1-gram repeats
    assert drafter.propose(2) == Draft(tokens=[], source="ngram", evidence=0)
    drafter.observe([1, 2])  # ... 3, 1, 2: [1, 2] occurred at 0, followed by 3, 9
    assert drafter.propose(2) == Draft(tokens=[3, 9], source="ngram", evidence=2)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), max_size=20),
    steps=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6),
    k=st.integers(1, 5),
)
def test_drafter_matches_reference_on_prompt_plus_output(prompt, steps, k):
    drafter = NgramDrafter()
    drafter.reset(prompt)
    text = list(prompt)
    for committed in [[], *steps]:
        drafter.observe(committed)
        text.extend(committed)
        draft, n = propose_ngram(text, k)
        got = drafter.propose(k)
        assert (got.tokens, got.evidence, got.source) == (draft, n, "ngram")
