"""Seeded sampling on the real default model: speculative == plain, token for token, per seed.

Every sampled request is compared with plain decoding of the same request and seed: for every draft
source alone and all mixed, K pinned at 0, 1, 4 and 16 and adaptive, inside batches of other
requests (all of a round is sent at once) and alone, with cold and warm prefix and suffix caches,
at temperatures 0.3 to 1.5 with top-p, top-k, min-p and the repetition penalty, and under grammars
(a forced tool call, a JSON schema). The model source (the target's first 20 layers, which the
client's arbiter rarely runs, being a poor draft) is driven directly on an engine, so its drafts are
verified every step.
"""

from __future__ import annotations

import asyncio

import pytest

import agentspec

from agentspec.drafting.draft_models import early_exit_drafter
from agentspec.engine import Engine
from agentspec.params import GenerationParams, parse_params

from .conftest import decode
from .test_equivalence import CODE, DOC
from .test_tools import TOOLS

MAX_TOKENS = 12

PROMPTS = [
    f"{DOC}\n\nQuote the sentence about the height of the tower.",
    f"Rename `width` to `w` in this code and return the full code:\n{CODE}",
    "Tell me a short story about a dragon.",
    "user: hi\nassistant: hello\nuser: hi\nassistant: hello\nuser: hi\nContinue the pattern.",
]
SETUPS = [  # sampling settings, each with a seed of its own
    {"temperature": 0.3, "seed": 11},
    {"temperature": 0.8, "top_p": 0.95, "seed": 12},
    {"temperature": 1.0, "top_k": 40, "seed": 13},
    {"temperature": 1.5, "min_p": 0.05, "seed": 14},
    {"temperature": 0.7, "repetition_penalty": 1.3, "seed": 15},
    {"temperature": 1.2, "top_p": 0.9, "top_k": 50, "min_p": 0.02, "seed": 2**63 + 5},
]
REQUESTS = [(prompt, setup) for prompt in PROMPTS for setup in SETUPS]  # 24
SPECS = {
    "k0": agentspec.SpecConfig(max_draft_tokens=0, adaptive=False),
    "ngram-k1": agentspec.SpecConfig(sources=("ngram",), max_draft_tokens=1, adaptive=False),
    "ngram-k4": agentspec.SpecConfig(sources=("ngram",), max_draft_tokens=4, adaptive=False),
    "ngram-k16": agentspec.SpecConfig(sources=("ngram",), max_draft_tokens=16, adaptive=False),
    "suffix-k8": agentspec.SpecConfig(sources=("suffix",), max_draft_tokens=8, adaptive=False),
    "ngram-adaptive": agentspec.SpecConfig(sources=("ngram",)),
    "all-adaptive": agentspec.SpecConfig(),
}


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


async def run_all(client, requests, speculative) -> list[agentspec.Completion]:
    """Every request at once (the runtime batches up to 8), in order."""
    return await asyncio.gather(*(client.generate(messages(p), max_tokens=MAX_TOKENS, speculative=speculative, **s) for p, s in requests))


@pytest.fixture(scope="module")
async def cold_and_plain(client):
    """All sources with cold caches, then the plain references (which warm them)."""
    await client.clear_caches()
    cold = [c.token_ids for c in await run_all(client, REQUESTS, agentspec.SpecConfig())]
    plain = [c.token_ids for c in await run_all(client, REQUESTS, False)]
    return cold, plain


def differences(got: list[list[int]], want: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b]


def total(completions: list[agentspec.Completion], name: str) -> int:
    return sum(getattr(c.stats, name) for c in completions)


async def test_cold_caches_give_plain_sampling(cold_and_plain):
    cold, plain = cold_and_plain
    assert differences(cold, plain) == []
    assert len({tuple(p) for p in plain}) == len(plain)  # every (prompt, seed) its own output


