"""``Client(base_url=...)`` against recorded wire formats: vLLM, SGLang, llama.cpp's server and a
plain OpenAI-compatible server, replayed by ``tests/replay_server.py`` in its own process (no model
loads here). Events, usage and speculation statistics; tool calls; the request body each server
gets; faults become agentspec's typed errors and leave the client usable; closing a stream closes
its HTTP response."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

import agentspec
from agentspec import (
    AgentSpecError,
    ContextLengthError,
    Done,
    EngineError,
    EngineOverloadedError,
    ModelLoadError,
    RemoteError,
    RequestTimeoutError,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    UnsupportedFeatureError,
    Usage,
)

pytest.importorskip("openai", reason="the remote extra is not installed: pip install 'agentspec-llm[remote]'")
pytest.importorskip("uvicorn", reason="the replay server needs the serve extra: pip install 'agentspec-llm[serve]'")

from tests import replay_server as replay  # noqa: E402  (after the skips: it imports starlette and uvicorn)
from tests.processes import ServerProcess  # noqa: E402

REPLAY_SERVER = Path(__file__).with_name("replay_server.py")
START_TIMEOUT_S = 30
API_KEY = "replay-key"
TIMEOUT_S = 1.0  # a request's `timeout` against the stalled reply
KINDS = {"vllm": "vllm-model", "sglang": "sglang-model", "llamacpp": "llamacpp-model", "openai": "plain-model"}
UNKNOWABLE = ("rollbacks", "fallback_steps", "draft_ms", "verify_ms", "cached_prompt_tokens")  # no server reports them
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class City(BaseModel):
    city: str
    sunny: bool


def ask(scenario: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"scenario:{scenario}"}]


def replay_process(*args: str) -> ServerProcess:
    """``python tests/replay_server.py --port 0`` (and ``args``)."""
    return ServerProcess([sys.executable, str(REPLAY_SERVER), "--port", "0", *args], start_timeout_s=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def server():
    process = replay_process()
    yield process.wait_ready()
    assert process.stop() == 0, "".join(process.lines)  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def keyed_server():
    process = replay_process("--api-key", API_KEY)
    yield process.wait_ready()
    assert process.stop() == 0, "".join(process.lines)


@pytest.fixture(scope="module")
async def http(server: str):
    """The replay server's own routes: the last request body, the state of a reply."""
    async with httpx.AsyncClient(base_url=server.removesuffix("/v1"), timeout=10) as http:
        yield http


@pytest.fixture(scope="module")
async def clients(server: str):
    """One started client per kind of server."""
    started = {kind: await agentspec.Client(model, base_url=server, server_timeout=30).start() for kind, model in KINDS.items()}
    yield started
    for client in started.values():
        await client.aclose()


@pytest.fixture
def no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec.backends.remote import API_KEY_ENV

    monkeypatch.delenv(API_KEY_ENV, raising=False)


async def requests_seen(http: httpx.AsyncClient) -> dict:
    return (await http.get("/last_request")).json()


async def reply_state(http: httpx.AsyncClient, reply_id: str, want: str, within_s: float = 5.0) -> str:
    """The reply's state on the server, polled until it is ``want`` or ``within_s`` pass."""
    deadline = time.monotonic() + within_s
    while True:
        state = (await http.get(f"/replies/{reply_id}")).json()["state"]
        if state == want or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


async def collect(stream: agentspec.Stream) -> list:
    return [event async for event in stream]


async def events_until_error(client: agentspec.Client, scenario: str, **params) -> tuple[list, AgentSpecError]:
    """The events a faulty reply produced and the error it ended with: an agentspec error, or the
    test fails with whatever else was raised (a raw httpx/openai exception)."""
    events: list = []
    with pytest.raises(AgentSpecError) as info:
        async for event in client.stream(ask(scenario), **params):
            events.append(event)
    return events, info.value


