"""OpenAI chat messages → the model's chat template → prompt token ids.

Messages are validated and normalised before anything runs: roles checked, text parts joined,
same-role runs merged, assistant tool calls rendered as text, and the system message folded into the
first user message when the template has no system role.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from .errors import InvalidRequestError

__all__ = ["normalize_messages", "ChatFormat"]

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequestError(
                    f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {part!r}."
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"{where}: `content` must be a string or a list of text parts, got {type(content).__name__}.")


def _render_tool_calls(tool_calls: Any, where: str) -> str:
    if not isinstance(tool_calls, list):
        raise InvalidRequestError(f"{where}: `tool_calls` must be a list, got {type(tool_calls).__name__}.")
    rendered = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{where}: each tool call needs {{'function': {{'name': str, 'arguments': str}}}}, got {call!r}.")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise InvalidRequestError(f"{where}: tool call arguments must be a JSON string or an object, got {arguments!r}.")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where}: tool call arguments are not valid JSON ({exc}).") from None
        # Compact, as the call grammar makes the model write them: history and new calls look alike.
        call_json = {"name": function["name"], "arguments": arguments}
        rendered.append(json.dumps(call_json, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(rendered)


def normalize_messages(messages: Any, *, system_role: bool = True) -> list[dict[str, str]]:
    """Validate OpenAI chat messages and return ``[{"role", "content"}]`` ready for a chat template."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("`messages` must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}.")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}: unknown role {role!r}; use one of {', '.join(ROLES)}.")
        if "content" not in message and not message.get("tool_calls"):
            raise InvalidRequestError(f"{where}: missing 'content'.")
        if role == "tool" and not (isinstance(message.get("tool_call_id"), str) and message["tool_call_id"]):
            raise InvalidRequestError(f"{where}: a 'tool' message needs the `tool_call_id` of the call it answers.")
        text = _text(message.get("content"), where)
        if role == "assistant" and message.get("tool_calls"):
            calls = _render_tool_calls(message["tool_calls"], where)
            text = f"{text}\n{calls}" if text else calls
        role = "system" if role == "developer" else role
        if out and out[-1]["role"] == role and role != "tool":
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text})
    if not system_role and out[0]["role"] == "system":
        system = out.pop(0)["content"]
        if out and out[0]["role"] == "user":
            out[0]["content"] = f"{system}\n\n{out[0]['content']}"
        else:
            out.insert(0, {"role": "user", "content": system})
    if not any(m["role"] in ("user", "system") for m in out):
        raise InvalidRequestError("`messages` needs at least one 'user' or 'system' message.")
    return out


class ChatFormat:
    """Renders normalised messages with the tokenizer's chat template (plain 'role: text' without one)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.system_role = self.has_template and self._supports_system_role()

    def _supports_system_role(self) -> bool:
        probe = [{"role": "system", "content": "\x00probe\x00"}, {"role": "user", "content": "hi"}]
        try:
            return "\x00probe\x00" in self.tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # templates that raise on a system role ("System role not supported")
            return False

    @functools.cached_property
    def _markers(self) -> tuple[str, ...]:
        """Texts the tokenizer turns into added (special) tokens wherever they appear."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return tuple(str(getattr(token, "content", token)) for token in added.values())

    def render(self, messages: Any) -> str:
        return self._render(normalize_messages(messages, system_role=self.system_role))

    def _render(self, normal: list[dict[str, str]]) -> str:
        if not self.has_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in normal) + "assistant: "
        try:
            return self.tokenizer.apply_chat_template(normal, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raise_exception() in templates, e.g. strict role alternation
            raise InvalidRequestError(f"The model's chat template rejected these messages: {exc}") from exc

    def encode(self, messages: Any) -> list[int]:
        """Token ids of the prompt. Text inside messages never becomes a special token: a message that
        contains ``<|im_start|>`` and the like cannot open a role of its own (prompt injection)."""
        normal = normalize_messages(messages, system_role=self.system_role)
        if not any(marker in m["content"] for m in normal for marker in self._markers):
            return self._ids(self._render(normal))
        # Render with a sentinel per message, then tokenize the template's text as usual and each
        # message's text with special-token matching off.
        sentinels = [f"\x00agentspec-{i}\x00" for i in range(len(normal))]
        rest = self._render([{**m, "content": sentinel} for m, sentinel in zip(normal, sentinels)])
        ids: list[int] = []
        for message, sentinel in zip(normal, sentinels):
            before, found, rest = rest.partition(sentinel)
            if not found:
                raise InvalidRequestError(
                    "A message contains special-token text (e.g. '<|im_start|>') and this model's chat template "
                    "rewrites message text, so it cannot be kept inert; remove that text from the message."
                )
            ids += self._ids(before) + self._ids(message["content"], split_special_tokens=True)
        return ids + self._ids(rest)

    def _ids(self, text: str, **options: Any) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False, **options)) if text else []
