"""Faults stay inside the request they hit: a failing drafter costs plain steps, never output;
a failing forward pass ends one request with a typed error while the others and the client go on."""

from __future__ import annotations

import asyncio
import threading
from typing import Sequence

import pytest
import torch

import agentspec
from agentspec.drafting import Draft, NgramDrafter
from agentspec.engine import Engine
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode

PROMPT = [{"role": "user", "content": "Repeat exactly: to be or not to be, that is the question; to be or not to be."}]


class FlakyDrafter(NgramDrafter):
    """An n-gram drafter whose ``propose`` raises on every other call (or ``observe`` after a while)."""

    def __init__(self, fail_observe_after: int | None = None) -> None:
        super().__init__()
        self.calls = 0
        self.fail_observe_after = fail_observe_after

    def propose(self, k: int) -> Draft:
        self.calls += 1
        if self.fail_observe_after is None and self.calls % 2:
            raise RuntimeError("drafter bug")
        return super().propose(k)

    def observe(self, committed: Sequence[int]) -> None:
        if self.fail_observe_after is not None and self.calls > self.fail_observe_after:
            raise RuntimeError("drafter bug in observe")
        super().observe(committed)


@pytest.mark.parametrize("fail_observe_after", [None, 3])
def test_failing_drafter_costs_plain_steps_not_output(engine, loaded, fail_observe_after):
    prompt_ids = loaded.chat.encode(PROMPT)
    flaky = Engine(loaded, drafter_factory=lambda params: FlakyDrafter(fail_observe_after))
    flaky.costs = engine.costs
    params = GenerationParams(max_tokens=24, spec=SpecConfig(adaptive=False))
    plain, _ = decode(engine, prompt_ids, GenerationParams(max_tokens=24, spec=SpecConfig(enabled=False)))
    seq, _ = decode(flaky, prompt_ids, params)
    assert seq.tokens == plain.tokens
    if fail_observe_after is None:
        assert seq.stats.fallback_steps >= seq.stats.target_forward_passes // 2  # each failure counted
        assert seq.stats.accepted_tokens > 0  # the calls that worked still sped things up
    else:
        assert seq.stats.target_forward_passes > 0


async def test_failing_forward_ends_one_request_only(client, monkeypatch):
    """A pass that includes the victim fails (out of memory, say): the batch is retried one sequence
    at a time, so only the victim fails and the request sharing its passes finishes unchanged."""
    engine = client.engine
    expected = await client.generate(PROMPT, max_tokens=16)

    def fault(seqs):
        if any(seq.params.max_tokens == 7 for seq in seqs):
            raise MemoryError("simulated out of memory")

    monkeypatch.setattr(engine, "before_pass", fault)
    healthy = asyncio.create_task(client.generate(PROMPT, max_tokens=16))
    with pytest.raises(agentspec.EngineError, match="out of memory") as info:
        await client.generate(PROMPT, max_tokens=7)
    assert isinstance(info.value.__cause__, MemoryError)
    done = await healthy
    assert done.token_ids == expected.token_ids
    monkeypatch.setattr(engine, "before_pass", None)
    again = await client.generate(PROMPT, max_tokens=7)  # the client keeps serving
    assert again.usage.completion_tokens == 7
    assert engine.active == 0


async def test_failing_start_ends_one_request_and_the_worker_survives(client, monkeypatch):
    engine = client.engine
    real_start = engine.start

    def start(seq):
        if seq.params.max_tokens == 9:
            raise MemoryError("simulated out of memory while allocating the cache")
        real_start(seq)

    monkeypatch.setattr(engine, "start", start)
    with pytest.raises(agentspec.EngineError, match="out of memory"):
        await client.generate(PROMPT, max_tokens=9)
    done = await client.generate(PROMPT, max_tokens=4)
    assert done.usage.completion_tokens == 4


async def test_concurrent_starts_load_once_and_close_during_start_wins(monkeypatch):
    client = agentspec.Client()
    await asyncio.gather(client.start(), client.start())
    engine = client.engine
    await client.start()
    assert client.engine is engine
    await client.aclose()

    # A second client on the loaded model starts in a fraction of a second (it reuses the first's
    # calibration): hold its start-up at calibration so that the close surely comes during it.
    calibrating, release = threading.Event(), threading.Event()
    real_calibrate = Engine.calibrate

    def held_calibrate(self, *args, **kwargs):
        calibrating.set()
        release.wait(timeout=60)
        return real_calibrate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "calibrate", held_calibrate)
    closing = agentspec.Client()
    task = asyncio.create_task(closing.start())
    assert await asyncio.to_thread(calibrating.wait, 60)
    await closing.aclose()
    release.set()
    with pytest.raises(agentspec.ClientClosedError):
        await task
    with pytest.raises(agentspec.ClientClosedError):
        closing.stream(PROMPT)


async def test_grammar_dead_end_fails_one_request_with_a_typed_error(client, loaded, monkeypatch):
    """A grammar state that allows no token ends its request with EngineError after the text streamed
    so far; a concurrent request and the client are unaffected."""
    schema = {"type": "object", "properties": {"dead_end_probe": {"type": "string"}}, "required": ["dead_end_probe"]}
    grammar = loaded.grammars.compile(schema)  # the instance the request will get (cached by regex)
    real_mask = grammar.mask
    dead = grammar.initial_state

    def mask(state):
        allowed = real_mask(state)
        return torch.zeros_like(allowed) if state != dead and not grammar.forced(state) else allowed

    monkeypatch.setattr(grammar, "mask", mask)  # dead after the forced `{"dead_end_probe":"`
    healthy = asyncio.create_task(client.generate(PROMPT, max_tokens=12))
    fmt = {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}}
    received = []
    with pytest.raises(agentspec.EngineError, match="allows no token"):
        async for event in client.stream(PROMPT, response_format=fmt, max_tokens=20):
            received.append(event)
    assert all(isinstance(e, agentspec.TextDelta) for e in received)  # no Done: the error ended it
    done = await healthy
    assert done.finish_reason in ("stop", "length") and done.usage.completion_tokens > 0
    assert client.engine.active == 0
