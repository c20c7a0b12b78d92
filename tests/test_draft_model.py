# ruff: noqa: F811  (fixtures imported from test_sampling_distribution are redefined as arguments)
"""Model drafting is lossless: greedy output == plain, sampling law == plain sampling's law.

Tiny random Llamas (sharing the real tokenizer) as target/draft pairs: the same weights (every draft
accepted), the target with a fixed logit bias (some accepted), another seed (almost none), and a draft whose embedding
matrix is padded to another size. Early exit runs on a tiny 4-layer model and on the real model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from agentspec.drafting.model import (
    EarlyExitModel,
    ModelDrafter,
    check_vocab_compatible,
    early_exit_drafter,
)
from agentspec.engine import Engine
from agentspec.errors import ModelLoadError
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode, tiny_model
from .test_sampling_distribution import (  # noqa: F401  (fixtures)
    ALPHA,
    PROMPT,
    chi2_sf_upper,
    chi_square,
    exact,
    one_thread,
    params,
    tiny,
)

PROMPTS = [
    [100, 200, 300],
    [5, 6, 7, 5, 6, 7, 5, 6],
    [42] * 3 + [1000, 2000, 3000, 4000],
]


class CheckedDrafter(ModelDrafter):
    """A ModelDrafter that checks its cache after every round: only committed tokens, all of them real."""

    rounds = 0

    def observe(self, committed) -> None:
        super().observe(committed)
        assert self.cached_length == len(self.cached) <= len(self.tokens)
        assert self.cached == self.tokens[: len(self.cached)]
        CheckedDrafter.rounds += 1


class Distorted:
    """A draft model: the target's logits plus a fixed random bias per token (std ``std``), so its
    distributions overlap the target's without being equal."""

    def __init__(self, model, std: float, seed: int = 1) -> None:
        self.model = model
        self.bias = (
            torch.randn(
                model.config.vocab_size, generator=torch.Generator().manual_seed(seed)
            )
            * std
        )

    def __call__(self, **inputs):
        return SimpleNamespace(logits=self.model(**inputs).logits + self.bias)


def padded(loaded, extra_rows: int, seed: int = 0):
    """tiny_model with its embedding matrix padded by ``extra_rows`` rows (as many checkpoints are)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=loaded.vocab_size + extra_rows, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, tie_word_embeddings=True,
    )  # fmt: skip
    return dataclasses.replace(
        loaded, model=LlamaForCausalLM(config).eval(), context_window=512
    )


@pytest.fixture(scope="module")
def target(loaded, one_thread):
    return tiny_model(loaded, seed=0)


@pytest.fixture(scope="module")
def drafts(loaded, target):
    return {
        "same": tiny_model(loaded, seed=0),
        "perturbed": dataclasses.replace(target, model=Distorted(target.model, 0.3)),
        "other": tiny_model(loaded, seed=1),
        "padded": padded(loaded, 37, seed=3),
    }


def greedy(k: int, max_tokens: int = 24) -> GenerationParams:
    return GenerationParams(
        max_tokens=max_tokens, spec=SpecConfig(adaptive=False, max_draft_tokens=k)
    )


def model_engine(target, draft, **options) -> Engine:
    check_vocab_compatible(target, draft)
    options = {"min_confidence": 0.0, "max_tokens": 16} | options
    return Engine(
        target,
        drafter_factory=lambda p: CheckedDrafter(
            draft.model, p, target.vocab_size, target.device, **options
        ),
    )


def test_greedy_model_drafting_equals_plain_for_every_k(target, drafts):
    plain = Engine(target, drafter_factory=lambda p: None)
    expected = {
        i: decode(plain, prompt, greedy(0))[0].output_ids
        for i, prompt in enumerate(PROMPTS)
    }
    accepted: Counter = Counter()
    drafted: Counter = Counter()
    CheckedDrafter.rounds = 0
    for name, draft in drafts.items():
        engine = model_engine(target, draft)
        for k in range(1, 9):
            for i, prompt in enumerate(PROMPTS):
                seq, _ = decode(engine, prompt, greedy(k))
                assert seq.output_ids == expected[i], (name, k, i)
                accepted[name] += seq.stats.accepted_tokens
                drafted[name] += seq.stats.drafted_tokens
    assert (
        CheckedDrafter.rounds > 500
    )  # the cache invariant was checked after every round
    assert (
        drafted["same"] == accepted["same"] > 0
    )  # identical draft: every token accepted
    assert (
        0 < accepted["perturbed"] < drafted["perturbed"]
    )  # accepts and rejects both happen
    assert accepted["other"] < drafted["other"]


def test_penalty_and_after_tokens_keep_greedy_output(target, drafts):
    """Repetition penalty in the draft's processing; grammar-like `after` tokens fed speculatively."""
    params = GenerationParams(
        max_tokens=24,
        repetition_penalty=1.3,
        spec=SpecConfig(adaptive=False, max_draft_tokens=4),
    )
    plain, _ = decode(
        Engine(target, drafter_factory=lambda p: None), PROMPTS[1], params
    )
    seq, _ = decode(model_engine(target, drafts["same"]), PROMPTS[1], params)
    assert seq.output_ids == plain.output_ids
    assert (
        seq.stats.accepted_tokens == seq.stats.drafted_tokens > 0
    )  # same penalty → same argmax

    drafter = CheckedDrafter(
        drafts["same"].model,
        greedy(4),
        target.vocab_size,
        target.device,
        min_confidence=0.0,
    )
    drafter.reset(PROMPTS[0])
    first = drafter.propose(4)
    after = drafter.propose(
        3, after=first.tokens[:1]
    )  # as if the grammar had forced the first token
    assert after.tokens == first.tokens[1:4]
    drafter.observe(first.tokens[:2])
    assert drafter.cached == drafter.tokens[: len(drafter.cached)]


