"""Observability on the real default model: per-tag aggregates, Prometheus text (checked with the
reference parser), one log line per request (with the seed that reproduces a sampled one), per-request
timeouts, and shadow quality sampling, greedy and sampled, that catches a deliberately broken verifier."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import agentspec
from agentspec.engine import engine as engine_module
from agentspec.engine.verify import verify_sampling

from .test_client import COPY, STORY, wait_idle

SHADOW = agentspec.SpecConfig(shadow_rate=1.0, adaptive=False)  # pinned K: drafts are always verified


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus exposition, keyed by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_tagged_aggregates_and_prometheus_text(client):
    await wait_idle(client)
    before = {tag: client.metrics(tag) for tag in ("rag", "tools")}
    done = {
        "rag": [await client.generate(COPY, max_tokens=10, tag="rag"), await client.generate(STORY, max_tokens=6, tag="rag")],
        "tools": [await client.generate(STORY, max_tokens=5, tag="tools")],
    }
    for tag, completions in done.items():
        after = client.metrics(tag)
        for name in ("requests", "output_tokens", "target_forward_passes", "accepted_tokens", "drafted_tokens"):
            expected = sum(getattr(c.stats, name) for c in completions)
            assert getattr(after, name) - getattr(before[tag], name) == expected, (tag, name)
    assert client.metrics("never-used") == agentspec.SpecStats()

    parsed = samples(client.metrics_text())  # raises if the text is not valid exposition format
    overall = client.metrics()
    assert parsed[("agentspec_requests_total", ())] == overall.requests
    assert parsed[("agentspec_output_tokens_total", ())] == overall.output_tokens
    for tag in ("rag", "tools"):
        stats = client.metrics(tag)
        assert parsed[("agentspec_tag_requests_total", (("tag", tag),))] == stats.requests
        assert parsed[("agentspec_tag_target_forward_passes_total", (("tag", tag),))] == stats.target_forward_passes
    assert parsed[("agentspec_tag_requests_total", (("tag", "rag"),))] >= 2


async def test_one_structured_log_line_per_request(client, caplog):
    await wait_idle(client)
    with caplog.at_level(logging.INFO, logger="agentspec.requests"):
        stream = client.stream(COPY, max_tokens=8, tag="logged")
        async with stream:
            events = [ev async for ev in stream]
        await wait_idle(client)
    lines = [r for r in caplog.records if r.name == "agentspec.requests" and stream.request_id in r.getMessage()]
    assert len(lines) == 1
    fields = lines[0].agentspec
    done = events[-1]
    assert fields["tag"] == "logged" and fields["finish_reason"] == done.finish_reason
    assert fields["output_tokens"] == done.stats.output_tokens and fields["target_passes"] == done.stats.target_forward_passes
    assert f"request_id={stream.request_id}" in lines[0].getMessage()
    assert fields["seed"] == "-"  # greedy: no randomness to record


async def test_an_unseeded_sampled_request_logs_the_seed_that_reproduces_it(client, caplog):
    await wait_idle(client)
    with caplog.at_level(logging.INFO, logger="agentspec.requests"):
        stream = client.stream(STORY, max_tokens=10, temperature=1.0)
        async with stream:
            events = [ev async for ev in stream]
        await wait_idle(client)
    (line,) = [r for r in caplog.records if r.name == "agentspec.requests" and stream.request_id in r.getMessage()]
    seed = line.agentspec["seed"]
    assert isinstance(seed, int) and f"seed={seed}" in line.getMessage()
    again = await client.generate(STORY, max_tokens=10, temperature=1.0, seed=seed, speculative=False)
    assert again.token_ids == [t for e in events if isinstance(e, agentspec.TextDelta) for t in e.token_ids]


async def test_timeout_ends_the_request_and_keeps_what_was_streamed(client):
    await wait_idle(client)
    received = []
    with pytest.raises(agentspec.RequestTimeoutError, match="timeout"):
        async for event in client.stream(STORY, max_tokens=300, timeout=0.4):
            received.append(event)
    assert received and all(isinstance(e, agentspec.TextDelta) for e in received)
    assert isinstance(agentspec.RequestTimeoutError("x"), TimeoutError)
    await wait_idle(client)
    assert client.engine.active == 0  # its KV cache is freed
    done = await client.generate(COPY, max_tokens=4, timeout=60)  # the client keeps serving
    assert done.finish_reason in ("stop", "length")


async def wait_shadow_checks(client, at_least: int, timeout: float = 60.0) -> agentspec.SpecStats:
    for _ in range(int(timeout / 0.05)):
        stats = client.metrics()
        if stats.shadow_checks >= at_least:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"shadow checks did not run: {client.metrics().shadow_checks} < {at_least}")


async def test_shadow_sampling_agrees_with_a_correct_engine(client):
    await wait_idle(client)
    before = client.metrics()
    done = await client.generate(COPY, max_tokens=16, speculative=SHADOW)
    assert done.stats.accepted_tokens > 0  # speculation did something worth checking
    after = await wait_shadow_checks(client, before.shadow_checks + 1)
    assert after.quality_diff_sampled == before.quality_diff_sampled


async def test_shadow_sampling_covers_sampled_requests(client):
    await wait_idle(client)
    before = client.metrics()
    for seed in (None, 7):
        await client.generate(COPY, max_tokens=16, temperature=0.7, top_p=0.9, seed=seed, speculative=SHADOW)
    after = await wait_shadow_checks(client, before.shadow_checks + 2)
    assert after.quality_diff_sampled == before.quality_diff_sampled


def step_keyed_sampling(target_probs: torch.Tensor, draft_tokens: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A broken sampling verifier (``verify_sampling``'s signature): every row of a sequence is
    drawn with its first row's key, noise keyed by step instead of by output position. A plain step
    has one row, so a plain re-decode is still the correct reference."""
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)
    segment = torch.repeat_interleave(torch.arange(counts.shape[0]), counts + 1)
    return verify_sampling(target_probs, draft_tokens, keys[starts][segment], counts)


