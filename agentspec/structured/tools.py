"""Tool calling: OpenAI function tools → a call grammar, a prompt section, and streamed call events.

A forced call (``tool_choice="required"`` or a named function) is generated under the grammar
``{"name": <one of the tools>, "arguments": <that tool's parameters>}`` from the first token, in
compact JSON, so the text is always ``{"name":"NAME","arguments":{...}}``. ``ToolCallParser`` turns
that verified text into ``ToolCallDelta`` events (id and name only in the first) and a final
``ToolCall`` with parsed arguments.

This bare JSON and the prompt section of ``with_tool_prompt`` are for models whose chat template has
no tools (the default model). Where the template shows a family's own syntax (``<tool_call>`` tags,
Llama's ``parameters``, Mistral's ``[TOOL_CALLS]`` list), ``formats`` writes calls in it and rewrites
them into this text for the parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError
from .grammar import MAX_REGEX_CHARS, schema_regex
from ..types import ToolCall, ToolCallDelta

__all__ = ["ToolSpec", "parse_tools", "call_schema", "schema_tool_names", "with_tool_prompt", "ToolCallParser", "CallAssembler"]

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; a name never needs JSON escaping
NAME_PREFIX = '{"name":"'
ARGUMENTS_MARK = '","arguments":'


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


def parse_tools(tools: Any, tool_choice: Any, *, max_grammar_chars: int = MAX_REGEX_CHARS) -> tuple[list[ToolSpec], str, str]:
    """Validate ``tools``/``tool_choice``.

    Returns the tools, the mode ("off": answer in text, "auto": the model decides, "forced": a call
    from the first token) and the forced tool's name ("" = any of the tools).
    """
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError(f"`tool_choice={tool_choice!r}` needs `tools`; pass the tools or drop tool_choice.")
        return [], "off", ""
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, 'parameters': {{...}}}}}}.")
        name = function["name"]
        if not TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, '_' or '-'.")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object.")
        try:
            schema_regex(parameters, strict=function.get("strict") is True, max_chars=max_grammar_chars)
        except InvalidRequestError as exc:  # the same error (a LimitExceededError keeps its limit), located
            exc.args = (f"tools[{i}] ({name!r}).function.parameters: {exc}",)
            raise exc from None
        specs.append(ToolSpec(name, str(function.get("description", "")), parameters))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"Tool names must be unique, got {names}.")
    if tool_choice in (None, "auto"):
        return specs, "auto", ""
    if tool_choice == "none":
        return specs, "off", ""
    if tool_choice == "required":
        return specs, "forced", ""
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools: {', '.join(names)}.")
    return specs, "forced", name


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


def schema_tool_names(schema: dict[str, Any]) -> set[str]:
    """The tools a ``call_schema`` allows (a model family's call grammar is built from the same tools)."""
    return {option["properties"]["name"]["const"] for option in schema.get("anyOf", [schema])}


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """Tell the model about the tools in a system section (the default model's template has no tool role)."""
    listing = json.dumps(
        [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools], ensure_ascii=False
    )
    section = (
        f"You can call these tools:\n{listing}\n"
        'To call a tool, reply with JSON: {"name": <tool name>, "arguments": <arguments object>}; '
        "for several calls, one JSON object per line."
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
class _Call:
    index: int
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    text: str = ""
    name: str | None = None
    sent: int = 0  # characters of the arguments already streamed

    def arguments(self, complete: bool = False) -> str:
        """The arguments text so far. A last ``}`` is held back until more text shows whether it
        closes the arguments or the call (``complete``: it closes the call, so drop it)."""
        text = self.text[self.text.find(ARGUMENTS_MARK) + len(ARGUMENTS_MARK) :]
        return text[:-1] if complete or text.endswith("}") else text


class ToolCallParser:
    """Verified call text in, call events out. The text is one compact JSON call per line, so a
    newline ends a call; a ``}`` that may be the outer one of the call being written is held back."""

    def __init__(self) -> None:
        self._current: _Call | None = None
        self._count = 0

    def feed(self, text: str) -> list[ToolCallDelta | ToolCall]:
        events: list[ToolCallDelta | ToolCall] = []
        for i, piece in enumerate(text.split("\n")):
            if i:
                events.extend(self.finish())
            if not piece:
                continue
            if self._current is None:
                self._current = _Call(index=self._count)
                self._count += 1
            call = self._current
            call.text += piece
            if call.name is None:
                mark = call.text.find(ARGUMENTS_MARK)
                if mark < 0:
                    continue
                call.name = call.text[len(NAME_PREFIX) : mark]
                events.append(ToolCallDelta(index=call.index, id=call.id, name=call.name, arguments=""))
            events.extend(self._delta(call))
        return events

    def finish(self) -> list[ToolCallDelta | ToolCall]:
        """The call being written is complete: its last argument fragment and the parsed call."""
        call, self._current = self._current, None
        if call is None:
            return []
        return [*self._delta(call, complete=True), ToolCall(index=call.index, id=call.id, name=call.name or "", arguments=json.loads(call.arguments(complete=True)))]

    @staticmethod
    def _delta(call: _Call, complete: bool = False) -> list[ToolCallDelta]:
        arguments = call.arguments(complete)
        if call.name is None or len(arguments) <= call.sent:
            return []
        fragment, call.sent = arguments[call.sent :], len(arguments)
        return [ToolCallDelta(index=call.index, arguments=fragment)]


class CallAssembler:
    """A server's streamed call fragments in, the same call events as ``ToolCallParser`` out.

    Servers repeat ``id``/``name`` or send them late; events carry them once, in an index's first
    delta (held back until the name is known). ``finish`` parses each call's arguments and checks
    them against its tool's schema: a server without guided decoding can write anything.
    """

    def __init__(self, tools: tuple[ToolSpec, ...]) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, index: int, id: str | None, name: str | None, arguments: str) -> list[ToolCallDelta]:
        call = self._calls.setdefault(index, {"id": None, "name": None, "arguments": "", "sent": 0, "opened": False})
        call["id"] = call["id"] or id
        call["name"] = call["name"] or name
        call["arguments"] += arguments
        if call["name"] is None:
            return []
        events: list[ToolCallDelta] = []
        if not call["opened"]:
            call["opened"] = True
            call["id"] = call["id"] or f"call_{uuid.uuid4().hex[:24]}"
            events.append(ToolCallDelta(index=index, id=call["id"], name=call["name"], arguments=""))
        if len(call["arguments"]) > call["sent"]:
            events.append(ToolCallDelta(index=index, arguments=call["arguments"][call["sent"] :]))
            call["sent"] = len(call["arguments"])
        return events

    @property
    def calls(self) -> int:
        return len(self._calls)

    def finish(self) -> list[ToolCall]:
        """The complete calls, in index order. Raises ``ValueError`` naming the call that is not a
        valid call of one of the tools."""
        import jsonschema  # the remote extra's dependency; only remote replies come here

        done: list[ToolCall] = []
        for index in sorted(self._calls):
            call = self._calls[index]
            name = call["name"]
            tool = self._tools.get(name)
            if tool is None:
                raise ValueError(f"tool call {index} names {name!r}, which is not one of the tools: {', '.join(self._tools)}")
            try:
                arguments = json.loads(call["arguments"] or "{}")
                jsonschema.validate(arguments, tool.parameters)
            except (ValueError, jsonschema.ValidationError) as exc:
                message = getattr(exc, "message", None) or str(exc)
                raise ValueError(f"tool call {index} ({name!r}) has arguments that do not match the tool's schema: {message}") from None
            if not isinstance(arguments, dict):
                raise ValueError(f"tool call {index} ({name!r}) has arguments that are not a JSON object: {call['arguments']!r}")
            done.append(ToolCall(index=index, id=call["id"], name=name, arguments=arguments))
        return done
