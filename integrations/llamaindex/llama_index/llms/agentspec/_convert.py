"""LlamaIndex ↔ agentspec data: chat messages, tool choice, partial tool arguments, streamed responses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.llms.types import (
    CacheControl,
    CachePoint,
    ChatMessage,
    ChatResponse,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

import agentspec

__all__ = ["to_openai_messages", "resolve_tool_choice", "parse_partial_object", "ResponseBuilder"]

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "developer",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}
_SKIPPED_BLOCKS = (ThinkingBlock, CachePoint, CacheControl)  # nothing the model should read back

MAX_REPAIR_STEPS = 256  # characters parse_partial_object may drop from the end before giving up


# -- messages ----------------------------------------------------------------------------------------


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)


def _openai_tool_call(call: Any) -> dict[str, Any]:
    """An OpenAI tool call dict from what LlamaIndex keeps in ``additional_kwargs["tool_calls"]``."""
    if isinstance(call, dict):
        return call
    if hasattr(call, "tool_name"):  # a ToolSelection
        return {"id": call.tool_id, "type": "function", "function": {"name": call.tool_name, "arguments": _arguments_text(call.tool_kwargs)}}
    function = call.function  # an openai ChatCompletionMessageToolCall-like object
    return {"id": call.id, "type": "function", "function": {"name": function.name, "arguments": _arguments_text(function.arguments)}}


def _message(message: ChatMessage, where: str) -> dict[str, Any]:
    role = _ROLES.get(message.role)
    if role is None:
        raise ValueError(f"{where}: role {message.role!r} has no agentspec equivalent; use system, user, assistant or tool.")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolCallBlock):
            calls.append(
                {
                    "id": block.tool_call_id or f"call_{len(calls)}",
                    "type": "function",
                    "function": {"name": block.tool_name, "arguments": _arguments_text(block.tool_kwargs)},
                }
            )
        elif not isinstance(block, _SKIPPED_BLOCKS):
            raise ValueError(f"{where}: agentspec models read text only; {type(block).__name__} is not supported.")
    out: dict[str, Any] = {"role": role, "content": "\n".join(text)}
    if role == "assistant":
        calls = calls or [_openai_tool_call(c) for c in message.additional_kwargs.get("tool_calls") or []]
        if calls:
            out["tool_calls"] = calls
    elif role == "tool" and message.additional_kwargs.get("tool_call_id"):
        out["tool_call_id"] = message.additional_kwargs["tool_call_id"]
    return out


def to_openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex chat messages → the OpenAI chat dicts ``agentspec.Client.stream`` takes."""
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def resolve_tool_choice(tool_choice: str | dict[str, Any] | None, tool_required: bool) -> str | dict[str, Any]:
    """LlamaIndex's ``tool_choice`` (a mode, a tool name or an OpenAI dict) or ``tool_required`` → OpenAI's."""
    if tool_choice is None:
        return "required" if tool_required else "auto"
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": tool_choice}}
    return tool_choice


# -- partial JSON ------------------------------------------------------------------------------------


def _closed(text: str) -> str:
    """``text`` with an open string and open containers closed (a trailing ``,`` or ``:`` fails later)."""
    closers: list[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]" and closers:
            closers.pop()
    return text + ('"' if in_string else "") + "".join(reversed(closers))


def parse_partial_object(text: str) -> dict[str, Any]:
    """The arguments a streamed, possibly cut-off JSON object holds so far; ``{}`` when there are none.

    Close what is open and parse; if that fails (a cut literal like ``tr``, a key without a value, a
    trailing comma), drop the last character and retry. A partial string value is kept as far as it
    came (``{"city":"Par`` → ``{"city": "Par"}``), unlike ``llama_index.core.llms.utils.parse_partial_json``,
    which turns it into ``None``.
    """
    text = text.strip()
    for _ in range(MAX_REPAIR_STEPS):
        if not text:
            break
        try:
            value = json.loads(_closed(text))
        except json.JSONDecodeError:
            text = text[:-1]
            continue
        return value if isinstance(value, dict) else {}
    return {}


# -- streamed responses ------------------------------------------------------------------------------


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""  # the JSON text streamed so far
    parsed: dict[str, Any] | None = None  # set by the final ToolCall event

    def block(self) -> ToolCallBlock:
        kwargs = self.parsed if self.parsed is not None else self.arguments
        return ToolCallBlock(tool_call_id=self.id, tool_name=self.name, tool_kwargs=kwargs)


class ResponseBuilder:
    """agentspec events in, cumulative LlamaIndex ``ChatResponse``s out (one per event).

    Each response's message holds all text so far and a ``ToolCallBlock`` per call: ``tool_kwargs``
    is the argument JSON so far (a string) while the call streams, the parsed dict once it is
    complete. The ``Done`` event's response carries usage, finish reason and speculation stats.
    """

    def __init__(self) -> None:
        self.text = ""
        self.calls: dict[int, _Call] = {}
        self.done: agentspec.Done | None = None

    def feed(self, event: Any) -> ChatResponse:
        delta = ""
        if isinstance(event, agentspec.TextDelta):
            delta = event.text
            self.text += delta
        elif isinstance(event, agentspec.ToolCallDelta):
            call = self.calls.get(event.index)
            if call is None:
                call = self.calls[event.index] = _Call(event.id or f"call_{event.index}", event.name or "")
            call.arguments += event.arguments
        elif isinstance(event, agentspec.ToolCall):
            call = self.calls.setdefault(event.index, _Call(event.id, event.name))
            call.id, call.name, call.parsed = event.id, event.name, event.arguments
        elif isinstance(event, agentspec.Done):
            self.done = event
        return self.response(delta=delta, raw=event.model_dump())

    def response(self, *, delta: str | None = None, raw: Any = None) -> ChatResponse:
        blocks: list[Any] = [TextBlock(text=self.text)]
        blocks += [self.calls[index].block() for index in sorted(self.calls)]
        message = ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)
        extra: dict[str, Any] = {}
        if self.done is not None:
            extra = {
                **self.done.usage.model_dump(),  # prompt_tokens, completion_tokens, total_tokens
                "finish_reason": self.done.finish_reason,
                "spec_stats": self.done.stats.model_dump(),
            }
        return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra)