@pytest.mark.parametrize("name", SPECS)
async def test_every_source_and_k_gives_plain_sampling(client, cold_and_plain, name):
    _, plain = cold_and_plain
    got = await run_all(client, REQUESTS, SPECS[name])  # warm: the suffix cache holds the plain outputs
    assert differences([c.token_ids for c in got], plain) == []
    # with K pinned, drafts are verified, accepted and rejected (adaptive K follows timings: any)
    if name == "k0":
        assert total(got, "drafted_tokens") == 0
    elif not SPECS[name].adaptive:
        assert total(got, "accepted_tokens") > 10 and total(got, "rollbacks") > 5


async def test_a_request_alone_gives_plain_sampling(client, cold_and_plain):
    _, plain = cold_and_plain
    for i in (0, 7, 15):
        prompt, setup = REQUESTS[i]
        done = await client.generate(messages(prompt), max_tokens=MAX_TOKENS, speculative=agentspec.SpecConfig(adaptive=False), **setup)
        assert done.token_ids == plain[i]


async def test_a_seed_repeated_on_a_warm_client_gives_the_same_ids(client):
    prompt = messages(PROMPTS[2])
    plain = await client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.9, seed=3, speculative=False)
    for _ in range(5):  # each run finds the earlier ones in the suffix and prefix caches
        done = await client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.9, seed=3)
        assert done.token_ids == plain.token_ids
    assert done.stats.accepted_by_source.get("suffix", 0) > 0  # the cached output was drafted


async def test_different_seeds_give_different_outputs(client):
    outputs = {tuple((await client.generate(messages(PROMPTS[2]), max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)).token_ids) for seed in range(5)}
    assert len(outputs) == 5


GRAMMARS = {
    "tool_call": ("What's the weather in Zürich in celsius?", {"tools": TOOLS, "tool_choice": "required"}),
    "json_schema": (
        "Give a name and an age for a fictional person, as JSON.",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "person",
                    "schema": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name", "age"],
                    },
                },
            }
        },
    ),
}


@pytest.mark.parametrize("kind", GRAMMARS)
async def test_grammar_sampling_gives_plain_sampling(client, kind):
    prompt, options = GRAMMARS[kind]
    setups = SETUPS[:3]
    requests = [{**options, **setup} for setup in setups]
    plain = await asyncio.gather(*(client.generate(messages(prompt), max_tokens=24, speculative=False, **r) for r in requests))
    for spec in (agentspec.SpecConfig(sources=("grammar",)), agentspec.SpecConfig(max_draft_tokens=8, adaptive=False)):
        got = await asyncio.gather(*(client.generate(messages(prompt), max_tokens=24, speculative=spec, **r) for r in requests))
        assert [g.token_ids for g in got] == [p.token_ids for p in plain], spec
        assert sum(g.stats.accepted_tokens for g in got) > 0


def params(setup: dict, speculative) -> GenerationParams:
    return parse_params({**setup, "max_tokens": MAX_TOKENS, "speculative": speculative}, default_spec=agentspec.SpecConfig())


def test_coupled_model_drafts_give_plain_sampling(loaded, engine):
    """Early exit drafts (the target's block pass cut after 20 layers) sampled with the target's noise
    at their positions: plain sampling's tokens."""
    drafting = Engine(loaded, drafter_factory=lambda p: early_exit_drafter(loaded, 20, p, target=engine.forward, min_confidence=0.0))
    drafted = accepted = 0
    for i in (0, 7, 13, 22):
        prompt, setup = REQUESTS[i]
        prompt_ids = loaded.chat.encode(messages(prompt))
        plain, _ = decode(engine, prompt_ids, params(setup, False))
        got, _ = decode(drafting, prompt_ids, params(setup, agentspec.SpecConfig(max_draft_tokens=3, adaptive=False)))
        assert got.tokens == plain.tokens, i
        drafted += got.stats.drafted_tokens
        accepted += got.stats.accepted_tokens
    assert drafted > 20 and 0 < accepted < drafted
