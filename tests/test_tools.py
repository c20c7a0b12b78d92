"""Forced tool calls on the real default model: events, schema-valid arguments, plain == speculative."""

from __future__ import annotations

import json

import jsonschema
import pytest

import agentspec
from agentspec.workloads import WEATHER_TOOL as WEATHER

# Not the bench workload's send_email: without a free-text body the call fits in max_tokens=60.
EMAIL = {
    "type": "function",
    "function": {
        "name": "send_email",
        "description": "Send an e-mail",
        "parameters": {
            "type": "object",
            "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
            "required": ["to", "subject"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "get_time", "description": "The current time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, EMAIL, NOW]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


async def call(client, content: str, **params):
    events = [ev async for ev in client.stream([{"role": "user", "content": content}], tools=TOOLS, max_tokens=60, **params)]
    return events


@pytest.mark.parametrize(
    "content, choice",
    [
        ("What's the weather in Zürich in celsius?", "required"),
        ("E-mail bob@example.com that the meeting moved, subject 'Meeting moved'.", "required"),
        ("What time is it?", {"type": "function", "function": {"name": "get_time"}}),
        ("Weather in 東京, please.", {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
async def test_forced_call_events(client, content, choice):
    events = await call(client, content, tool_choice=choice)
    done = events[-1]
    assert isinstance(done, agentspec.Done) and done.finish_reason == "tool_calls"
    deltas = [e for e in events if isinstance(e, agentspec.ToolCallDelta)]
    calls = [e for e in events if isinstance(e, agentspec.ToolCall)]
    assert len(calls) == 1 and not any(isinstance(e, agentspec.TextDelta) for e in events)
    tool_call = calls[0]
    if isinstance(choice, dict):
        assert tool_call.name == choice["function"]["name"]
    jsonschema.validate(tool_call.arguments, PARAMETERS[tool_call.name])
    # id and name only in the first delta; integer index always; fragments add up to the arguments
    assert deltas[0].id == tool_call.id and deltas[0].name == tool_call.name
    assert all(d.id is None and d.name is None for d in deltas[1:])
    assert all(d.index == 0 for d in deltas)
    assert json.loads("".join(d.arguments for d in deltas)) == tool_call.arguments


async def test_tool_call_speculative_equals_plain_and_saves_passes(client):
    messages = [{"role": "user", "content": "E-mail bob@example.com that the meeting moved, subject 'Meeting moved'."}]
    spec = await client.generate(messages, tools=TOOLS, tool_choice="required", max_tokens=60)
    plain = await client.generate(messages, tools=TOOLS, tool_choice="required", max_tokens=60, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.tool_calls[0].arguments == plain.tool_calls[0].arguments
    assert spec.finish_reason == "tool_calls" and spec.text == ""
    assert spec.stats.accepted_by_source.get("grammar", 0) > 0
    assert spec.stats.target_forward_passes < plain.stats.target_forward_passes


async def test_tool_choice_none_answers_in_text(client):
    done = await client.generate([{"role": "user", "content": "Say hi."}], tools=TOOLS, tool_choice="none", max_tokens=8)
    assert done.tool_calls == [] and done.text and done.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "params, error, needle",
    [
        ({"tools": TOOLS}, agentspec.UnsupportedFeatureError, "auto"),
        ({"tools": TOOLS, "tool_choice": "auto"}, agentspec.UnsupportedFeatureError, "auto"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, agentspec.InvalidRequestError, "nope"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, agentspec.InvalidRequestError, "tools\\[0\\]"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, agentspec.InvalidRequestError, "unique"),
        ({"tool_choice": "required"}, agentspec.InvalidRequestError, "needs `tools`"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, agentspec.InvalidRequestError, "exclude"),
    ],
)
async def test_bad_tool_requests(client, params, error, needle):
    with pytest.raises(error, match=needle):
        client.stream([{"role": "user", "content": "hi"}], **params)
