"""The async client on the real default model: streaming, completions, cancellation, lifecycle."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys

import pytest

import agentspec

COPY = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog."}]
# K pinned where a test counts saved passes: adaptive K follows the costs calibrated at start-up, and
# under the suite's two workers a plain step can look cheap enough that short copies go unverified
# (CI: 0 drafted of 11 tokens); these tests are about events and identity, not draft lengths
PINNED = agentspec.SpecConfig(max_draft_tokens=8, adaptive=False)
STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


async def wait_idle(client: agentspec.Client, timeout: float = 5.0) -> None:
    """Wait until the engine holds no sequence (the step in flight, if any, has ended)."""
    for _ in range(int(timeout / 0.01)):
        if client.pending_requests == 0 and client.engine.active == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {client.pending_requests} requests, {client.engine.active} sequences")


async def test_stream_events_are_consistent(client, loaded):
    events = [ev async for ev in client.stream(COPY, max_tokens=24, speculative=PINNED)]
    deltas, done = events[:-1], events[-1]
    assert isinstance(done, agentspec.Done) and all(isinstance(e, agentspec.TextDelta) for e in deltas)
    ids = [t for e in deltas for t in e.token_ids]
    assert "".join(e.text for e in deltas) == loaded.tokenizer.decode(ids, skip_special_tokens=True)
    assert done.usage.completion_tokens in (len(ids), len(ids) + 1)  # + the stop token, if it stopped
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    stats = done.stats
    assert stats.output_tokens == done.usage.completion_tokens
    assert stats.target_forward_passes_saved == stats.output_tokens - stats.target_forward_passes
    assert stats.target_forward_passes_saved > 0, "a copying prompt should save target passes"
    assert stats.ttft_ms > 0 and stats.verify_ms > 0


async def test_generate_speculative_equals_plain(client):
    spec = await client.generate(COPY, max_tokens=32, speculative=PINNED)
    plain = await client.generate(COPY, max_tokens=32, speculative=False)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    assert plain.stats.drafted_tokens == 0
    assert spec.stats.target_forward_passes < plain.stats.target_forward_passes


async def test_max_tokens_finish(client):
    done = await client.generate(STORY, max_tokens=5)
    assert done.finish_reason == "length" and done.usage.completion_tokens == 5 and len(done.token_ids) == 5


async def test_concurrent_streams_match_solo_runs(client):
    prompts = [COPY, STORY, [{"role": "user", "content": "List three fruits."}]]
    solo = [await client.generate(p, max_tokens=20) for p in prompts]
    together = await asyncio.gather(*(client.generate(p, max_tokens=20) for p in prompts))
    assert [c.token_ids for c in together] == [c.token_ids for c in solo]


async def test_a_short_request_is_not_starved_by_a_long_one(client):
    long_done = asyncio.Event()

    async def long_request():
        # plain decoding, so that no draft (the session has seen this story: its earlier outputs are
        # in the suffix cache) finishes it early: 120 speculative tokens once took under a second
        await client.generate(STORY, max_tokens=1000, speculative=False)
        long_done.set()

    long_task = asyncio.create_task(long_request())
    await asyncio.sleep(0.5)  # the long request is decoding
    short = await client.generate(COPY, max_tokens=5)
    assert short.usage.completion_tokens == 5
    assert not long_done.is_set(), "round-robin: the short request finishes while the long one still runs"
    long_task.cancel()  # its stream closes: the engine stops decoding it
    with pytest.raises(asyncio.CancelledError):
        await long_task
    await wait_idle(client)


async def test_aclose_stops_decoding_and_others_continue(client):
    other = asyncio.create_task(client.generate(COPY, max_tokens=24))
    stream = client.stream(STORY, max_tokens=400)
    got = 0
    async for _event in stream:
        got += 1
        if got == 3:
            break
    await stream.aclose()
    finished = await other
    expected = await client.generate(COPY, max_tokens=24)
    assert finished.token_ids == expected.token_ids
    await wait_idle(client)
    assert client.engine.active == 0


async def test_break_without_close_frees_the_engine(client):
    async for _event in client.stream(STORY, max_tokens=400):
        break
    gc.collect()  # the dropped stream's finalizer cancels the request
    await wait_idle(client)


async def test_cancelling_the_consumer_task_frees_the_engine(client):
    started = asyncio.Event()

    async def consume():
        async for _ in client.stream(STORY, max_tokens=400):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(client)


async def test_abandoned_stream_is_detected():
    limits = agentspec.Limits(max_pending_events=2, abandon_after_s=0.3)
    async with agentspec.Client(limits=limits) as client:
        stream = client.stream(STORY, max_tokens=400)
        first = await stream.__anext__()  # submitted, then never read again nor closed
        assert isinstance(first, agentspec.TextDelta)
        await wait_idle(client)
        events = [ev async for ev in stream]
        assert events[-1].finish_reason == "cancelled"
        assert events[-1].usage.completion_tokens < 400


async def test_metrics_aggregate_request_stats(client):
    await wait_idle(client)
    before = client.metrics()
    a = await client.generate(COPY, max_tokens=12)
    b = await client.generate(STORY, max_tokens=12)
    after = client.metrics()
    assert after.requests - before.requests == 2
    for name in ("drafted_tokens", "accepted_tokens", "output_tokens", "target_forward_passes", "rollbacks"):
        assert getattr(after, name) - getattr(before, name) == getattr(a.stats, name) + getattr(b.stats, name)
    text = client.metrics_text()
    assert f"agentspec_requests_total {after.requests}" in text
    assert "# TYPE agentspec_acceptance_rate gauge" in text


async def test_lifecycle_errors():
    client = agentspec.Client()
    with pytest.raises(agentspec.ClientClosedError, match="not started"):
        client.stream(COPY)
    async with client:
        stream = client.stream(STORY, max_tokens=400)
        first = await stream.__anext__()
        assert isinstance(first, agentspec.TextDelta)
    # closing the client ended the running stream
    events = [ev async for ev in stream]
    assert events and events[-1].finish_reason == "cancelled"
    with pytest.raises(agentspec.ClientClosedError, match="closed"):
        client.stream(COPY)
    with pytest.raises(agentspec.ClientClosedError):
        await client.start()
    await client.aclose()  # idempotent


SHUTDOWN_SCRIPT = """
import asyncio, agentspec

async def main():
    client = agentspec.Client()
    await client.start()
    stream = client.stream([{"role": "user", "content": "Tell me a long story."}], max_tokens=2000)
    await stream.__anext__()  # decoding is running; neither the stream nor the client is closed
    print("streaming", flush=True)

asyncio.run(main())
"""


def test_interpreter_exits_with_a_stream_and_client_left_open():
    """No hang at interpreter shutdown: the worker thread is a daemon and the stream's finalizer
    cancels its request when the loop goes away."""
    done = subprocess.run([sys.executable, "-c", SHUTDOWN_SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "streaming" in done.stdout