def test_vocab_compatibility(loaded, drafts):
    check_vocab_compatible(
        loaded, drafts["padded"]
    )  # same tokenizer, padded embeddings: fine

    class Swapped:  # a tokenizer that maps two tokens to each other's ids
        def get_vocab(self):
            vocab = dict(loaded.tokenizer.get_vocab())
            a, b = [t for t, i in vocab.items() if i in (500, 501)]
            vocab[a], vocab[b] = vocab[b], vocab[a]
            return vocab

    with pytest.raises(ModelLoadError, match="token id 500"):
        check_vocab_compatible(loaded, Swapped())


# -- sampling: the law of the first two tokens --------------------------------------------------------

RUNS = 2000


def sample_with(
    tiny, make_drafter, runs: int, seed_offset: int
) -> tuple[Counter, int, int]:
    engine = Engine(tiny, drafter_factory=make_drafter)
    outcomes: Counter = Counter()
    drafted = accepted = 0
    for seed in range(seed_offset, seed_offset + runs):
        seq, _ = decode(engine, PROMPT, params(seed))
        outcomes[tuple(seq.tokens[len(PROMPT) :])] += 1
        drafted += seq.stats.drafted_tokens
        accepted += seq.stats.accepted_tokens
    return outcomes, drafted, accepted


class MislabelledDrafter(ModelDrafter):
    """Samples from its processed distribution q but reports the unprocessed softmax (temperature 1,
    no top-k): probabilities that are not the law its tokens came from, so sampling is not exact."""

    def _choose(self, logits, extra):
        token, _, confidence = super()._choose(logits, extra)
        return token, logits.softmax(dim=-1), confidence


def test_model_drafting_sampling_matches_the_exact_law(tiny, exact):
    law, _ = exact
    draft = Distorted(tiny.model, 0.3)
    make = lambda p: ModelDrafter(
        draft, p, tiny.vocab_size, tiny.device, min_confidence=0.0
    )
    outcomes, drafted, accepted = sample_with(tiny, make, RUNS, seed_offset=0)
    assert (
        drafted == RUNS and 0.2 * RUNS < accepted < 0.95 * RUNS
    )  # both verification paths occur
    assert set(outcomes) <= set(law)
    statistic, df = chi_square(outcomes, law)
    assert chi2_sf_upper(statistic, df) > ALPHA, (statistic, df)


