"""Tool calls: forced and "auto" calls on the real default model (events, schema-valid arguments,
plain == speculative), parallel calls on a tiny random model, and the call parser."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

import agentspec
from agentspec.engine import Engine
from agentspec.structured.formats import CallTranscriber
from agentspec.structured.grammar import RepeatedGrammar
from agentspec.structured.triggers import AutoCallGrammar
from agentspec.params import GenerationParams
from agentspec.structured.tools import ToolCallParser, call_schema, parse_tools
from agentspec.types import SpecConfig
from agentspec.bench.workloads import WEATHER_TOOL as WEATHER

from .conftest import decode, tiny_model

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


async def test_auto_answers_in_text_exactly_like_none(client):
    """A reply that does not open a call is unconstrained: the same tokens as tool_choice="none"."""
    messages = [{"role": "user", "content": "What is 2+2?"}]
    auto = await client.generate(messages, tools=TOOLS, max_tokens=12)  # tool_choice defaults to "auto"
    none = await client.generate(messages, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert auto.tool_calls == [] and auto.text and auto.finish_reason in ("stop", "length")
    assert auto.token_ids == none.token_ids


# The 135M model does not call tools unprompted; after one call in the conversation it imitates it.
HISTORY = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18°C, cloudy"},
    {"role": "assistant", "content": "It is 18°C and cloudy in Paris."},
]


@pytest.mark.parametrize("city", ["Rome", "Madrid"])
async def test_auto_starts_a_call_when_the_model_opens_one(client, city):
    messages = [*HISTORY, {"role": "user", "content": f"What's the weather in {city}?"}]
    events = [ev async for ev in client.stream(messages, tools=[WEATHER], tool_choice="auto", max_tokens=40)]
    calls = [e for e in events if isinstance(e, agentspec.ToolCall)]
    assert events[-1].finish_reason == "tool_calls" and not any(isinstance(e, agentspec.TextDelta) for e in events)
    assert [c.name for c in calls] == ["get_weather"] and calls[0].arguments["city"] == city
    jsonschema.validate(calls[0].arguments, WEATHER["function"]["parameters"])
    plain = await client.generate(messages, tools=[WEATHER], tool_choice="auto", max_tokens=40, speculative=False)
    spec = await client.generate(messages, tools=[WEATHER], tool_choice="auto", max_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.tool_calls[0].arguments == calls[0].arguments
    none = await client.generate(messages, tools=[WEATHER], tool_choice="none", max_tokens=40)
    assert none.tool_calls == [] and '"get_weather"' in none.text  # the same opening, never a call under "none"


# Parallel calls: a random tiny model ends a call with a newline (another call) or EOS at random, so
# it exercises several calls per reply; its enum/boolean arguments keep each call short.
FLAGS = {
    "type": "function",
    "function": {
        "name": "set_flags",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "on": {"type": "boolean"}}, "required": ["unit", "on"]},
    },
}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


def check_calls(loaded, seq, grammar) -> int:
    """The reply's calls parse, validate and are indexed 0..n-1; returns how many there are."""
    text = loaded.tokenizer.decode(seq.output_ids)
    if isinstance(grammar, AutoCallGrammar):
        state = grammar.initial_state
        for token in seq.output_ids:
            state = grammar.next_state(state, token)
        if not grammar.is_call(state):
            return 0
        text = CallTranscriber().feed(text)  # whatever opening the reply took → one compact call per line
    parser = ToolCallParser()
    events = parser.feed(text) + (parser.finish() if seq.finish_reason == "stop" else [])
    calls = [e for e in events if isinstance(e, agentspec.ToolCall)]
    assert [c.index for c in calls] == list(range(len(calls)))
    for c in calls:
        jsonschema.validate(c.arguments, {"set_flags": FLAGS, "ping": PING}[c.name]["function"]["parameters"])
    assert len(calls) == text.count("\n") + (seq.finish_reason == "stop" and not text.endswith("\n"))  # a transcribed call ends in its newline
    return len(calls)