def streamed_text(events: list) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def expected_stats(kind: str) -> dict:
    """What each server's recorded numbers say (None: the server does not say)."""
    tokens = replay.USAGE["completion_tokens"]
    if kind == "vllm":
        drafted, accepted = replay.VLLM_SPEC["num_draft_tokens"], replay.VLLM_SPEC["num_accepted_draft_tokens"]
        return {"drafted_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": pytest.approx(accepted / drafted), "output_tokens": tokens}
    if kind == "sglang":
        drafted, accepted = replay.SGLANG_SPEC["spec_draft_token_num"], replay.SGLANG_SPEC["spec_accept_token_num"]
        passes = replay.SGLANG_SPEC["spec_verify_ct"]
        return {
            "drafted_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": pytest.approx(accepted / drafted),
            "output_tokens": tokens, "target_forward_passes": passes, "target_forward_passes_saved": tokens - passes,
            "mean_accepted_length": pytest.approx(tokens / passes),
        }
    if kind == "llamacpp":
        drafted, accepted = replay.LLAMACPP_SPEC["draft_n"], replay.LLAMACPP_SPEC["draft_n_accepted"]
        return {"drafted_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": pytest.approx(accepted / drafted), "output_tokens": tokens}
    return {"drafted_tokens": None, "accepted_tokens": None, "acceptance_rate": None, "output_tokens": None, "target_forward_passes": None}


# -- streamed replies, per kind of server ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_text_usage_and_statistics(clients, http, kind):
    client = clients[kind]
    assert client.backend.name == kind  # from the model's owned_by
    tag = f"text-{kind}"
    events = await collect(client.stream(ask("text"), max_tokens=32, tag=tag))

    deltas = [event for event in events if isinstance(event, TextDelta)]
    assert [delta.text for delta in deltas] == replay.TEXT  # one delta per chunk with text
    assert all(delta.token_ids == [] for delta in deltas)  # servers do not send ids
    done = events[-1]
    assert isinstance(done, Done) and [e for e in events if isinstance(e, Done)] == [done]
    assert done.finish_reason == "stop"
    if kind == "openai":  # the plain server sends no usage
        assert done.usage == Usage(prompt_tokens=None, completion_tokens=None, total_tokens=None)
    else:
        assert done.usage == Usage(**replay.USAGE)

    stats = done.stats
    assert stats.requests == 1
    assert {name: getattr(stats, name) for name in expected_stats(kind)} == expected_stats(kind)
    assert {name: getattr(stats, name) for name in UNKNOWABLE} == dict.fromkeys(UNKNOWABLE)  # unknown, never 0
    assert stats.ttft_ms is not None and stats.ttft_ms >= replay.FIRST_TOKEN_DELAY_S * 1e3
    assert (stats.tpot_ms is None) == (stats.output_tokens is None)
    assert stats.tpot_ms is None or stats.tpot_ms >= 0

    tagged = client.metrics(tag)  # the client's aggregate of this one request
    assert tagged.requests == 1
    assert (tagged.drafted_tokens, tagged.accepted_tokens) == (stats.drafted_tokens, stats.accepted_tokens)
    newest = f"chatcmpl-replay-{(await requests_seen(http))['count']}"
    assert await reply_state(http, newest, "finished") == "finished"  # read to its end: not a disconnect


@pytest.mark.parametrize("kind", KINDS)
async def test_tool_call_deltas_and_validated_calls(clients, kind):
    events = await collect(clients[kind].stream(ask("tool_call"), tools=[WEATHER], tool_choice="auto"))

    deltas = [event for event in events if isinstance(event, ToolCallDelta)]
    calls = [event for event in events if isinstance(event, ToolCall)]
    assert [(call.index, call.id, call.name) for call in calls] == [(i, id, name) for i, (id, name, _) in enumerate(replay.CALLS)]
    for call, (_, _, fragments) in zip(calls, replay.CALLS):
        assert call.arguments == json.loads("".join(fragments))
        mine = [delta for delta in deltas if delta.index == call.index]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)  # only in the index's first delta
        assert all(delta.id is None and delta.name is None for delta in mine[1:])
        assert json.loads("".join(delta.arguments for delta in mine)) == call.arguments
        assert events.index(call) > max(events.index(delta) for delta in mine)
    assert not [event for event in events if isinstance(event, TextDelta)]
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "tool_calls"

    completion = await clients[kind].generate(ask("tool_call"), tools=[WEATHER])
    assert [call.arguments for call in completion.tool_calls] == [call.arguments for call in calls]
    assert completion.finish_reason == "tool_calls"


async def test_tool_call_violating_the_schema_is_an_engine_error(clients):
    client = clients["vllm"]
    events, error = await events_until_error(client, "bad_tool_call", tools=[WEATHER])
    assert isinstance(error, EngineError)
    assert not [event for event in events if isinstance(event, (ToolCall, Done))]
    assert (await client.generate(ask("tool_call"), tools=[WEATHER])).finish_reason == "tool_calls"  # still usable


