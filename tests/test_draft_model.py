# ruff: noqa: F811  (fixtures imported from test_sampling_distribution are redefined as arguments)
"""Model drafting is lossless: greedy output == plain, sampled output == plain sampling's with the seed.

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

from agentspec.drafting.draft_models import EarlyExitModel, ModuleDraft, PassDraft, early_exit_drafter, early_exit_model
from agentspec.drafting.model import ModelDrafter, check_vocab_compatible
from agentspec.engine import Engine
from agentspec.errors import ModelLoadError
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode, tiny_model
from .stats import chi2_sf_upper, chi_square
from .test_sampling_distribution import (  # noqa: F401  (fixtures)
    ALPHA,
    PROMPT,
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
    return loaded.with_model(LlamaForCausalLM(config).eval(), context_window=512)


@pytest.fixture(scope="module")
def target(loaded, one_thread):
    return tiny_model(loaded, seed=0)


@pytest.fixture(scope="module")
def drafts(loaded, target):
    return {
        "same": tiny_model(loaded, seed=0),
        "perturbed": target.with_model(Distorted(target.model, 0.3)),
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
            ModuleDraft(draft.model, target.device), p, target.vocab_size, target.device, **options
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
        ModuleDraft(drafts["same"].model, target.device),
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


# -- sampling: coupled with the target, token for token ------------------------------------------------

RUNS = 2000
SEEDS = range(16)


def sample_with(tiny, make_drafter, runs: int, seed_offset: int) -> tuple[Counter, int, int]:
    engine = Engine(tiny, drafter_factory=make_drafter)
    outcomes: Counter = Counter()
    drafted = accepted = 0
    for seed in range(seed_offset, seed_offset + runs):
        seq, _ = decode(engine, PROMPT, params(seed))
        outcomes[tuple(seq.tokens[len(PROMPT) :])] += 1
        drafted += seq.stats.drafted_tokens
        accepted += seq.stats.accepted_tokens
    return outcomes, drafted, accepted


def sampling(seed: int, k: int, **changes) -> GenerationParams:
    return GenerationParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=seed, spec=SpecConfig(adaptive=False, max_draft_tokens=k), **changes)


class UncoupledDrafter(ModelDrafter):
    """Samples its draft with noise of its own (another seed), not the target's at that position."""

    def __init__(self, model, params, *args, **options):
        super().__init__(model, dataclasses.replace(params, seed=params.seed + 1), *args, **options)


@pytest.mark.parametrize("name", ["same", "perturbed", "other", "padded"])
def test_model_drafting_sampling_equals_plain_sampling_per_seed(target, drafts, name):
    plain = Engine(target, drafter_factory=lambda p: None)
    engine = model_engine(target, drafts[name], min_confidence=0.0)
    drafted = accepted = 0
    for seed in SEEDS:
        expected, _ = decode(plain, PROMPTS[seed % len(PROMPTS)], sampling(seed, 0))
        got, _ = decode(engine, PROMPTS[seed % len(PROMPTS)], sampling(seed, 1 + seed % 6))
        assert got.tokens == expected.tokens, (name, seed)
        drafted += got.stats.drafted_tokens
        accepted += got.stats.accepted_tokens
    assert drafted > 40
    if name == "same":  # the same model drawing with the same noise: every draft token is the target's draw
        assert accepted == drafted


def test_an_uncoupled_draft_keeps_the_output_but_loses_acceptance(target, drafts):
    """Drawing the draft with other noise is still lossless (a draft token is kept only where it
    equals the target's draw), but even the target's own model then agrees only by chance."""
    plain = Engine(target, drafter_factory=lambda p: None)
    engine = Engine(target, drafter_factory=lambda p: UncoupledDrafter(ModuleDraft(drafts["same"].model, target.device), p, target.vocab_size, target.device, min_confidence=0.0))
    drafted = accepted = 0
    for seed in SEEDS:
        expected, _ = decode(plain, PROMPTS[0], sampling(seed, 0))
        got, _ = decode(engine, PROMPTS[0], sampling(seed, 4))
        assert got.tokens == expected.tokens, seed
        drafted += got.stats.drafted_tokens
        accepted += got.stats.accepted_tokens
    assert drafted > 40 and accepted < 0.8 * drafted


def test_model_drafting_sampling_matches_the_exact_law(tiny, exact):
    law, _ = exact
    draft = ModuleDraft(Distorted(tiny.model, 0.3), tiny.device)
    make = lambda p: ModelDrafter(draft, p, tiny.vocab_size, tiny.device, min_confidence=0.0)
    outcomes, drafted, accepted = sample_with(tiny, make, RUNS, seed_offset=0)
    assert drafted == RUNS and 0.2 * RUNS < accepted < 0.95 * RUNS  # both verification paths occur
    assert set(outcomes) <= set(law)
    statistic, df = chi_square(outcomes, law)
    assert chi2_sf_upper(statistic, df) > ALPHA, (statistic, df)


def test_grammar_tokens_then_a_model_draft_equal_plain_sampling(tiny, loaded):
    """Under sampling, a draft of grammar tokens (forced, then the held one) continued by a model
    commits what plain sampling under the same grammar and seed commits."""
    grammar = loaded.grammars.compile({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    plain = Engine(tiny, drafter_factory=lambda p: None)
    engine = Engine(tiny, drafter_factory=lambda p: ModelDrafter(ModuleDraft(Distorted(tiny.model, 0.3), tiny.device), p, tiny.vocab_size, tiny.device, min_confidence=0.0))
    from_model = 0
    for seed in range(6):
        expected, _ = decode(plain, PROMPT, sampling(seed, 0, top_k=3), grammar=grammar)
        got, _ = decode(engine, PROMPT, sampling(seed, 6, top_k=3), grammar=grammar)
        assert got.tokens == expected.tokens, seed
        from_model += got.stats.accepted_by_source.get("model", 0)
    assert from_model > 0


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


@pytest.mark.parametrize("on", ["modules", "fused pass"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_early_exit_greedy_equals_plain(four_layers, n, on):
    """On transformers' modules (no target pass given), or on the target's fused pass cut after n layers."""
    plain = Engine(four_layers, drafter_factory=lambda p: None, weights="fused")
    target = plain.forward if on == "fused pass" else None
    assert isinstance(early_exit_model(four_layers, n, target), PassDraft if target else ModuleDraft)
    engine = Engine(
        four_layers,
        drafter_factory=lambda p: early_exit_drafter(
            four_layers, n, p, target=target, min_confidence=0.0
        ),
        weights="fused",
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
    """Greedy equivalence with the target's first 20 of 30 layers as the draft (its block pass cut
    there); prints acceptance. (Without a trained exit head acceptance is low: see the report; this
    checks correctness.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # this module pins one thread for the tiny models
    try:
        plain = Engine(loaded, drafter_factory=lambda p: None)
        engine = Engine(
            loaded,
            drafter_factory=lambda p: early_exit_drafter(
                loaded, 20, p, target=plain.forward, min_confidence=0.0, max_tokens=3
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
