"""Speculative sampling is lossless end to end: per seed it commits plain sampling's tokens, and the
law of those tokens is the target's.

A tiny random Llama (sharing the real tokenizer) makes thousands of runs affordable. The exact joint
law of the two generated tokens under plain sampling is enumerated with the tiny model's own forward
passes and the same processing (temperature, then top-k). The speculative engine, fed random drafts
that are sometimes accepted and sometimes rejected, is run with many seeds: every run equals plain
decoding with its seed, and the outcomes pass a chi-square test against that law. The same harness
must reject a deliberately wrong sampler.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from agentspec.drafting.base import Draft
from agentspec.engine import Engine
from agentspec.engine import engine as engine_module
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode, tiny_model
from .stats import chi2_sf_upper, chi_square
from .test_verify import broken_sampling  # a wrong sampler, the law tests' negative control

PROMPT = [100, 200, 300]
TEMPERATURE, TOP_K = 0.8, 3
CANDIDATES = 4  # the drafter picks among the target's top 4: the 4th has probability 0 after top-3
DRAFT_WEIGHTS = [0.55, 0.15, 0.1, 0.2]  # how often the drafter picks the 1st..4th candidate
RUNS = 4000
BROKEN_RUNS = 2000
ALPHA = 1e-4  # chance that a correct engine fails (the seeds are fixed, so in fact it never flakes)


def params(seed: int) -> GenerationParams:
    return GenerationParams(
        temperature=TEMPERATURE,
        top_k=TOP_K,
        max_tokens=2,
        seed=seed,
        spec=SpecConfig(adaptive=False, max_draft_tokens=2),
    )


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is fastest, and immune to a busy second core (OpenMP
    spin-waiting on a shared 2-core machine makes these steps ~100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(loaded, one_thread):
    return tiny_model(loaded, init=0.5)


# -- the exact law of plain sampling ----------------------------------------------------------------------


@torch.inference_mode()
def processed(tiny, tokens: list[int]) -> tuple[dict[int, float], list[int]]:
    """Plain sampling's next-token law after ``tokens`` (temperature then top-k), and the top tokens."""
    logits = tiny.model(input_ids=torch.tensor([tokens])).logits[0, -1].double() / TEMPERATURE
    values, order = logits.topk(CANDIDATES)
    # the top-k support must not hinge on rounding: the k-th and (k+1)-th scores are well apart
    assert float(values[TOP_K - 1] - values[TOP_K]) > 1e-3
    probs = values[:TOP_K].softmax(dim=0)
    return {int(t): float(p) for t, p in zip(order[:TOP_K], probs)}, order.tolist()


@pytest.fixture(scope="module")
def exact(tiny, loaded):
    """(law over generated token tuples, the drafter's candidates per context)."""
    first, ranked = processed(tiny, PROMPT)
    candidates = {tuple(PROMPT): ranked}
    law: dict[tuple[int, ...], float] = {}
    for t1, p1 in first.items():
        if t1 in loaded.stop_token_ids:  # a stop token ends the sequence
            law[(t1,)] = p1
            continue
        second, ranked = processed(tiny, PROMPT + [t1])
        candidates[tuple(PROMPT + [t1])] = ranked
        for t2, p2 in second.items():
            law[(t1, t2)] = p1 * p2
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-9)
    return law, candidates


class WeightedTopDrafter:
    """Proposes, at each draft position, one of the target's top candidates, drawn at random.

    One-hot drafts (``probs=None``); its randomness is its own, independent of the engine's.
    """

    def __init__(self, candidates: dict[tuple[int, ...], list[int]], rng: random.Random) -> None:
        self.candidates, self.rng = candidates, rng
        self.tokens: list[int] = []

    def reset(self, prompt) -> None:
        self.tokens = list(prompt)

    def propose(self, k: int) -> Draft:
        draft: list[int] = []
        for _ in range(k):
            ranked = self.candidates.get(tuple(self.tokens + draft))
            if ranked is None:
                break
            draft.append(self.rng.choices(ranked, weights=DRAFT_WEIGHTS)[0])
        return Draft(tokens=draft, source="ngram", evidence=1)

    def observe(self, committed) -> None:
        self.tokens.extend(committed)