# -- what the server receives ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_request_body_carries_the_options(clients, http, kind):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "scenario:text"}]
    await clients[kind].generate(messages, tools=[WEATHER], tool_choice="auto", stop=["\n\n", "END"], seed=7, max_tokens=33, temperature=0.7, top_p=0.9)
    body = (await requests_seen(http))["body"]
    assert body["model"] == KINDS[kind]
    assert body["messages"] == messages
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["tools"], body["tool_choice"]) == ([WEATHER], "auto")
    assert (body["stop"], body["seed"], body["max_tokens"]) == (["\n\n", "END"], 7, 33)
    assert (body["temperature"], body["top_p"]) == (0.7, 0.9)
    assert not {"top_k", "min_p", "repetition_penalty", "repeat_penalty", "speculative"} & set(body)  # not asked for


PENALTY = {"vllm": "repetition_penalty", "sglang": "repetition_penalty", "llamacpp": "repeat_penalty"}  # the servers' names


@pytest.mark.parametrize("kind", PENALTY)
async def test_sampling_options_beyond_openai_reach_servers_that_take_them(clients, http, kind):
    completion = await clients[kind].generate(ask("text"), top_k=20, min_p=0.05, repetition_penalty=1.1)
    assert completion.text == "".join(replay.TEXT)
    body = (await requests_seen(http))["body"]
    assert (body["top_k"], body["min_p"], body[PENALTY[kind]]) == (20, 0.05, 1.1)
    assert ({"repetition_penalty", "repeat_penalty"} - {PENALTY[kind]}).isdisjoint(body)


SCHEMA_FORMATS = {  # how each server is asked to enforce a schema
    "vllm": lambda schema: {"type": "json_schema", "json_schema": {"name": "City", "schema": schema, "strict": True}},
    "llamacpp": lambda schema: {"type": "json_object", "schema": schema},  # llama.cpp ignores json_schema
}


@pytest.mark.parametrize("kind", SCHEMA_FORMATS)
async def test_response_model_becomes_the_servers_schema_format(clients, http, kind):
    completion = await clients[kind].generate(ask("json"), response_format=City)
    assert completion.parsed == City(city="Paris", sunny=True)
    body = (await requests_seen(http))["body"]
    assert body["response_format"] == SCHEMA_FORMATS[kind](City.model_json_schema())


@pytest.mark.parametrize(
    "kind, params",
    [
        pytest.param("openai", {"top_k": 5}, id="top_k-on-a-plain-server"),
        pytest.param("openai", {"repetition_penalty": 1.2}, id="repetition_penalty-on-a-plain-server"),
        pytest.param("vllm", {"speculative": agentspec.SpecConfig(max_draft_tokens=4)}, id="speculative-on-vllm"),
    ],
)
async def test_what_a_server_cannot_honour_is_refused_before_sending(clients, http, kind, params):
    before = (await requests_seen(http))["count"]
    with pytest.raises(UnsupportedFeatureError):
        await clients[kind].generate(ask("text"), **params)
    assert (await requests_seen(http))["count"] == before


# -- faults ----------------------------------------------------------------------------------------------


async def test_unreachable_server_fails_start():
    with socket.socket() as reserved:  # bound, not listening: connections to it are refused
        reserved.bind(("127.0.0.1", 0))
        client = agentspec.Client(base_url=f"http://127.0.0.1:{reserved.getsockname()[1]}/v1", server_timeout=5)
        with pytest.raises(ModelLoadError):
            await client.start()


@pytest.mark.parametrize("api_key", ["wrong-key", None], ids=["wrong-key", "no-key"])
async def test_refused_api_key_fails_start(keyed_server, no_key_in_env, api_key):
    with pytest.raises(ModelLoadError):
        await agentspec.Client(base_url=keyed_server, api_key=api_key).start()
    async with agentspec.Client("sglang-model", base_url=keyed_server, api_key=API_KEY) as client:  # the right key works
        assert (await client.generate(ask("text"))).text == "".join(replay.TEXT)


async def test_unknown_model_fails_start(server):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        await agentspec.Client("no-such-model", base_url=server).start()


async def test_default_model_is_the_first_listed(server, http):
    listed = (await http.get("/v1/models")).json()["data"]
    async with agentspec.Client(base_url=server) as client:
        await client.generate(ask("text"))
    assert (await requests_seen(http))["body"]["model"] == listed[0]["id"]


