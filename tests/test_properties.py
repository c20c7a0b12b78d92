"""Property-based tests (hypothesis): verification, detokenization, and the engine.

Each property is checked on generated inputs against a reference that is obviously right:
- verification: a plain Python loop for greedy; for seeded sampling, support and acceptance
  invariants, and the committed tokens are plain sampling's draws whatever was drafted;
- detokenization: the original string, however the tokens are grouped;
- the engine (tiny random model): plain decoding's token ids, for random prompts, K and stops.
Stop strings under any chunking: tests/test_text.py.
"""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentspec.drafting import Draft
from agentspec.engine import Engine
from agentspec.params import GenerationParams
from agentspec.text import TokenDecoder
from agentspec.types import SpecConfig
from agentspec.engine.verify import NO_TOKEN, flatten, verify_greedy, verify_sampling
from agentspec.sampling import position_keys, sample

from .conftest import decode, tiny_model

FAST = settings(max_examples=200, deadline=None)
# the `loaded` fixture is session-scoped: reusing it across examples is intended
WITH_MODEL = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}

VOCAB = 6  # small, so drafts and targets agree often enough to exercise every branch


# -- verification: greedy ------------------------------------------------------------------------------

def greedy_reference(target_tokens: list[int], draft_tokens: list[int]) -> tuple[int, int]:
    for i, token in enumerate(draft_tokens):
        if target_tokens[i] != token:
            return i, target_tokens[i]
    return len(draft_tokens), target_tokens[len(draft_tokens)]


@FAST
@given(st.integers(0, 8).flatmap(lambda k: st.tuples(
    st.lists(st.integers(0, VOCAB - 1), min_size=k + 1, max_size=k + 1),
    st.lists(st.integers(0, 2), min_size=k, max_size=k),  # drafts from a narrower range: long matches happen
)))
def test_greedy_matches_the_reference_loop(case):
    target, draft = case
    accepted, token = verify_greedy(torch.tensor(target), torch.tensor([*draft, NO_TOKEN]), torch.tensor([len(draft)]))
    assert (int(accepted[0]), int(token[0])) == greedy_reference(target, draft)


@FAST
@given(st.lists(st.integers(0, 8).flatmap(lambda k: st.tuples(
    st.lists(st.integers(0, VOCAB - 1), min_size=k + 1, max_size=k + 1),
    st.lists(st.integers(0, 2), min_size=k, max_size=k),
)), min_size=1, max_size=6))
def test_greedy_over_a_flattened_pass_matches_the_reference_loop_per_sequence(cases):
    target = torch.tensor([t for target, _ in cases for t in target])
    drafted = torch.tensor([t for _, draft in cases for t in (*draft, NO_TOKEN)])
    accepted, tokens = verify_greedy(target, drafted, torch.tensor([len(draft) for _, draft in cases]))
    assert list(zip(accepted.tolist(), tokens.tolist())) == [greedy_reference(target, draft) for target, draft in cases]


# -- verification: seeded sampling ----------------------------------------------------------------------

def random_probs(generator: torch.Generator, rows: int, sparsity: float, scale: float = 2.0) -> torch.Tensor:
    """[rows, VOCAB] distributions with some exact zeros (so 'support' means something)."""
    logits = torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64) * scale
    dropped = torch.rand(rows, VOCAB, generator=generator, dtype=torch.float64) < sparsity
    dropped[torch.arange(rows), logits.argmax(dim=1)] = False  # every row keeps at least one token
    probs = logits.masked_fill(dropped, float("-inf")).softmax(dim=1)
    return probs.float()


def case_keys(case: dict) -> torch.Tensor:
    """[K+1] the rows' noise keys, as the engine builds them: the request's seed, the rows' output positions."""
    start = case["start"]
    return torch.tensor(position_keys(case["seed"], range(start, start + case["k"] + 1)), dtype=torch.int32)


def verify_one(target_probs: torch.Tensor, draft_tokens: list[int], keys: torch.Tensor) -> tuple[int, int]:
    """``verify_sampling`` on one sequence, its draft flattened as the engine flattens it."""
    drafted, counts = flatten([draft_tokens], torch.device("cpu"))
    accepted, token = verify_sampling(target_probs, drafted, keys, counts)
    return int(accepted[0]), int(token[0])


def committed(draft_tokens: list[int], verdict: tuple[int, int]) -> list[int]:
    accepted, token = verdict
    return [*draft_tokens[:accepted], token]


sampling_case = st.fixed_dictionaries(
    {
        "k": st.integers(0, 8),  # the draft's length: K + 1 rows
        "data": st.integers(0, 2**32 - 1),  # seeds the distributions and drafts
        "seed": st.integers(0, 2**63 - 1),  # the request's sampling seed
        "start": st.integers(0, 10**6),  # the output position of the pass's first row
        "sparsity": st.sampled_from([0.0, 0.3, 0.7]),
    }
)


