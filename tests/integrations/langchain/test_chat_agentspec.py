"""ChatAgentSpec beyond the standard suites: cancellation, event loops, chunk shapes, mappings.

Requests run on the real default model with small ``max_tokens``; mapping tests run no model.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableBinding
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

import agentspec
from langchain_agentspec import ChatAgentSpec
from agentspec.bridge import ClientKey, backend

LONG_PROMPT = "Count from 1 to 100, separated by commas."
LONG_MAX_TOKENS = 200


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return "sunny"


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's first name")
    age: int


def shared_client(llm: ChatAgentSpec) -> agentspec.Client:
    """The started agentspec.Client behind ``llm`` (blocks until the model is loaded)."""
    return backend().run(backend().client(ClientKey(llm.model, llm.device, llm.dtype)))


async def settled(client: agentspec.Client, requests: int, timeout_s: float = 10.0) -> agentspec.SpecStats:
    """The client's metrics once ``requests`` requests have finished (cancelled ones included)."""
    deadline = time.monotonic() + timeout_s
    while client.metrics().requests < requests:
        assert time.monotonic() < deadline, "the request did not finish: decoding was not stopped"
        await asyncio.sleep(0.02)
    return client.metrics()


def test_constructing_loads_nothing() -> None:
    code = (
        "import threading\n"
        "from agentspec import bridge\n"
        "from langchain_agentspec import ChatAgentSpec\n"
        "llm = ChatAgentSpec(max_tokens=8)\n"
        "llm.bind_tools([]).with_config(tags=['x'])\n"
        "assert bridge._backend is None, 'a backend was started'\n"
        "names = [t.name for t in threading.enumerate()]\n"
        "assert names == ['MainThread'], names\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_instances_with_the_same_model_share_one_client() -> None:
    first, second = ChatAgentSpec(max_tokens=8), ChatAgentSpec(temperature=0.5)
    assert shared_client(first) is shared_client(second)


@pytest.mark.parametrize("how", ["aclose", "break", "cancel_task"])
async def test_stopping_astream_stops_decoding(how: str) -> None:
    llm = ChatAgentSpec(max_tokens=LONG_MAX_TOKENS)
    client = shared_client(llm)
    before = client.metrics()
    first = asyncio.Event()

    async def consume() -> None:
        stream = llm.astream(LONG_PROMPT)
        async for chunk in stream:
            assert chunk.content
            first.set()
            if how == "aclose":
                await stream.aclose()
                return
            if how == "break":
                break  # the dropped generators are closed by the loop's async-generator finalizer
            # "cancel_task": keep reading; the task is cancelled while it waits for the next chunk

    task = asyncio.create_task(consume())
    await first.wait()
    if how == "cancel_task":
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    after = await settled(client, before.requests + 1)
    generated = after.output_tokens - before.output_tokens
    assert generated < LONG_MAX_TOKENS // 4, f"{generated} tokens decoded after the consumer stopped"
    assert client.pending_requests == 0


def test_breaking_out_of_sync_stream_stops_decoding() -> None:
    llm = ChatAgentSpec(max_tokens=LONG_MAX_TOKENS)
    client = shared_client(llm)
    before = client.metrics()
    stream = llm.stream(LONG_PROMPT)
    next(stream)
    stream.close()
    after = asyncio.run(settled(client, before.requests + 1))
    assert after.output_tokens - before.output_tokens < LONG_MAX_TOKENS // 4


async def test_sync_calls_work_inside_a_running_event_loop() -> None:
    asyncio.get_running_loop()  # as in Jupyter: sync methods called from a coroutine
    llm = ChatAgentSpec(max_tokens=12)
    reply = llm.invoke("Say hello.")
    assert isinstance(reply, AIMessage) and reply.content
    assert "".join(chunk.text for chunk in llm.stream("Say hello.")) == reply.content  # greedy: same text


async def test_async_and_sync_calls_agree_and_run_concurrently() -> None:
    llm = ChatAgentSpec(max_tokens=12)
    first, second = await asyncio.gather(llm.ainvoke("Name a colour."), llm.ainvoke("Name a colour."))
    assert first.content and first.content == second.content == llm.invoke("Name a colour.").content


def test_tool_call_chunks_carry_index_always_and_name_id_once() -> None:
    llm = ChatAgentSpec(max_tokens=48).bind_tools([get_weather], tool_choice="any")
    chunks = list(llm.stream("What is the weather in Paris?"))
    calls = [c for chunk in chunks for c in chunk.tool_call_chunks]
    assert len(calls) >= 2
    assert all(isinstance(c["index"], int) and c["index"] == 0 for c in calls)
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert all(c["name"] is None and c["id"] is None for c in calls[1:])

    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    assert isinstance(full, AIMessageChunk) and full.chunk_position == "last"
    assert full.tool_calls == [{"name": "get_weather", "args": full.tool_calls[0]["args"], "id": calls[0]["id"], "type": "tool_call"}]
    assert isinstance(full.tool_calls[0]["args"].get("city"), str)
    assert full.response_metadata["finish_reason"] == "tool_calls"


async def test_a_named_tool_choice_forces_that_tool() -> None:
    @tool
    def get_time(city: str) -> str:
        """Get the local time in a city."""
        return "noon"

    llm = ChatAgentSpec(max_tokens=48).bind_tools([get_weather, get_time], tool_choice="get_time")
    reply = await llm.ainvoke("What is the weather in Paris?")
    assert [call["name"] for call in reply.tool_calls] == ["get_time"]


async def test_usage_and_stats_are_on_exactly_one_chunk_the_last() -> None:
    llm = ChatAgentSpec(max_tokens=16)
    chunks = [chunk async for chunk in llm.astream("Tell me about the sea.")]
    with_usage = [i for i, chunk in enumerate(chunks) if chunk.usage_metadata]
    assert with_usage == [len(chunks) - 1]
    last = chunks[-1]
    assert last.chunk_position == "last"
    assert last.usage_metadata["input_tokens"] > 0
    assert last.usage_metadata["output_tokens"] == 16  # the limit: the sea is a long topic
    assert last.usage_metadata["total_tokens"] == last.usage_metadata["input_tokens"] + 16
    assert last.response_metadata["finish_reason"] == "length"
    stats = agentspec.SpecStats.model_validate(last.response_metadata["spec_stats"])
    assert stats.output_tokens == 16 and stats.requests == 1
    assert all(not chunk.response_metadata for chunk in chunks[:-1])


def test_parameters_reach_agentspec() -> None:
    plain = ChatAgentSpec(max_tokens=8, speculative=False).invoke("Tell me about the sea.")
    assert plain.response_metadata["spec_stats"]["drafted_tokens"] == 0
    assert plain.usage_metadata["output_tokens"] == 8
    stopped = ChatAgentSpec(max_tokens=16).invoke("Tell me about the sea.", stop=["the"])
    assert "the" not in stopped.content and stopped.response_metadata["finish_reason"] == "stop"


async def test_agentspec_errors_propagate_typed() -> None:
    llm = ChatAgentSpec(max_tokens=8)
    with pytest.raises(agentspec.InvalidRequestError, match="top_p"):
        llm.invoke("hi", top_p=5.0)
    with pytest.raises(agentspec.InvalidRequestError, match="frequency_penalty"):
        await llm.ainvoke("hi", frequency_penalty=1.0)
    with pytest.raises(agentspec.InvalidRequestError, match="not one of the tools"):
        await llm.bind_tools([get_weather], tool_choice="get_time").ainvoke("hi")


def test_messages_become_openai_dicts() -> None:
    llm = ChatAgentSpec(model="some/model", temperature=0.3, stop=["x"])
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}
    messages = [
        SystemMessage("Be brief."),
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage("sunny", tool_call_id="call_1"),
    ]
    key, converted, params = llm._request(messages, None, {"max_tokens": 5})
    assert key == ClientKey("some/model", "auto", "auto")
    remote = ChatAgentSpec(model="served", base_url="http://127.0.0.1:9/v1", api_key="secret-key-123")
    assert remote._request(messages, None, {})[0] == ClientKey("served", base_url="http://127.0.0.1:9/v1", api_key="secret-key-123")
    assert "secret-key-123" not in repr(remote)  # the key is a secret
    assert params == {"temperature": 0.3, "stop": ["x"], "max_tokens": 5}
    assert [m["role"] for m in converted] == ["system", "user", "assistant", "tool"]
    assert converted[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert converted[3]["tool_call_id"] == "call_1" and converted[3]["content"] == "sunny"
    _, _, params = llm._request(messages, ["y"], {"model": "other"})
    assert params["stop"] == ["y"] and "model" not in params


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("any", "required"),
        ("required", "required"),
        (True, "required"),
        ("none", "none"),
        ("get_weather", {"type": "function", "function": {"name": "get_weather"}}),
        ({"type": "function", "function": {"name": "x"}}, {"type": "function", "function": {"name": "x"}}),
    ],
)
def test_tool_choice_forms(tool_choice: Any, expected: Any) -> None:
    bound = ChatAgentSpec().bind_tools([get_weather], tool_choice=tool_choice)
    assert isinstance(bound, RunnableBinding) and bound.kwargs["tool_choice"] == expected