@pytest.mark.parametrize("mode", ["forced", "auto"])
def test_parallel_calls_on_a_tiny_model(loaded, mode):
    """Forced, or "auto" after a scripted opening that names a tool (test_triggers.Scripted; the random
    model would never write one): greedy and seeded, speculative == plain."""
    from .test_triggers import Scripted

    tiny = tiny_model(loaded, seed=3, init=0.02)
    engine = Engine(tiny)
    specs, _, name = parse_tools([FLAGS, PING], "required")
    grammar = checked = RepeatedGrammar(loaded.grammars.compile(call_schema(specs, name)))
    if mode == "auto":
        checked = AutoCallGrammar(loaded.grammars, specs, None, parallel=True)
        grammar = Scripted(loaded.grammars.encode(b'{"name":"set_flags"'), checked, loaded.vocab_size)
    call_counts = []
    for i in range(3):
        prompt_ids = loaded.chat.encode([{"role": "user", "content": f"Request {i}: set the flags {'and ping ' * i}"}])
        for seed in (None, i, 10 + i):
            runs = {}
            for label, spec in (("plain", SpecConfig(enabled=False)), ("k8", SpecConfig(max_draft_tokens=8, adaptive=False))):
                params = GenerationParams(max_tokens=48, temperature=0.0 if seed is None else 1.0, seed=seed, spec=spec)
                runs[label], _ = decode(engine, prompt_ids, params, grammar=grammar)
            assert runs["k8"].tokens == runs["plain"].tokens, seed
            call_counts.append(check_calls(loaded, runs["plain"], checked))
    assert max(call_counts) >= 2 and min(call_counts) >= 1, call_counts  # the test exercises parallel calls


def test_parser_streams_several_calls_under_any_chunking():
    calls = [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("get_time", {}), ("send_email", {"to": "a@b.c", "subject": "«hi»"})]
    text = "\n".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False, separators=(",", ":")) for n, a in calls)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        parser, events = ToolCallParser(), []
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            events += parser.feed(text[start:end])
        events += parser.finish()
        done = [e for e in events if isinstance(e, agentspec.ToolCall)]
        assert [(c.name, c.arguments) for c in done] == calls and [c.index for c in done] == [0, 1, 2]
        for call in done:
            deltas = [e for e in events if isinstance(e, agentspec.ToolCallDelta) and e.index == call.index]
            assert deltas[0].id == call.id and deltas[0].name == call.name
            assert all(d.id is None and d.name is None for d in deltas[1:])
            assert json.loads("".join(d.arguments for d in deltas)) == call.arguments
        assert len({c.id for c in done}) == 3


def test_parser_holds_back_only_a_closing_brace():
    text = json.dumps({"name": "f", "arguments": {"q": "a}b", "n": {"m": 1}}}, separators=(",", ":"))
    start = text.index('"arguments":') + len('"arguments":')
    parser, streamed = ToolCallParser(), ""
    for end in range(1, len(text) + 1):
        streamed += "".join(e.arguments for e in parser.feed(text[end - 1]) if isinstance(e, agentspec.ToolCallDelta))
        visible = text[start:end]
        # everything fed is streamed at once, except a last "}" (it may close the call, not the arguments)
        assert streamed == (visible[:-1] if visible.endswith("}") else visible)
    *deltas, call = parser.finish()
    assert streamed + "".join(d.arguments for d in deltas) == text[start:-1]
    assert call.arguments == {"q": "a}b", "n": {"m": 1}}


@pytest.mark.parametrize(
    "params, error, needle",
    [
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, agentspec.InvalidRequestError, "parallel_tool_calls"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, agentspec.InvalidRequestError, "exclude"),
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


BOUNDED = {
    "type": "function",
    "function": {
        "name": "set_volume",
        "parameters": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "exclusiveMaximum": 11}}, "required": ["level"]},
    },
}


async def test_unenforceable_bounds_are_advisory_in_tools_unless_strict(client):
    """As OpenAI's function calling: a non-strict tool's bounds reach the model but are not enforced;
    with "strict": true the request is rejected, naming the keyword and the tool."""
    client.stream([{"role": "user", "content": "hi"}], tools=[BOUNDED], tool_choice="required")  # accepted
    strict = {"type": "function", "function": {**BOUNDED["function"], "strict": True}}
    with pytest.raises(agentspec.UnsupportedFeatureError, match=r"tools\[0\] \('set_volume'\).*`minimum`"):
        client.stream([{"role": "user", "content": "hi"}], tools=[strict], tool_choice="required")
