"""AgentSpecLLM on the real default model: laziness, metadata, sync/async paths, tool streaming, cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.llms.agentspec import AgentSpecLLM

import agentspec

HELLO = [ChatMessage(role="user", content="Say hello to Ada.")]


def test_constructing_loads_nothing() -> None:
    llm = AgentSpecLLM(model="/nonexistent/model.gguf", context_window=2048)
    assert llm.metadata.context_window == 2048  # an explicit window: still nothing loaded
    with pytest.raises(agentspec.ModelLoadError, match="does not exist"):  # the first request loads
        llm.chat(HELLO)


def test_metadata_comes_from_the_model(llm: AgentSpecLLM) -> None:
    metadata = llm.metadata
    assert metadata.context_window == llm.client().loaded.context_window > 0
    assert metadata.is_chat_model and metadata.is_function_calling_model
    assert metadata.num_output == 24
    assert AgentSpecLLM().client() is llm.client()  # one shared client (and weights) per model


async def test_sync_methods_work_inside_a_running_loop(llm: AgentSpecLLM) -> None:
    asyncio.get_running_loop()  # this test runs on pytest-asyncio's loop: no asyncio.run allowed
    chat = llm.chat(HELLO, max_tokens=8)
    streamed = "".join(r.delta for r in llm.stream_chat(HELLO, max_tokens=8))
    completed = llm.complete("Say hello to Ada.", max_tokens=8).text
    achat = await llm.achat(HELLO, max_tokens=8)
    astreamed = "".join([r.delta async for r in await llm.astream_complete("Say hello to Ada.", max_tokens=8)])
    assert chat.message.content  # greedy decoding: every path gives the same text
    assert chat.message.content == streamed == completed == achat.message.content == astreamed
    assert chat.additional_kwargs["completion_tokens"] == 8 and chat.additional_kwargs["finish_reason"] == "length"


async def test_streamed_tool_call_grows_until_it_parses(llm: AgentSpecLLM, weather_tool) -> None:
    stream = await llm.astream_chat_with_tools(
        # plain decoding: one token per step. Speculation may verify the whole call in one block (the
        # client's suffix cache replays an earlier identical call), which streams no partial pieces.
        [weather_tool], user_msg="What is the weather in Paris?", tool_required=True, max_tokens=48, speculative=False
    )
    partial: list[str] = []
    async for response in stream:
        blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        assert len(blocks) <= 1
        if blocks and isinstance(blocks[0].tool_kwargs, str):
            partial.append(blocks[0].tool_kwargs)
    assert len(set(partial)) >= 3, partial  # the arguments arrived in pieces
    assert all(b.startswith(a) for a, b in zip(partial, partial[1:]))  # each piece extends the last
    final = blocks[0].tool_kwargs
    assert isinstance(final, dict) and json.loads(partial[-1]) == final
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "get_weather" and selection.tool_kwargs == final
    assert "Paris" in final["city"]
    assert response.additional_kwargs["finish_reason"] == "tool_calls"
    assert response.additional_kwargs["spec_stats"]["output_tokens"] == response.additional_kwargs["completion_tokens"]


async def test_no_tool_call_gives_no_selections(llm: AgentSpecLLM, weather_tool) -> None:
    response = await llm.achat_with_tools([weather_tool], user_msg="Say hello.", tool_choice="none", max_tokens=6)
    assert response.message.content
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError):
        llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)


async def test_cancelling_astream_chat_stops_decoding(llm: AgentSpecLLM) -> None:
    client = llm.client()
    before = client.metrics()
    received = asyncio.Event()
    count = [ChatMessage(role="user", content="Count from 1 to 200, separated by commas.")]

    async def consume() -> None:
        async for response in await llm.astream_chat(count, max_tokens=400):
            if response.delta:
                received.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(received.wait(), timeout=120)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 30
    while client.metrics().requests == before.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    after = client.metrics()
    assert after.requests == before.requests + 1  # the request ended (as 'cancelled')...
    assert after.output_tokens - before.output_tokens < 100  # ...long before its 400 tokens


async def test_several_tool_calls_in_one_response(llm: AgentSpecLLM, weather_tool) -> None:
    """``allow_parallel_tool_calls`` reaches the request as ``parallel_tool_calls``: one response may
    hold several calls (the 135M model repeats its call), each a selection; without it, one call."""
    ask = dict(user_msg="What is the weather in Paris and in Rome?", tool_required=True, max_tokens=60)
    several = await llm.achat_with_tools([weather_tool], allow_parallel_tool_calls=True, **ask)
    one = await llm.achat_with_tools([weather_tool], **ask)
    selections = llm.get_tool_calls_from_response(several)
    assert len(selections) >= 2 and len({s.tool_id for s in selections}) == len(selections)
    assert all(s.tool_name == "get_weather" and isinstance(s.tool_kwargs, dict) and s.tool_kwargs.get("city") for s in selections)
    assert len(llm.get_tool_calls_from_response(one)) == 1
    assert several.additional_kwargs["finish_reason"] in ("tool_calls", "length")