def test_every_tool_format_becomes_an_openai_function() -> None:
    class Lookup(BaseModel):
        """Look a word up."""

        word: str

    class LookupDict(TypedDict):
        """Look a word up."""

        word: str

    def lookup(word: str) -> str:
        """Look a word up."""
        return word

    openai_tool = {"type": "function", "function": {"name": "Lookup", "description": "d", "parameters": Lookup.model_json_schema()}}
    formats = [Lookup, LookupDict, lookup, tool(lookup), openai_tool, Lookup.model_json_schema()]
    tools = ChatAgentSpec().bind_tools(formats, tool_choice="any").kwargs["tools"]
    assert [t["type"] for t in tools] == ["function"] * len(formats)
    assert all(t["function"]["parameters"]["properties"]["word"]["type"] == "string" for t in tools)


def test_structured_output_methods_bind_the_right_request() -> None:
    llm = ChatAgentSpec()
    schema_binding = llm.with_structured_output(Person).first  # default: json_schema
    assert schema_binding.kwargs["response_format"]["type"] == "json_schema"
    assert schema_binding.kwargs["response_format"]["json_schema"]["schema"]["required"] == ["name", "age"]
    assert llm.with_structured_output(Person, method="json_mode").first.kwargs["response_format"] == {"type": "json_object"}
    tools_binding = llm.with_structured_output(Person, method="function_calling").first
    assert tools_binding.kwargs["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
    with pytest.raises(ValueError, match="method"):
        llm.with_structured_output(Person, method="xml")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_structured_output_include_raw(method: str) -> None:
    llm = ChatAgentSpec(max_tokens=32).with_structured_output(Person, method=method, include_raw=True)
    result = await llm.ainvoke("Alice is 30 years old. Extract the person.")
    assert isinstance(result["raw"], AIMessage) and result["parsing_error"] is None
    assert isinstance(result["parsed"], Person) and result["parsed"].name == "Alice"


def test_profile_declares_native_tools_and_structured_output() -> None:
    profile = ChatAgentSpec().profile
    assert profile["tool_calling"] and profile["tool_choice"] and profile["structured_output"]
    assert profile["tool_call_streaming"] and not profile["image_inputs"]


async def test_an_unforced_call_comes_back_as_tool_calls() -> None:
    """tool_choice="auto" (the default): after a call in the history the model writes the next call
    itself, and the reply carries it as ``tool_calls``, its opening never as text."""
    history = [
        HumanMessage("What's the weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("18°C, cloudy", tool_call_id="c1"),
        AIMessage("It is 18°C and cloudy in Paris."),
        HumanMessage("What's the weather in Rome?"),
    ]
    reply = await ChatAgentSpec(max_tokens=40).bind_tools([get_weather]).ainvoke(history)
    assert [(call["name"], call["args"]) for call in reply.tool_calls] == [("get_weather", {"city": "Rome"})]
    assert reply.content == "" and reply.response_metadata["finish_reason"] == "tool_calls"
