"""Draft-length budgeting: expected tokens, the cost model's padding, the acceptance model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.drafting.acceptance import Acceptance, AcceptanceModel, expected_tokens
from agentspec.engine.lengths import CostModel, RowBudget, choose_lengths


def choose_draft_length(available: int, first: float, costs: CostModel, rest: float | None = None) -> int:
    """The case of one sequence alone in its pass: its one uncached token and ``available`` drafts."""
    acceptance = Acceptance(first, first if rest is None else rest)
    return choose_lengths([RowBudget(1, 1.0, available, acceptance)], costs)[0]


def brute_force_expected(acceptance: float, k: int, rest: float | None = None) -> float:
    """Enumerate every accept/reject pattern of the k draft tokens: a step commits the accepted run
    (up to the first rejection) plus one recovered or bonus token. Token 0 is accepted with
    ``acceptance``, later tokens with ``rest`` (default: the same)."""
    rest = acceptance if rest is None else rest
    total = 0.0
    for pattern in itertools.product([True, False], repeat=k):
        probability = 1.0
        for i, accepted in enumerate(pattern):
            a = acceptance if i == 0 else rest
            probability *= a if accepted else 1.0 - a
        run = next((i for i, accepted in enumerate(pattern) if not accepted), k)
        total += probability * (run + 1)
    return total


@pytest.mark.parametrize("acceptance", [0.0, 0.1, 0.5, 0.75, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("k", range(0, 9))
def test_expected_tokens_matches_enumeration(acceptance, k):
    assert expected_tokens(acceptance, k) == pytest.approx(brute_force_expected(acceptance, k), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(("first", "rest"), [(0.3, 0.9), (0.9, 0.3), (0.0, 1.0), (1.0, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("k", range(0, 7))
def test_expected_tokens_with_two_rates(first, rest, k):
    assert expected_tokens(first, k, rest) == pytest.approx(brute_force_expected(first, k, rest), rel=1e-12, abs=1e-12)


def test_a_likely_continuation_makes_longer_drafts_worth_it():
    flat = costs_from({p: 10.0 + p for p in range(1, 10)})
    assert choose_draft_length(8, 0.4, flat, rest=0.4) < choose_draft_length(8, 0.4, flat, rest=0.95)


@pytest.mark.parametrize(("acceptance", "k", "expected"), [(0.0, 5, 1.0), (1.0, 5, 6.0), (0.5, 1, 1.5), (0.5, 2, 1.75)])
def test_expected_tokens_by_hand(acceptance, k, expected):
    assert expected_tokens(acceptance, k) == pytest.approx(expected)


def costs_from(table: dict[int, float], max_positions: int = 9) -> CostModel:
    costs = CostModel(max_positions=max_positions)
    for positions, ms in table.items():
        costs.record(positions, ms)
    return costs


def brute_force_best_k(available: int, acceptance: float, cost_of) -> int:
    """The first k in 0..available maximising (sum_{j<=k} a^j) / cost(k + 1)."""
    rates = [sum(acceptance**j for j in range(k + 1)) / cost_of(k + 1) for k in range(available + 1)]
    return max(range(available + 1), key=lambda k: (rates[k], -k))


FLAT = {p: 10.0 for p in range(1, 10)}
LINEAR = {p: 10.0 * p for p in range(1, 10)}
AFFINE = {p: 20.0 + 5.0 * p for p in range(1, 10)}  # a fixed overhead plus a per-position cost


@pytest.mark.parametrize("acceptance", [0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 0.99])
@pytest.mark.parametrize(("name", "table"), [("flat", FLAT), ("linear", LINEAR), ("affine", AFFINE)])
@pytest.mark.parametrize("available", [0, 1, 3, 8])
def test_choose_draft_length_matches_brute_force(name, table, acceptance, available):
    costs = costs_from(table)
    assert choose_draft_length(available, acceptance, costs) == brute_force_best_k(available, acceptance, table.__getitem__)


def test_flat_cost_drafts_everything_unless_nothing_is_accepted():
    costs = costs_from(FLAT)
    assert choose_draft_length(8, 0.0, costs) == 0
    for acceptance in [0.01, 0.3, 0.9]:
        assert choose_draft_length(8, acceptance, costs) == 8


def test_linear_cost_never_speculates():
    # k drafts cost k + 1 passes' worth but commit fewer than k + 1 tokens on average
    costs = costs_from(LINEAR)
    for acceptance in [0.0, 0.5, 0.9, 0.99]:
        assert choose_draft_length(8, acceptance, costs) == 0


def test_uncalibrated_never_speculates():
    assert choose_draft_length(8, 0.9, CostModel(max_positions=9)) == 0


def test_draft_length_grows_with_acceptance():
    costs = costs_from(AFFINE)
    lengths = [choose_draft_length(8, a / 100, costs) for a in range(0, 100, 2)]
    assert lengths == sorted(lengths)
    assert lengths[0] == 0 and lengths[2] == 0  # acceptance 0 and 0.04: plain steps
    assert lengths[-1] == 8  # acceptance 0.98: the whole draft
    assert len(set(lengths)) >= 4  # it really moves in between


# -- CostModel ------------------------------------------------------------------------------------------


def test_best_shape_pads_to_a_cheaper_larger_shape():
    costs = costs_from({1: 50.0, 2: 70.0, 3: 80.0, 4: 55.0, 5: 90.0}, max_positions=5)
    assert costs.best_shape(1) == 1  # 50 is the cheapest of all
    assert costs.best_shape(2) == 4  # 70 > 55
    assert costs.best_shape(3) == 4
    assert costs.best_shape(4) == 4
    assert costs.best_shape(5) == 5
    assert costs.effective_cost(2) == 55.0
    assert costs.effective_cost(1) == 50.0


def test_best_shape_prefers_the_smaller_of_equal_costs():
    costs = costs_from({2: 40.0, 3: 40.0, 4: 40.0}, max_positions=4)
    assert costs.best_shape(2) == 2
    assert costs.best_shape(3) == 3


def test_best_shape_without_measurements():
    costs = costs_from({2: 10.0}, max_positions=4)
    assert costs.best_shape(3) == 3  # nothing measured at 3 or above
    assert costs.best_shape(7) == 7  # beyond the model
    assert CostModel(max_positions=4).best_shape(2) == 2


def test_padding_makes_drafting_pay():
    # 2-3 positions cost more than 4 (as on a 2-core CPU): one draft token is verified as a 4-shape
    costs = costs_from({1: 50.0, 2: 70.0, 3: 80.0, 4: 55.0}, max_positions=4)
    # with padding, k = 1..3 all cost 55: per ms, k = 3 is best once drafts are accepted often
    assert choose_draft_length(3, 0.8, costs) == 3
    # k=0 costs 50; k=1 would commit 1 + a tokens for 55 ms: worth it iff a > 0.1
    assert choose_draft_length(1, 0.05, costs) == 0
    assert choose_draft_length(1, 0.15, costs) == 1


@settings(max_examples=200, deadline=None)
@given(
    measured=st.dictionaries(st.integers(1, 9), st.floats(1.0, 100.0), max_size=9),
    positions=st.integers(1, 12),
)
def test_best_shape_properties(measured, positions):
    costs = costs_from(measured, max_positions=9)
    shape = costs.best_shape(positions)
    assert shape >= positions  # never fewer positions than asked
    at_least = {p: ms for p, ms in measured.items() if p >= positions}
    if at_least:
        assert shape in at_least
        assert at_least[shape] == min(at_least.values())  # the cheapest of them
    else:
        assert shape == positions


def test_cost_is_the_fastest_latest_pass_and_extrapolates():
    costs = CostModel(max_positions=4)
    assert costs.cost(3) == 3.0  # uncalibrated: proportional to positions
    costs.record(2, 100.0)
    costs.record(2, 50.0)
    assert costs.cost(2) == 50.0
    assert costs.cost(4) == pytest.approx(100.0)  # nearest measured is 2: scaled linearly
    assert costs.cost(1) == pytest.approx(50.0)  # below the nearest: not scaled down
    costs.record(9, 1.0)  # beyond max_positions: ignored
    assert costs.cost(4) == pytest.approx(100.0)


def test_one_slow_pass_does_not_move_the_cost_but_a_slower_machine_does():
    """Interference only adds time: a verification slowed 5x by another process leaves its shape's
    cost as it was (an average would have raised it 80%, and a shape that looks slow is not chosen
    again, so never measured again). WINDOW slower passes in a row are the machine: they count."""
    costs = CostModel(max_positions=4)
    for _ in range(3):
        costs.record(4, 10.0)
    costs.record(4, 50.0)
    assert costs.cost(4) == 10.0
    for _ in range(CostModel.WINDOW):
        costs.record(4, 14.0)
    assert costs.cost(4) == 14.0


def test_effective_cost_follows_every_new_measurement():
    """effective_cost is worked out once per measurement: a record, or a copy, changes it."""
    costs = CostModel(max_positions=4)
    costs.record(1, 10.0)
    costs.record(4, 20.0)
    assert [costs.effective_cost(p) for p in (1, 2, 3, 4, 6)] == [10.0, 20.0, 20.0, 20.0, 30.0]
    costs.record(2, 12.0)  # now measured, and cheaper than padding to 4
    assert [costs.effective_cost(p) for p in (1, 2, 3, 4)] == [10.0, 12.0, 20.0, 20.0]
    other = CostModel(max_positions=4)
    other.record(1, 5.0)
    other.record(4, 6.0)
    costs.copy_from(other)  # position 2 unmeasured there: copied as unmeasured
    assert [costs.effective_cost(p) for p in (1, 2, 3, 4)] == [5.0, 6.0, 6.0, 6.0]
    assert all(costs.effective_cost(p) == costs.cost(costs.best_shape(p)) for p in range(1, 9))


# -- AcceptanceModel ------------------------------------------------------------------------------------


def test_acceptance_starts_at_the_prior():
    model = AcceptanceModel()
    expected = {1: 0.3, 2: 0.4, 3: 0.5, 4: 0.6, 5: 0.7, 6: 0.8, 7: 0.8, 8: 0.8}  # 0.3, +0.1 per token, <= 0.8
    for evidence, prior in expected.items():
        assert model.rate("ngram", evidence) == pytest.approx((prior, AcceptanceModel.PRIOR_REST))
    assert model.rate("ngram", 0).first == pytest.approx(0.3)  # clamped to 1..MAX_EVIDENCE
    assert model.rate("ngram", 20).first == pytest.approx(0.8)


def test_acceptance_worked_example():
    w, rest_prior = AcceptanceModel.PRIOR_WEIGHT, AcceptanceModel.PRIOR_REST
    model = AcceptanceModel()
    # 4 drafted, 2 accepted: the first token was right; of the later ones 1 right, then a rejection
    model.observe("ngram", 2, drafted=4, accepted=2)
    assert model.rate("ngram", 2).first == pytest.approx((1 + 0.4 * w) / (1 + w))
    assert model.rate("ngram", 2).rest == pytest.approx((1 + rest_prior * w) / (2 + w))
    model = AcceptanceModel()
    model.observe("ngram", 4, drafted=4, accepted=4)  # first right; later: 3 of 3
    model.observe("ngram", 4, drafted=4, accepted=0)  # old evidence * 0.9, then a wrong first token
    assert model.rate("ngram", 4).first == pytest.approx((0.9 + 0.6 * w) / (1.9 + w))
    assert model.rate("ngram", 4).rest == pytest.approx((2.7 + rest_prior * w) / (2.7 + w))
    model = AcceptanceModel()
    model.observe("ngram", 3, drafted=1, accepted=1)  # a one-token draft says nothing about later tokens
    assert model.rate("ngram", 3).rest == pytest.approx(rest_prior)


def test_acceptance_moves_toward_observed_rates():
    model = AcceptanceModel()
    rates = [model.rate("ngram", 3)]
    for _ in range(30):
        model.observe("ngram", 3, drafted=4, accepted=4)
        rates.append(model.rate("ngram", 3))
    # decayed counts saturate at 1 / (1 - DECAY) = 10 first-token trials: (10 + 0.5 * 2) / (10 + 2)
    assert [r.first for r in rates] == sorted(r.first for r in rates) and rates[-1].first > 0.9
    assert rates[-1].rest > 0.95
    rates = [rates[-1]]
    for _ in range(30):
        model.observe("ngram", 3, drafted=4, accepted=0)
        rates.append(model.rate("ngram", 3))
    assert [r.first for r in rates] == sorted((r.first for r in rates), reverse=True)
    # without decay the 30 early successes would still dominate (> 0.5); with it, recent evidence does:
    # (10 * 0.9^30 + 0.5 * 2) / (10 + 2) = 0.12
    assert rates[-1].first < 0.15


def test_acceptance_buckets_are_independent():
    model = AcceptanceModel()
    for _ in range(10):
        model.observe("ngram", 1, drafted=3, accepted=0)
    assert model.rate("ngram", 1).first < 0.1
    assert model.rate("ngram", 2).first == pytest.approx(AcceptanceModel.prior(2))
    assert model.rate("model", 1).first == pytest.approx(AcceptanceModel.prior(1))
    model.observe("ngram", 12, drafted=2, accepted=2)  # evidence above MAX_EVIDENCE shares the top bucket
    top = AcceptanceModel.MAX_EVIDENCE
    assert model.rate("ngram", top).first > AcceptanceModel.prior(top)


def test_acceptance_ignores_empty_drafts():
    model = AcceptanceModel()
    model.observe("ngram", 2, drafted=0, accepted=0)
    assert model.rate("ngram", 2) == pytest.approx((AcceptanceModel.prior(2), AcceptanceModel.PRIOR_REST))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), max_size=30))
def test_acceptance_rate_stays_a_probability(steps):
    model = AcceptanceModel()
    for drafted, accepted in steps:
        model.observe("ngram", 2, drafted=drafted, accepted=min(accepted, drafted))
        first, rest = model.rate("ngram", 2)
        assert 0.0 <= first <= 1.0 and 0.0 <= rest <= 1.0


def test_passes_of_many_sequences_keep_the_curve_per_sequence():
    costs = CostModel(max_positions=8)
    costs.segment_ms = 2.0
    costs.record(8, 70.0, segments=6)  # 10 ms of it were the 5 further sequences
    assert costs.cost(8) == 60.0
    assert costs.pass_cost(8, segments=6) == 70.0
