"""Tool calling: OpenAI function tools → a call grammar, a prompt section, and streamed call events.

A forced call (``tool_choice="required"`` or a named function) is generated under the grammar
``{"name": <one of the tools>, "arguments": <that tool's parameters>}`` from the first token, in
compact JSON, so the text is always ``{"name":"NAME","arguments":{...}}``. ``ToolCallParser`` turns
that verified text into ``ToolCallDelta`` events (id and name only in the first) and a final
``ToolCall`` with parsed arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError, UnsupportedFeatureError
from .types import ToolCall, ToolCallDelta

__all__ = ["ToolSpec", "parse_tools", "call_schema", "with_tool_prompt", "ToolCallParser"]

NAME_PREFIX = '{"name":"'
ARGUMENTS_MARK = '","arguments":'


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


def parse_tools(tools: Any, tool_choice: Any) -> tuple[list[ToolSpec], str | None]:
    """Validate ``tools``/``tool_choice``; returns the tools and the forced name ("" = any tool, None = no call)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError(f"`tool_choice={tool_choice!r}` needs `tools`; pass the tools or drop tool_choice.")
        return [], None
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, 'parameters': {{...}}}}}}.")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object.")
        specs.append(ToolSpec(function["name"], str(function.get("description", "")), parameters))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"Tool names must be unique, got {names}.")
    if tool_choice in (None, "auto"):
        raise UnsupportedFeatureError(
            "tool_choice='auto' (the model decides whether to call a tool) is not in this build yet; "
            "pass tool_choice='required', a named function, or 'none'."
        )
    if tool_choice == "none":
        return specs, None
    if tool_choice == "required":
        return specs, ""
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools: {', '.join(names)}.")
    return specs, name


def call_schema(tools: list[ToolSpec], forced_name: str) -> dict[str, Any]:
    """The grammar of one call: ``{"name": const, "arguments": parameters}``, any of the allowed tools."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
        }
        for tool in tools
        if not forced_name or tool.name == forced_name
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """Tell the model about the tools in a system section (the default model's template has no tool role)."""
    listing = json.dumps(
        [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools], ensure_ascii=False
    )
    section = (
        f"You can call these tools:\n{listing}\n"
        'To call a tool, reply with JSON: {"name": <tool name>, "arguments": <arguments object>}.'
    )
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages  # malformed: message validation reports it
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{section}"
    else:
        messages.insert(0, {"role": "system", "content": section})
    return messages


@dataclass
class ToolCallParser:
    """Verified call text in, call events out. Holds back the outer ``}`` until the call is complete."""

    index: int = 0
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    text: str = ""
    name: str | None = None
    _sent: int = 0  # characters of the arguments already streamed

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        events: list[ToolCallDelta] = []
        if self.name is None:
            mark = self.text.find(ARGUMENTS_MARK)
            if mark < 0:
                return events
            self.name = self.text[len(NAME_PREFIX) : mark]
            events.append(ToolCallDelta(index=self.index, id=self.id, name=self.name, arguments=""))
        arguments = self._arguments()[:-1]  # the last character may be the outer object's "}"
        if len(arguments) > self._sent:
            events.append(ToolCallDelta(index=self.index, arguments=arguments[self._sent :]))
            self._sent = len(arguments)
        return events

    def _arguments(self) -> str:
        return self.text[self.text.find(ARGUMENTS_MARK) + len(ARGUMENTS_MARK) :]

    def finish(self) -> tuple[list[ToolCallDelta], ToolCall]:
        """The call is complete: the last argument fragment and the parsed call."""
        arguments = self._arguments()[:-1]
        events = [ToolCallDelta(index=self.index, arguments=arguments[self._sent :])] if len(arguments) > self._sent else []
        self._sent = len(arguments)
        call = ToolCall(index=self.index, id=self.id, name=self.name or "", arguments=json.loads(arguments))
        return events, call
