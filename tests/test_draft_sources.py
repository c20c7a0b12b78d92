"""The client's draft sources on the real default model: the suffix cache of earlier outputs fills
as requests finish and drafts for later ones, ``draft="early-exit:N"`` drafts with the target's
first layers, and greedy output stays identical to plain decoding throughout."""

from __future__ import annotations

import pytest

import agentspec

from .test_client import wait_idle

TURN = "Call get_user for id {}. Reply with the JSON call only."
SCHEMA_PROMPT = [{"role": "system", "content": 'Reply with {"name":"get_user","arguments":{"id":N}}.'}]


async def test_suffix_cache_fills_and_output_stays_plain(client):
    await wait_idle(client)
    sources = client.draft_sources
    before = len(sources.suffixes)
    outputs = []
    for i in (101, 102, 103):
        messages = [*SCHEMA_PROMPT, {"role": "user", "content": TURN.format(i)}]
        spec = await client.generate(messages, max_tokens=16)
        plain = await client.generate(messages, max_tokens=16, speculative=False)
        assert spec.token_ids == plain.token_ids
        outputs.append(spec)
    await wait_idle(client)
    assert len(sources.suffixes) >= before + 3  # every finished request is remembered (bounded LRU)
    assert sources.suffixes.size <= sources.suffixes.max_tokens


async def test_early_exit_drafting_is_lossless():
    messages = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    async with agentspec.Client(draft="early-exit:20") as client:
        assert client.draft_sources.draft_model is not None
        spec = await client.generate(messages, max_tokens=16, speculative=agentspec.SpecConfig(adaptive=False, max_draft_tokens=4))
        plain = await client.generate(messages, max_tokens=16, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted_tokens > 0


async def test_a_draft_model_alone_is_still_arbitrated_and_lossless():
    """With only the model source allowed, the arbiter still decides per step whether running the
    draft model pays (a poor one, like these untrained early exits, then mostly does not run)."""
    from agentspec.drafting import ArbiterDrafter
    from agentspec.params import GenerationParams

    messages = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    only_model = agentspec.SpecConfig(sources=("model",))
    async with agentspec.Client(draft="early-exit:20") as client:
        assert isinstance(client.draft_sources.drafter(GenerationParams(spec=only_model)), ArbiterDrafter)
        spec = await client.generate(messages, max_tokens=16, speculative=only_model)
        plain = await client.generate(messages, max_tokens=16, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert set(spec.stats.accepted_by_source) <= {"model"}


@pytest.mark.parametrize("draft, error, needle", [
    ("early-exit:0", agentspec.ModelLoadError, "from 1 to 29"),
    ("early-exit:30", agentspec.ModelLoadError, "from 1 to 29"),
])
async def test_bad_early_exit_depth_is_a_typed_error_at_start(draft, error, needle):
    with pytest.raises(error, match=needle):
        await agentspec.Client(draft=draft).start()


async def test_a_tenants_requests_learn_only_from_its_own(client):
    """What the arbiter learns about the sources (acceptance, drafting times, when a losing source is
    tried again) is kept per cache salt, as earlier outputs are: one tenant's requests move only its
    own history, so how fast another's are served does not follow what the first received."""
    await wait_idle(client)
    sources = client.draft_sources
    shared_steps = sources.history.steps
    messages = [*SCHEMA_PROMPT, {"role": "user", "content": TURN.format(7)}]
    spec = await client.generate(messages, max_tokens=16, cache_salt="tenant-a")
    plain = await client.generate(messages, max_tokens=16, speculative=False, cache_salt="tenant-a")
    assert spec.token_ids == plain.token_ids
    assert sources.history_of("tenant-a").steps > 0
    assert sources.history_of("tenant-b").steps == 0 and sources.history_of("tenant-b") is not sources.history_of("tenant-a")
    assert sources.history.steps == shared_steps  # requests without a salt keep theirs apart too
