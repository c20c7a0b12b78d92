"""``Client(base_url=...)`` against a third-party OpenAI-compatible server on the default model:
llama-cpp-python's server on the same GGUF file, started by the fixture on loopback.

It is installed by ``make bench`` (``llama-cpp-python[server]``, compiled by pip); where it is not
installed, this module is skipped and says so. The server is recognised from its model list
(llama-cpp-python's models are ``owned_by: "me"``), so a schema is asked for in the form llama.cpp
enforces (``{"type": "json_object", "schema": ...}``).
"""

from __future__ import annotations

import json
import re
import sys
import time

import jsonschema
import pydantic
import pytest

import agentspec
from agentspec import Done, TextDelta, ToolCall, ToolCallDelta
from agentspec.model import default_model_path
from tests.processes import ServerProcess

pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server is not installed: `make bench` installs it (pip compiles llama.cpp)")
pytest.importorskip("openai", reason="the remote extra is not installed: pip install 'agentspec-llm[remote]'")

LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
    },
}


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    sunny: bool


@pytest.fixture(scope="module")
def server():
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()), "--host", "127.0.0.1", "--port", "0",
               "--n_threads", "2", "--model_alias", "smollm2-gguf"]
    process = ServerProcess(command, start_timeout_s=120, ready=LISTENING)
    yield process.wait_ready() + "/v1"
    process.stop(timeout_s=30)  # uvicorn under llama-cpp-python: exit code of a signalled process varies


@pytest.fixture(scope="module")
async def remote(server: str):
    async with agentspec.Client(base_url=server, server_timeout=120) as remote:
        yield remote


async def test_recognised_and_streams_text(remote):
    assert (remote.backend.name, remote.backend.model) == ("llamacpp", "smollm2-gguf")
    events = [event async for event in remote.stream([{"role": "user", "content": "What is the capital of France?"}], max_tokens=12)]
    text = "".join(event.text for event in events if isinstance(event, TextDelta))
    done = events[-1]
    assert text.strip() and isinstance(done, Done) and done.finish_reason in ("stop", "length")
    assert done.stats.ttft_ms > 0 and done.stats.rollbacks is None  # measured here; not reported by the server


async def test_forced_tool_call(remote):
    events = [
        event async for event in remote.stream(
            [{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=32,
        )
    ]
    [call] = [event for event in events if isinstance(event, ToolCall)]
    first, *rest = [event for event in events if isinstance(event, ToolCallDelta)]
    assert call.name == first.name == "get_weather" and first.id == call.id and all(d.id is None and d.name is None for d in rest)
    jsonschema.validate(call.arguments, WEATHER["function"]["parameters"])
    assert json.loads("".join(d.arguments for d in [first, *rest])) == call.arguments
    assert events[-1].finish_reason == "tool_calls"


async def test_schema_response(remote):
    completion = await remote.generate([{"role": "user", "content": "Is it sunny in Rome today? Reply in JSON."}], response_format=Place, max_tokens=32)
    assert completion.finish_reason == "stop" and isinstance(completion.parsed, Place)


async def test_cancelled_stream_leaves_the_client_serving(remote):
    story = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
    async with remote.stream(story, max_tokens=256) as stream:
        async for event in stream:
            if isinstance(event, TextDelta) and event.text:
                break  # leaving the block closes the HTTP response
    started = time.monotonic()
    follow_up = await remote.generate([{"role": "user", "content": "Say hi."}], max_tokens=4)
    assert follow_up.text and follow_up.finish_reason in ("stop", "length")
    assert time.monotonic() - started < 60  # a hang guard, not a speed assertion


async def test_langchain_on_a_server_without_usage(server):
    langchain_agentspec = pytest.importorskip("langchain_agentspec", reason="the LangChain integration is not installed")
    message = await langchain_agentspec.ChatAgentSpec(base_url=server, max_tokens=8).ainvoke("What is the capital of France?")
    assert message.content.strip()
    assert message.usage_metadata is None  # the server reports none: not zeros
    assert message.response_metadata["finish_reason"] in ("stop", "length")