def test_the_harness_detects_mislabelled_draft_probabilities(tiny, exact):
    law, _ = exact
    draft = Distorted(tiny.model, 0.3)
    make = lambda p: MislabelledDrafter(
        draft, p, tiny.vocab_size, tiny.device, min_confidence=0.0
    )
    outcomes, drafted, _ = sample_with(tiny, make, RUNS, seed_offset=RUNS)
    assert drafted == RUNS
    statistic, df = chi_square(
        outcomes, law
    )  # an impossible sequence counts as infinitely unlikely
    assert not set(outcomes) <= set(law) or chi2_sf_upper(statistic, df) < ALPHA, (
        statistic,
        df,
    )


def test_draft_probs_are_the_processed_distribution(tiny):
    """probs rows are distributions over the target's vocabulary, zero outside top-k (not one-hot)."""
    drafter = ModelDrafter(
        Distorted(tiny.model, 0.3),
        params(0),
        tiny.vocab_size,
        tiny.device,
        min_confidence=0.0,
    )
    drafter.reset(PROMPT)
    draft = drafter.propose(2)
    assert draft.probs.shape == (2, tiny.vocab_size)
    assert torch.allclose(draft.probs.sum(dim=-1), torch.ones(2))
    assert ((draft.probs > 0).sum(dim=-1) == 3).all()  # top_k = 3, and not one-hot


def test_grammar_tokens_before_a_model_draft_are_one_hot_rows(tiny, loaded, monkeypatch):
    """Under sampling, a draft of grammar tokens (forced, then the held one) continued by a model
    carries a probability row per token: one-hot for the grammar's, the model's for its own. Every
    drafted token has positive draft probability, the premise of rejection sampling."""
    from agentspec.engine import engine as engine_module
    from agentspec.engine.verify import NO_TOKEN

    calls = []  # per sequence verified: (its draft tokens [K], the draft rows verification got [K+1, V])

    def recording(target_probs, draft_tokens, draft_probs, uniforms, counts):
        """Splits the pass's flattened rows back into its sequences (K_s draft rows, then a bonus row)."""
        assert draft_tokens.shape[0] == draft_probs.shape[0] == int((counts + 1).sum())
        start = 0
        for k in counts.tolist():
            tokens, rows = draft_tokens[start : start + k + 1].clone(), draft_probs[start : start + k + 1].clone()
            assert tokens[k] == NO_TOKEN and not rows[k].any()  # the bonus row: nothing proposed
            calls.append((tokens[:k], rows))
            start += k + 1
        return real(target_probs, draft_tokens, draft_probs, uniforms, counts)

    real = engine_module.verify_sampling
    monkeypatch.setattr(engine_module, "verify_sampling", recording)
    grammar = loaded.grammars.compile({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    engine = Engine(
        tiny,
        drafter_factory=lambda p: ModelDrafter(Distorted(tiny.model, 0.3), p, tiny.vocab_size, tiny.device, min_confidence=0.0),
    )
    sampling = dataclasses.replace(params(0), max_tokens=12, spec=SpecConfig(adaptive=False, max_draft_tokens=6))
    for seed in range(3):
        decode(engine, PROMPT, dataclasses.replace(sampling, seed=seed), grammar=grammar)
    # every row is one-hot (a deterministic draft token) or the model's (top_k = 3: never one-hot)
    model_row = [[int((row > 0).sum()) > 1 for row in rows[: tokens.shape[0]]] for tokens, rows in calls]
    with_rows = [(tokens, rows) for (tokens, rows), model in zip(calls, model_row) if any(model)]
    assert with_rows
    for tokens, rows in with_rows:
        assert rows.shape[0] >= tokens.shape[0]
        assert (rows[torch.arange(tokens.shape[0]), tokens] > 0).all()
    for tokens, rows in calls:  # deterministic drafts too: every drafted token is possible under q
        assert (rows[torch.arange(tokens.shape[0]), tokens] > 0).all()
    # the first step's draft starts with the forced `{"name` and is continued by the model
    (first_tokens, first_rows), first_model = calls[0], model_row[0]
    assert any(first_model) and first_rows[0, first_tokens[0]] == 1.0


# -- early exit ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_layers(loaded, one_thread):
    return tiny_model(loaded, seed=5, layers=4, init=0.3)


@pytest.mark.parametrize("n", [0, 4, -1, 1.5, True])
def test_early_exit_rejects_bad_layer_counts(four_layers, n):
    with pytest.raises(ModelLoadError, match="from 1 to 3"):
        EarlyExitModel(four_layers.model, n)


def test_early_exit_shares_the_targets_weights(four_layers):
    model = four_layers.model
    exit_model = EarlyExitModel(model, 2)
    assert (
        exit_model.embed_tokens.weight.data_ptr()
        == model.model.embed_tokens.weight.data_ptr()
    )
    assert (
        exit_model.layers[1].self_attn.q_proj.weight.data_ptr()
        == model.model.layers[1].self_attn.q_proj.weight.data_ptr()
    )
    assert exit_model.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert len(exit_model.layers) == 2


@torch.inference_mode()
def test_early_exit_logits_equal_a_truncated_model(four_layers):
    """Fed in chunks through its cache, N layers give the logits of the model cut to N layers."""
    from transformers import DynamicCache

    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])
    truncated = copy.deepcopy(four_layers.model)
    truncated.config.num_hidden_layers = (
        2  # LlamaModel.forward runs layers[:num_hidden_layers]
    )
    reference = truncated(input_ids=tokens).logits[0]
    exit_model, cache = EarlyExitModel(four_layers.model, 2), DynamicCache()
    rows = [
        exit_model(input_ids=tokens[:, a:b], cache=cache, logits_to_keep=0).logits[0]
        for a, b in [(0, 6), (6, 7), (7, 10)]
    ]
    assert torch.allclose(torch.cat(rows), reference, atol=1e-4)
    assert cache.get_seq_length() == 10