def make_engine(tiny, candidates) -> Engine:
    engine = Engine(tiny, drafter_factory=lambda p: WeightedTopDrafter(candidates, random.Random(f"drafter-{p.seed}")))
    engine.calibrate()
    return engine


def sample(engine: Engine, runs: int, seed_offset: int) -> tuple[list[tuple[int, ...]], dict[str, int]]:
    """The generated tokens of each seed's run, in seed order, and the speculation totals."""
    outputs = []
    totals = {"drafted": 0, "accepted": 0, "rejected": 0}
    for seed in range(seed_offset, seed_offset + runs):
        seq, _ = decode(engine, PROMPT, params(seed))
        outputs.append(tuple(seq.tokens[len(PROMPT) :]))
        totals["drafted"] += seq.stats.drafted_tokens
        totals["accepted"] += seq.stats.accepted_tokens
        totals["rejected"] += seq.stats.rollbacks
    return outputs, totals


@pytest.fixture(scope="module")
def plain_runs(tiny) -> list[tuple[int, ...]]:
    """Plain sampling's output for seeds 0 .. RUNS - 1."""
    engine = Engine(tiny, drafter_factory=lambda p: None)
    engine.calibrate()
    outputs, totals = sample(engine, RUNS, seed_offset=0)
    assert totals["drafted"] == 0
    return outputs


def test_chi2_bound_against_known_quantiles():
    # textbook 0.95 quantiles: chi2_2 = 5.991, chi2_8 = 15.507; odd df is bounded by df + 1
    assert chi2_sf_upper(5.991, 2) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf_upper(15.507, 8) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf_upper(11.070, 5) > 0.05  # chi2_5's 0.95 quantile: the bound is conservative


def test_speculative_sampling_equals_plain_per_seed_and_matches_the_exact_law(tiny, exact, plain_runs):
    law, candidates = exact
    assert len(law) >= 6 and min(law.values()) * RUNS >= 5  # a meaningful, valid chi-square test
    engine = make_engine(tiny, candidates)
    outputs, totals = sample(engine, RUNS, seed_offset=0)

    # every run drafted once (K capped to 1 by max_tokens=2), and both verification paths occurred
    assert totals["drafted"] == RUNS
    assert 0.2 * RUNS < totals["accepted"] < 0.8 * RUNS
    assert totals["rejected"] == RUNS - totals["accepted"]
    assert outputs == plain_runs  # token for token, whatever was drafted
    outcomes = Counter(outputs)
    # never a sequence plain sampling cannot produce (e.g. a token outside the top-k)
    assert set(outcomes) <= set(law), set(outcomes) - set(law)
    statistic, df = chi_square(outcomes, law)
    assert chi2_sf_upper(statistic, df) > ALPHA, (statistic, df, outcomes, law)


def test_the_harness_detects_a_wrong_sampler(tiny, exact, monkeypatch):
    law, candidates = exact
    monkeypatch.setattr(engine_module, "verify_sampling", broken_sampling)
    engine = make_engine(tiny, candidates)
    outputs, totals = sample(engine, BROKEN_RUNS, seed_offset=RUNS)
    assert totals["drafted"] == BROKEN_RUNS and totals["accepted"] > 0
    outcomes = Counter(outputs)
    # the wrong sampler still only produces possible sequences: only the statistics can tell
    assert set(outcomes) <= set(law)
    statistic, df = chi_square(outcomes, law)
    assert chi2_sf_upper(statistic, df) < ALPHA, (statistic, df)


def test_plain_sampling_matches_the_exact_law(exact, plain_runs):
    """The same law, without speculation: checks the reference enumeration itself."""
    law, _ = exact
    outcomes = Counter(plain_runs)
    assert set(outcomes) <= set(law)
    statistic, df = chi_square(outcomes, law)
    assert chi2_sf_upper(statistic, df) > ALPHA, (statistic, df)


def test_different_seeds_give_different_outputs(plain_runs):
    """A sampler that ignored its randomness would give one output for every seed."""
    assert len(set(plain_runs)) >= 6
    assert sum(a != b for a, b in zip(plain_runs, plain_runs[1:])) > RUNS // 4