FAULTS = [  # scenario, the error, the text streamed before it, the server's message it carries
    pytest.param("fail_500", RemoteError, "", replay.ERRORS["fail_500"][1]["message"], id="500"),
    pytest.param("overloaded", EngineOverloadedError, "", replay.ERRORS["overloaded"][1]["message"], id="429"),
    pytest.param("context_length", ContextLengthError, "", replay.ERRORS["context_length"][1]["message"], id="context-length"),
    pytest.param("error_event_mid_stream", RemoteError, "".join(replay.TEXT[:2]), replay.MID_STREAM_ERROR, id="error-event-mid-stream"),
    pytest.param("drop_mid_stream", RemoteError, "".join(replay.TEXT[:2]), None, id="dropped-connection"),
    pytest.param("truncated_sse", RemoteError, "".join(replay.TEXT[:2]), None, id="truncated-sse"),
    pytest.param("malformed_chunk", RemoteError, replay.TEXT[0], None, id="malformed-chunk"),
]


@pytest.mark.parametrize("scenario, error_type, text_before, message", FAULTS)
async def test_faults_are_typed_errors_and_the_client_recovers(clients, scenario, error_type, text_before, message):
    client = clients["vllm"]
    events, error = await events_until_error(client, scenario)
    assert isinstance(error, error_type), repr(error)
    assert streamed_text(events) == text_before  # what streamed before the fault stands
    assert not [event for event in events if isinstance(event, Done)]
    if message is not None:
        assert message in str(error)
    if scenario == "fail_500":
        assert error.status == 500
    assert (await client.generate(ask("text"))).text == "".join(replay.TEXT)


async def test_request_timeout_ends_a_stalled_reply(clients, http):
    client = clients["vllm"]
    started = time.monotonic()
    events, error = await events_until_error(client, "slow", timeout=TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert isinstance(error, RequestTimeoutError), repr(error)
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 5  # a hang guard, not a speed test
    assert streamed_text(events) == replay.TEXT[0]
    newest = f"chatcmpl-replay-{(await requests_seen(http))['count']}"
    assert await reply_state(http, newest, "disconnected") == "disconnected"  # the server stopped it
    assert (await client.generate(ask("text"))).text == "".join(replay.TEXT)


async def test_server_timeout_ends_a_stalled_reply(server):
    async with agentspec.Client("vllm-model", base_url=server, server_timeout=TIMEOUT_S) as client:
        started = time.monotonic()
        events, error = await events_until_error(client, "slow")
        assert time.monotonic() - started < TIMEOUT_S + 5
        assert isinstance(error, RequestTimeoutError), repr(error)
        assert streamed_text(events) == replay.TEXT[0]
        assert (await client.generate(ask("text"))).text == "".join(replay.TEXT)


# -- closing early -----------------------------------------------------------------------------------------


async def _first_delta_then_aclose(client: agentspec.Client) -> tuple[str, agentspec.Stream | None]:
    stream = client.stream(ask("long"))
    assert isinstance(await anext(stream), TextDelta)
    await stream.aclose()
    return stream.request_id, stream


async def _break_inside_async_with(client: agentspec.Client) -> tuple[str, agentspec.Stream | None]:
    async with client.stream(ask("long")) as stream:
        async for event in stream:
            if isinstance(event, TextDelta):
                break
    return stream.request_id, stream


async def _break_and_drop(client: agentspec.Client) -> tuple[str, agentspec.Stream | None]:
    stream = client.stream(ask("long"))
    async for event in stream:
        if isinstance(event, TextDelta):
            break
    reply_id = stream.request_id
    del stream  # no aclose(): the stream's finalizer closes the response
    gc.collect()
    return reply_id, None


@pytest.mark.parametrize("close", [_first_delta_then_aclose, _break_inside_async_with, _break_and_drop], ids=["aclose", "async-with", "dropped"])
async def test_closing_a_stream_closes_the_response(clients, http, close):
    reply_id, stream = await close(clients["vllm"])  # a closed stream is kept referenced: its finalizer must not be what closes it
    assert reply_id.startswith("chatcmpl-replay-")  # the server's id, from its chunks
    assert await reply_state(http, reply_id, "disconnected") == "disconnected"
    del stream


async def test_closing_the_client_cancels_its_running_streams(server, http):
    async with agentspec.Client("vllm-model", base_url=server) as client:
        stream = client.stream(ask("long"))
        assert isinstance(await anext(stream), TextDelta)
    events = await collect(stream)  # as with a local client: the stream ends, cancelled
    assert events and isinstance(events[-1], Done) and events[-1].finish_reason == "cancelled"
    assert await reply_state(http, stream.request_id, "disconnected") == "disconnected"