@pytest.mark.parametrize("n", [1, 2, 3])
def test_early_exit_greedy_equals_plain(four_layers, n):
    plain = Engine(four_layers, drafter_factory=lambda p: None)
    engine = Engine(
        four_layers,
        drafter_factory=lambda p: early_exit_drafter(
            four_layers, n, p, min_confidence=0.0
        ),
    )
    for k in (1, 3, 6):
        for prompt in PROMPTS:
            expected = decode(plain, prompt, greedy(0))[0].output_ids
            assert decode(engine, prompt, greedy(k))[0].output_ids == expected, (
                n,
                k,
                prompt,
            )


REAL_PROMPTS = [
    "Count from 1 to 20, separated by commas.",
    "Write a Python function that reverses a string.",
]


def test_early_exit_on_the_real_model(loaded, capsys):
    """Greedy equivalence with the target's first 20 of 30 layers as the draft; prints acceptance.
    (Without a trained exit head acceptance is low: see the report; this checks correctness.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # this module pins one thread for the tiny models
    try:
        plain = Engine(loaded, drafter_factory=lambda p: None)
        engine = Engine(
            loaded,
            drafter_factory=lambda p: early_exit_drafter(
                loaded, 20, p, min_confidence=0.0, max_tokens=3
            ),
        )
        drafted = accepted = passes = tokens = 0
        for text in REAL_PROMPTS:
            prompt = loaded.chat.encode([{"role": "user", "content": text}])
            expected = decode(plain, prompt, greedy(0, max_tokens=12))[0].output_ids
            seq, _ = decode(engine, prompt, greedy(3, max_tokens=12))
            assert seq.output_ids == expected, text
            drafted, accepted = (
                drafted + seq.stats.drafted_tokens,
                accepted + seq.stats.accepted_tokens,
            )
            passes, tokens = (
                passes + seq.stats.target_forward_passes,
                tokens + seq.generated,
            )
    finally:
        torch.set_num_threads(threads)
    assert drafted > 0
    with capsys.disabled():
        print(
            f"\nearly-exit:20 on the real model: acceptance {accepted}/{drafted} = {accepted / drafted:.2f}, {tokens / passes:.2f} tokens per target pass"
        )
