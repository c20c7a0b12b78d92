"""Soak: a few hundred mixed requests on the real default model, then check nothing leaked or drifted.

The mix (seeded): concurrency between 1 and 8; requests read to the end, broken out of, closed,
cancelled with their task, or cut by a client-side timeout; a few sampled ones and a few bad ones.
Afterwards: no request or KV cache is left in the engine, no thread leaked, the client still serves,
every emitted greedy token is plain decoding's token (completed requests: all of them, exactly),
and the metrics counted every completed request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import re
import threading
from dataclasses import dataclass, field

import pytest

import agentspec

from .test_client import wait_idle

pytestmark = pytest.mark.slow

SEED = 20240611
# AGENTSPEC_SOAK_REQUESTS shortens a run on a busy machine (the default is the real soak)
REQUESTS = int(os.environ.get("AGENTSPEC_SOAK_REQUESTS", "200"))
MAX_CONCURRENCY = 8
MAX_TOKENS = 12

QUOTE = "The quick brown fox jumps over the lazy dog near the river bank."
CODE = "def add(a, b):\n    return a + b\n"
PROMPTS = [  # copying prompts, so speculation drafts (and gets rejected) for real
    f"Repeat exactly: {QUOTE}",
    f"Quote this sentence back to me: {QUOTE}",
    f"Copy this code exactly:\n{CODE}",
    f"Rename `add` to `plus` in this code and return the full code:\n{CODE}",
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue.",
    "Count from 1 to 20, separated by commas.",
    "List the days of the week, separated by commas.",
    'Return this JSON unchanged: {"name": "Ada", "age": 36, "city": "London"}',
    "Repeat the word 'hello' ten times.",
    "Spell the word 'banana' letter by letter, separated by dashes.",
    "Écris exactement : le café ☕ et les croissants 🥐 sont bons.",
    "What is the capital of France? Answer in one word.",
]
BAD_PARAMS = [
    {"max_tokens": 0},
    {"temperature": "hot"},
    {"stop": [""]},
    {"top_p": 2.0},
    {"speculatve": True},
    {"tool_choice": "required"},
]
KINDS = {"complete": 44, "sample": 6, "break": 12, "aclose": 12, "cancel_task": 10, "timeout": 10, "bad": 6}


def messages(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[index]}]


@dataclass
class Outcome:
    kind: str
    prompt: int
    max_tokens: int
    greedy: bool
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # from the Done event, if one was read


def expected(reference: tuple[list[int], str], max_tokens: int) -> tuple[list[int], str]:
    """Plain decoding with ``max_tokens``, derived from one plain run with MAX_TOKENS."""
    ids, finish = reference
    if len(ids) >= max_tokens:
        return ids[:max_tokens], "length"
    assert finish == "stop", "a shorter reference ended on a stop token"
    return ids, "stop"


async def read(stream: agentspec.Stream, outcome: Outcome, limit: int | None = None) -> None:
    """Read events into ``outcome``; stop after ``limit`` events (without closing) if given."""
    seen = 0
    async for event in stream:
        if isinstance(event, agentspec.TextDelta):
            outcome.token_ids.extend(event.token_ids)
        elif isinstance(event, agentspec.Done):
            outcome.finish_reason = event.finish_reason
            assert event.usage.completion_tokens >= len(outcome.token_ids)
        seen += 1
        if limit is not None and seen >= limit:
            break


async def one_request(client: agentspec.Client, rng: random.Random, kind: str) -> Outcome:
    prompt, max_tokens = rng.randrange(len(PROMPTS)), rng.randint(4, MAX_TOKENS)
    outcome = Outcome(kind, prompt, max_tokens, greedy=kind != "sample")
    params: dict = {"max_tokens": max_tokens}
    if kind == "sample":
        params |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**32)}
    if kind == "bad":
        with pytest.raises(agentspec.InvalidRequestError):
            client.stream(messages(prompt), **rng.choice(BAD_PARAMS))
        return outcome

    if kind in ("complete", "sample"):
        await read(client.stream(messages(prompt), **params), outcome)
    elif kind == "break":  # dropped without aclose(): the finalizer must cancel it
        await read(client.stream(messages(prompt), **params), outcome, limit=rng.randint(1, 3))
    elif kind == "aclose":
        async with client.stream(messages(prompt), **params) as stream:
            await read(stream, outcome, limit=rng.randint(1, 3))
    elif kind == "cancel_task":
        task = asyncio.create_task(read(client.stream(messages(prompt), **params), outcome))
        await asyncio.sleep(rng.uniform(0, 0.4))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    elif kind == "timeout":
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0.01, 0.6)):
                await read(client.stream(messages(prompt), **params), outcome)
    return outcome


def requests_total(text: str) -> float:
    match = re.search(r"^agentspec_requests_total (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


async def test_soak(client):
    rng = random.Random(SEED)
    references = {}
    for index in range(len(PROMPTS)):
        done = await client.generate(messages(index), max_tokens=MAX_TOKENS, speculative=False)
        references[index] = (done.token_ids, done.finish_reason)
    await wait_idle(client, timeout=10.0)
    threads_before = set(threading.enumerate())
    metrics_before = client.metrics()
    prometheus_before = requests_total(client.metrics_text())

    outcomes: list[Outcome] = []
    pending = rng.choices(list(KINDS), weights=list(KINDS.values()), k=REQUESTS)
    while pending:
        size = rng.randint(1, MAX_CONCURRENCY)
        wave, pending = pending[:size], pending[size:]
        outcomes += await asyncio.gather(*(one_request(client, rng, kind) for kind in wave))

    gc.collect()  # streams dropped by `break` are cancelled by their finalizers
    await wait_idle(client, timeout=10.0)

    # nothing left behind: no sequence (hence no KV cache) in the engine, no new thread
    engine = client.engine
    assert engine.active == 0 and engine.kv_bytes == 0
    leaked = [t for t in set(threading.enumerate()) - threads_before if t.is_alive() and t.name != "AnyIO worker thread"]
    assert not leaked, leaked

    # every greedy token that left the engine is plain decoding's; completed requests are exactly it
    completed = [o for o in outcomes if o.finish_reason in ("stop", "length")]
    for o in outcomes:
        if not o.greedy:
            continue
        ids, finish = expected(references[o.prompt], o.max_tokens)
        if o.finish_reason in ("stop", "length"):
            assert (o.token_ids, o.finish_reason) == (ids, finish), o
        else:
            assert o.token_ids == ids[: len(o.token_ids)], o
            assert o.finish_reason in (None, "cancelled"), o
    counts = {kind: sum(o.kind == kind for o in outcomes) for kind in KINDS}
    cancelled = sum(o.finish_reason == "cancelled" for o in outcomes)
    assert len(completed) >= counts["complete"] + counts["sample"], (counts, len(completed))
    assert cancelled + sum(o.finish_reason is None for o in outcomes if o.kind != "bad") > 0

    # the metrics counted every completed request (cancelled ones count too, bad ones never ran)
    metrics = client.metrics()
    started = REQUESTS - counts["bad"]
    assert len(completed) <= metrics.requests - metrics_before.requests <= started
    assert metrics.output_tokens - metrics_before.output_tokens >= sum(len(o.token_ids) for o in completed)
    assert requests_total(client.metrics_text()) - prometheus_before == metrics.requests - metrics_before.requests

    # and the client still serves, correctly
    done = await client.generate(messages(0), max_tokens=6)
    assert (done.token_ids, done.finish_reason) == expected(references[0], 6)
    await wait_idle(client, timeout=10.0)