def corrupt_speculative_steps(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A broken greedy verifier (``verify_greedy``'s signature, over a pass's flattened rows): every
    sequence with a draft commits a wrong token (a neighbouring id) and accepts none; plain steps,
    which have no draft, stay right, so a plain re-decode is the correct reference."""
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)  # each sequence's first row
    first = target_tokens[starts]
    return torch.zeros_like(counts), torch.where(counts > 0, first ^ 1, first)


def corrupt_speculative_rows(target_tokens: list[int], drafts: list[list[int]]) -> list[tuple[int, int]]:
    """The same bug in ``verify_greedy_rows``' form (the greedy verifier an engine on a CPU runs)."""
    verdicts, at = [], 0
    for draft in drafts:
        first = target_tokens[at]
        verdicts.append((0, first ^ 1 if draft else first))
        at += len(draft) + 1
    return verdicts


@pytest.mark.parametrize(
    ("broken", "sampling"),
    [
        ({"verify_greedy": corrupt_speculative_steps, "verify_greedy_rows": corrupt_speculative_rows}, {}),
        ({"verify_sampling": step_keyed_sampling}, {"temperature": 1.0, "seed": 5}),
    ],
    ids=["greedy", "sampled"],
)
async def test_shadow_sampling_detects_a_broken_verifier(client, monkeypatch, caplog, broken, sampling):
    await wait_idle(client)
    before = client.metrics()
    messages = [{"role": "user", "content": "Repeat exactly: red green blue, red green blue, red yellow blue."}]
    plain = await client.generate(messages, max_tokens=24, speculative=False, **sampling)
    for verifier, replacement in broken.items():  # greedy: the device's verifier and the host's
        monkeypatch.setattr(engine_module, verifier, replacement)
    with caplog.at_level(logging.ERROR, logger="agentspec.client"):
        stream = client.stream(messages, max_tokens=24, speculative=agentspec.SpecConfig(shadow_rate=1.0, adaptive=False), **sampling)
        async with stream:
            events = [ev async for ev in stream]
        broken_ids = [t for e in events if isinstance(e, agentspec.TextDelta) for t in e.token_ids]
        assert broken_ids != plain.token_ids  # the injected bug changed the output...
        after = await wait_shadow_checks(client, before.shadow_checks + 1)
    assert after.quality_diff_sampled == before.quality_diff_sampled + 1  # ...and shadow sampling caught it
    assert any(stream.request_id in r.getMessage() and "quality_diff" in r.getMessage() for r in caplog.records)