def target_and_draft(case: dict) -> tuple[torch.Tensor, list[int]]:
    """[K+1, VOCAB] target rows, and K draft tokens: at each position the target's own draw or any
    token (possible or not), so drafts are accepted whole, in part or not at all."""
    k, generator = case["k"], torch.Generator().manual_seed(case["data"])
    target_probs = random_probs(generator, k + 1, case["sparsity"])
    draws = sample(target_probs[:k], case_keys(case)[:k])
    anything = torch.randint(0, VOCAB, (k,), generator=generator)
    return target_probs, torch.where(torch.rand(k, generator=generator) < 0.6, draws, anything).tolist()


@FAST
@given(sampling_case)
def test_sampling_accepts_only_possible_tokens_and_commits_a_possible_one(case):
    target_probs, draft_tokens = target_and_draft(case)
    k = case["k"]
    accepted, token = verify_one(target_probs, draft_tokens, case_keys(case))
    assert 0 <= accepted <= k
    for i in range(accepted):  # an accepted draft token is one the target could have produced
        assert target_probs[i, draft_tokens[i]] > 0
    assert target_probs[accepted, token] > 0  # the recovered or bonus token too
    if accepted < k:  # a rejected draft token is not what gets committed in its place
        assert token != draft_tokens[accepted]


@FAST
@given(sampling_case)
def test_drafting_the_target_s_own_draws_is_always_accepted(case):
    k, generator = case["k"], torch.Generator().manual_seed(case["data"])
    target_probs = random_probs(generator, k + 1, case["sparsity"])
    draws = sample(target_probs, case_keys(case)).tolist()  # [K+1] plain sampling's tokens
    assert verify_one(target_probs, draws[:k], case_keys(case)) == (k, draws[k])


@FAST
@given(sampling_case)
def test_drafting_the_argmax_of_one_hot_targets_is_always_accepted(case):
    k, generator = case["k"], torch.Generator().manual_seed(case["data"])
    argmax = torch.randint(0, VOCAB, (k + 1,), generator=generator)
    target_probs = torch.nn.functional.one_hot(argmax, VOCAB).float()
    assert verify_one(target_probs, argmax[:k].tolist(), case_keys(case)) == (k, int(argmax[k]))


@FAST
@given(sampling_case, st.lists(st.integers(0, VOCAB - 1), max_size=8))
def test_the_committed_tokens_are_plain_sampling_s_whatever_the_draft(case, other_draft):
    """The verdict is a function of (distributions, keys): the same inputs give the same verdict, and
    any two drafts commit plain sampling's draws, so they agree wherever both commit."""
    target_probs, draft_tokens = target_and_draft(case)
    keys = case_keys(case)
    verdict = verify_one(target_probs, draft_tokens, keys)
    assert verify_one(target_probs.clone(), list(draft_tokens), keys.clone()) == verdict
    draws = sample(target_probs, keys).tolist()  # [K+1] what plain sampling draws at these positions
    tokens = committed(draft_tokens, verdict)
    assert tokens == draws[: len(tokens)]
    other_draft = other_draft[: case["k"]]  # another draft, of any length up to K: the first rows
    rows = len(other_draft) + 1
    other = committed(other_draft, verify_one(target_probs[:rows], other_draft, keys[:rows]))
    assert other == draws[: len(other)]


# -- detokenization with the real tokenizer's byte table -------------------------------------------------

HARD_CHARS = [
    "a", "Z", " ", "\n", "\t", ".", "é", "ß", "ñ", "ø",
    "\u0301", "\u0308", "\u0327",  # combining acute, diaeresis, cedilla
    "日", "本", "語", "中", "文", "한", "국", "ア",
    "😀", "🎉", "👍", "\U0001f3fd", "\u200d", "👩", "🇫", "🇷", "🥐", "☕", "\ufe0f",
    "α", "Ж", "ש", "ع", "—", "…", "€", "“",
]


@settings(max_examples=150, **WITH_MODEL)
@given(text=st.text(st.sampled_from(HARD_CHARS), max_size=24), data=st.data())
def test_token_by_token_decoding_reproduces_the_text_without_split_characters(loaded, text, data):
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    # the byte table is exact on these characters: the tokenizer round-trips all of them
    assert b"".join(loaded.token_bytes[t] for t in ids) == text.encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 1)))
    bounds = [0, *cuts, len(ids)]
    decoder = TokenDecoder(loaded.token_bytes)
    pieces = [decoder.decode(ids[a:b]) for a, b in pairwise(bounds)]
    for piece in pieces:
        assert "\ufffd" not in piece, "a piece holds half a character"
        piece.encode("utf-8")  # a valid str (no lone surrogates)
    assert "".join(pieces) + decoder.flush() == text


