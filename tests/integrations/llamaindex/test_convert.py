"""Pure conversions: messages, tool choice, partial tool arguments, streamed responses (no model)."""

from __future__ import annotations

import json

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock, ThinkingBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection
from llama_index.llms.agentspec import AgentSpecLLM
from llama_index.llms.agentspec._convert import ResponseBuilder, parse_partial_object, resolve_tool_choice, to_openai_messages

import agentspec


def test_messages_become_openai_dicts() -> None:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(
            role="assistant",
            blocks=[ThinkingBlock(content="hidden"), ToolCallBlock(tool_call_id="c1", tool_name="get_weather", tool_kwargs={"city": "Paris"})],
        ),
        ChatMessage(role="tool", content="Sunny", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [ToolSelection(tool_id="c2", tool_name="f", tool_kwargs={"x": 1})]}),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [{"id": "c3", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}),
    ]
    assert to_openai_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
    ]


def test_non_text_blocks_are_refused() -> None:
    message = ChatMessage(role="user", blocks=[TextBlock(text="Look:"), ImageBlock(url="https://example.com/a.png")])
    with pytest.raises(ValueError, match="ImageBlock"):
        to_openai_messages([message])


@pytest.mark.parametrize(
    ("tool_choice", "tool_required", "expected"),
    [
        (None, False, "auto"),
        (None, True, "required"),
        ("none", False, "none"),
        ("required", False, "required"),
        ("get_weather", False, {"type": "function", "function": {"name": "get_weather"}}),
        ({"type": "function", "function": {"name": "f"}}, True, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tool_choice(tool_choice, tool_required, expected) -> None:
    assert resolve_tool_choice(tool_choice, tool_required) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("{", {}),
        ('{"ci', {}),
        ('{"city"', {}),
        ('{"city":', {}),
        ('{"city":"Par', {"city": "Par"}),
        ('{"city":"Paris"', {"city": "Paris"}),
        ('{"city":"Paris","days":3', {"city": "Paris", "days": 3}),
        ('{"city":"Paris","now":tr', {"city": "Paris"}),
        ('{"city":"Paris",', {"city": "Paris"}),
        ('{"tags":["a","b', {"tags": ["a", "b"]}),
        ('{"q":"say \\"hi', {"q": 'say "hi'}),
        ('{"q":"x\\', {"q": "x"}),
        ('{"a":{"b":1},"c":{"d"', {"a": {"b": 1}, "c": {}}),
        ('{"city":"Paris"}', {"city": "Paris"}),
        ("[1, 2]", {}),
        ("not json", {}),
    ],
)
def test_partial_arguments(text, expected) -> None:
    assert parse_partial_object(text) == expected


def test_partial_arguments_of_every_prefix_are_dicts() -> None:
    full = '{"city":"São Paulo","days":[1,2],"units":{"temp":"C"},"exact":true,"n":-1.5e3}'
    previous_keys = 0
    for end in range(len(full) + 1):
        parsed = parse_partial_object(full[:end])
        assert isinstance(parsed, dict)
        assert len(parsed) >= previous_keys  # arguments never disappear as text arrives
        previous_keys = len(parsed)
    assert parse_partial_object(full) == json.loads(full)


def test_streamed_tool_call_becomes_blocks_and_selections() -> None:
    stats = agentspec.SpecStats()
    events = [
        agentspec.ToolCallDelta(index=0, id="call_1", name="get_weather", arguments=""),
        agentspec.ToolCallDelta(index=0, arguments='{"city":"Pa'),
        agentspec.ToolCallDelta(index=0, arguments='ris"}'),
        agentspec.ToolCall(index=0, id="call_1", name="get_weather", arguments={"city": "Paris"}),
        agentspec.Done(finish_reason="tool_calls", usage=agentspec.Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12), stats=stats),
    ]
    builder = ResponseBuilder()
    responses = [builder.feed(event) for event in events]
    kwargs = [[b.tool_kwargs for b in r.message.blocks if isinstance(b, ToolCallBlock)] for r in responses]
    assert kwargs == [[""], ['{"city":"Pa'], ['{"city":"Paris"}'], [{"city": "Paris"}], [{"city": "Paris"}]]
    llm = AgentSpecLLM()  # loads nothing
    assert llm.get_tool_calls_from_response(responses[1], error_on_no_tool_call=False) == [
        ToolSelection(tool_id="call_1", tool_name="get_weather", tool_kwargs={"city": "Pa"})
    ]
    last = responses[-1]
    assert last.additional_kwargs["finish_reason"] == "tool_calls"
    assert last.additional_kwargs["total_tokens"] == 12
    assert "target_forward_passes_saved" in last.additional_kwargs["spec_stats"]
    assert last.raw["type"] == "done"


def test_no_tool_call() -> None:
    llm = AgentSpecLLM()
    builder = ResponseBuilder()
    response = builder.feed(agentspec.TextDelta(text="Hello", token_ids=[1]))
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(response)