# -- the engine: greedy speculative == plain, on a tiny random model --------------------------------------

class NoisyOracleDrafter:
    """Proposes plain decoding's own continuation (stop token included), each token replaced by a
    random one with probability ``error_rate``: long accepted runs, rejections at random places, and
    stops that land inside accepted blocks."""

    def __init__(self, continuation: list[int], rng: random.Random, error_rate: float) -> None:
        self.continuation, self.rng, self.error_rate = continuation, rng, error_rate
        self.generated = 0

    def reset(self, prompt) -> None:
        self.generated = 0

    def propose(self, k: int, after=()) -> Draft:
        tokens = [
            self.rng.randrange(200, 3000) if self.rng.random() < self.error_rate else token
            for token in self.continuation[self.generated : self.generated + k]
        ]
        return Draft(tokens, source="ngram", evidence=4)

    def observe(self, committed) -> None:
        self.generated += len(committed)


# Synthetic verification costs (ms by positions): cheap enough that adaptive K speculates, with
# 8 and 16 positions cheaper than their neighbours so that shorter drafts get padded, as on real
# hardware. Measuring them instead would make the examples depend on the machine's load.
COSTS = {p: 1.0 + 0.05 * p for p in range(1, 18)} | {8: 1.2, 16: 1.5}


@pytest.fixture(scope="module")
def tiny_engines(loaded):
    """Two tiny models: a flat one and a peaky one. Torch runs on one thread meanwhile: with two
    OpenMP threads on a busy 2-core machine, a tiny multi-position pass took 600 ms instead of 3."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engines = []
    for seed, init in ((1, 0.3), (2, 1.0)):
        engine = Engine(tiny_model(loaded, seed=seed, init=init))
        for positions, ms in COSTS.items():
            engine.costs.record(positions, ms)
        engines.append(engine)
    yield engines
    torch.set_num_threads(threads)


@st.composite
def engine_case(draw):
    unit = draw(st.lists(st.integers(200, 3000), min_size=2, max_size=6))  # a repeated unit: n-grams to copy
    noise = draw(st.lists(st.integers(200, 3000), max_size=4))
    return {
        "model": draw(st.integers(0, 1)),
        "prompt": unit * draw(st.integers(1, 4)) + noise,
        "k": draw(st.integers(1, 8)),
        "adaptive": draw(st.booleans()),
        "max_tokens": draw(st.integers(1, 32)),
        "drafter": draw(st.sampled_from(["ngram", "oracle", "oracle", "oracle"])),  # n-grams rarely match here
        "error_rate": draw(st.sampled_from([0.0, 0.2, 0.5])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=150, **WITH_MODEL)
@given(case=engine_case(), data=st.data())
def test_greedy_speculative_decoding_equals_plain_decoding(tiny_engines, case, data):
    engine = tiny_engines[case["model"]]
    prompt, max_tokens = case["prompt"], case["max_tokens"]
    unstopped, _ = decode(engine, prompt, GenerationParams(max_tokens=max_tokens, spec=SpecConfig(enabled=False)))
    text = engine.loaded.tokenizer.decode(unstopped.output_ids)
    # stop strings taken from what plain decoding says (so they hit), plus one that may not occur
    pieces = [text[a : a + n] for a in range(len(text)) for n in (1, 2, 3) if a + n <= len(text)]
    stops = data.draw(st.lists(st.sampled_from(pieces), max_size=2, unique=True)) if pieces else []
    stops += data.draw(st.lists(st.text("abc ", min_size=1, max_size=3), max_size=1))

    if case["drafter"] == "oracle":
        continuation, rng = unstopped.tokens[len(prompt) :], random.Random(case["seed"])
        speculative = Engine(engine.loaded, drafter_factory=lambda params: NoisyOracleDrafter(continuation, rng, case["error_rate"]))
        speculative.costs = engine.costs
    else:
        speculative = engine
    spec = SpecConfig(max_draft_tokens=case["k"], adaptive=case["adaptive"])
    reference, reference_text = decode(engine, prompt, GenerationParams(max_tokens=max_tokens, stop=tuple(stops), spec=SpecConfig(enabled=False)))
    fast, fast_text = decode(speculative, prompt, GenerationParams(max_tokens=max_tokens, stop=tuple(stops), spec=spec))
    assert fast.output_ids == reference.output_ids
    assert fast.tokens == reference.tokens  # the stop token too, if any
    assert fast.finish_reason == reference.finish_reason
    assert "".join(fast_text) == "".join(reference_text)
    assert engine.active == speculative.active == 0
    event(f"finish={fast.finish_reason}")
    event(f"{case['drafter']}: accepted {'some' if fast.stats.accepted_tokens else 'none'}, rollbacks {'some' if fast.stats.rollbacks else 'none'}")
