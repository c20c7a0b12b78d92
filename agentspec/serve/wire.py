"""The OpenAI chat-completions wire format, without HTTP: request bodies become ``Client.stream``
arguments, stream events become response bodies and SSE chunks, errors become OpenAI error bodies.

What a request may carry:

- passed to ``Client.stream`` as they are (it validates them): ``messages``, ``tools``,
  ``tool_choice``, ``parallel_tool_calls``, ``response_format``, ``temperature``, ``top_p``,
  ``seed``, ``stop``, and agentspec's own ``top_k``, ``min_p``, ``repetition_penalty``, ``tag``;
- ``max_completion_tokens`` or its older name ``max_tokens``;
- ``speculative``: a bool, or an object of ``SpecConfig`` fields;
- ``stream`` and ``stream_options.include_usage``;
- accepted and ignored (they change no output): ``user``, ``metadata``, ``store``,
  ``prompt_cache_key``, ``safety_identifier``, ``service_tier``;
- OpenAI options this server cannot honour are refused (``UnsupportedFeatureError``) unless they hold
  their neutral value (``n=1``, ``logprobs=false``, penalties 0, ``logit_bias={}``); anything else is
  an unknown parameter (``InvalidRequestError``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import (
    AgentSpecError,
    ClientClosedError,
    ContextLengthError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    LimitExceededError,
    RequestTimeoutError,
    UnsupportedFeatureError,
)
from ..types import Done, SpecConfig, SpecStats, TextDelta, ToolCallDelta, Usage

__all__ = ["HTTPError", "ChatRequest", "parse_chat_request", "error_reply", "ReplyShaper", "MessageBuilder", "sse"]

PASSED = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "tag",
    "cache_salt",
)
IGNORED = ("user", "metadata", "store", "prompt_cache_key", "safety_identifier", "service_tier")
# OpenAI options agentspec cannot serve, and the value that asks for nothing.
NEUTRAL = {"n": 1, "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
OWN = ("model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "speculative")
KNOWN = frozenset(PASSED + IGNORED + OWN) | NEUTRAL.keys()
DECODING_FAILED = "Decoding failed for this request (the server's log has the cause); other requests are unaffected, retry it."


class HTTPError(Exception):
    """A refusal that is not about the request's decoding parameters: authentication, size, routing."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code  # kind: the body's "type"


@dataclass(frozen=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    messages: Any  # validated by Client.stream
    params: dict[str, Any]  # keyword arguments of Client.stream
    stream: bool
    include_usage: bool


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"`{name}` must be true or false, got {value!r}.")
    return bool(value)


def _max_tokens(body: dict[str, Any]) -> Any:
    new, old = body.get("max_completion_tokens"), body.get("max_tokens")
    if new is not None and old is not None and new != old:
        raise InvalidRequestError(
            f"`max_completion_tokens` ({new!r}) and `max_tokens` ({old!r}) disagree; send only `max_completion_tokens`."
        )
    return new if new is not None else old


def _speculative(value: Any) -> Any:
    """A bool or a SpecConfig built from an object's fields (its errors name the field). Its
    ``shadow_rate`` is capped by the server's (``Limits.max_shadow_rate``) when the request ends."""
    if isinstance(value, dict):
        try:
            return SpecConfig(**value)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"`speculative`: {exc}") from None
    return value  # None, a bool, or a wrong type that Client.stream rejects with its own message


def parse_chat_request(body: Any, *, model: str) -> ChatRequest:
    """Validate a request body for the model this server serves. Raises ``InvalidRequestError``
    (HTTP 400), ``UnsupportedFeatureError`` (400) or ``HTTPError`` (an unknown model: 404)."""
    if not isinstance(body, dict):
        raise InvalidRequestError(f"The request body must be a JSON object, got {type(body).__name__}.")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise InvalidRequestError(
            f"Unknown parameter(s) {', '.join(map(repr, unknown))}; valid parameters are: {', '.join(sorted(KNOWN))}."
        )
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise UnsupportedFeatureError(
                f"`{name}`={body[name]!r} is not supported by agentspec serve; leave it out (or send {json.dumps(neutral)})."
            )
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise InvalidRequestError(f"`model` is required: send the model's id, {model!r} (GET /v1/models lists it).")
    if asked != model:
        raise HTTPError(404, f"The model {asked!r} does not exist here; this server serves {model!r}.", param="model", code="model_not_found")

    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequestError("`stream_options` is only allowed with `stream: true`.")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise InvalidRequestError(f"`stream_options` takes only {{'include_usage': bool}}, got {options!r}.")
    include_usage = _flag(options or {}, "include_usage")

    params = {name: body[name] for name in PASSED if name != "messages" and body.get(name) is not None}
    max_tokens = _max_tokens(body)
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if body.get("speculative") is not None:
        params["speculative"] = _speculative(body["speculative"])
    return ChatRequest(messages=body.get("messages"), params=params, stream=stream, include_usage=include_usage)


def error_reply(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` of an error."""
    if isinstance(exc, HTTPError):
        status, kind, param, code = exc.status, exc.kind, exc.param, exc.code
    elif isinstance(exc, ContextLengthError):
        status, kind, param, code = 400, "invalid_request_error", "messages", "context_length_exceeded"
    elif isinstance(exc, LimitExceededError):
        status, kind, param, code = 400, "invalid_request_error", None, exc.code
    elif isinstance(exc, UnsupportedFeatureError):
        status, kind, param, code = 400, "invalid_request_error", None, "unsupported_feature"
    elif isinstance(exc, InvalidRequestError):
        status, kind, param, code = 400, "invalid_request_error", None, None
    elif isinstance(exc, EngineOverloadedError):
        status, kind, param, code = 429, "rate_limit_error", None, "engine_overloaded"
    elif isinstance(exc, RequestTimeoutError):
        status, kind, param, code = 504, "timeout_error", None, "timeout"
    elif isinstance(exc, ClientClosedError):
        status, kind, param, code = 503, "server_error", None, "shutting_down"
    elif isinstance(exc, EngineError):  # its text quotes the failure inside the engine (logged there): not for callers
        return 500, {"error": {"message": DECODING_FAILED, "type": "server_error", "param": None, "code": "decoding_failed"}}
    elif isinstance(exc, AgentSpecError):
        status, kind, param, code = 500, "server_error", None, None
    else:  # a bug: its text is for the server's log, not for the caller
        return 500, {"error": {"message": "Internal server error; see the server's log.", "type": "server_error", "param": None, "code": None}}
    return status, {"error": {"message": str(exc), "type": kind, "param": param, "code": code}}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _usage(usage: Usage, stats: SpecStats) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


def _tool_call_delta(event: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed call fragment: id, type and name only in an index's first fragment."""
    function: dict[str, Any] = {"arguments": event.arguments}
    call: dict[str, Any] = {"index": event.index}
    if event.id is not None:
        call.update(id=event.id, type="function")
    if event.name is not None:
        function = {"name": event.name, **function}
    call["function"] = function
    return call


class ReplyShaper:
    """Builds one reply's bodies: a ``chat.completion``, or its ``chat.completion.chunk`` stream.

    Per-request speculation statistics ride along as an extra top-level field, ``"agentspec"`` (the
    ``SpecStats`` fields), on the completion and on the stream's finishing chunk.
    """

    def __init__(self, model: str, *, include_usage: bool = False) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self._role_sent = False

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        chunk.update(extra)
        return chunk

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        if not self._role_sent:  # the role opens the first delta
            self._role_sent = True
            delta = {"role": "assistant", **delta}
        return delta

    def chunks(self, event: Any) -> list[dict[str, Any]]:
        """The chunks an event becomes: none (a complete ``ToolCall`` was already streamed as
        fragments), one delta, or for ``Done`` the finishing chunk and, if asked, the usage chunk."""
        if isinstance(event, TextDelta):
            delta: dict[str, Any] | None = {"content": event.text} if event.text else None
        elif isinstance(event, ToolCallDelta):
            delta = {"tool_calls": [_tool_call_delta(event)]}
        elif isinstance(event, Done):
            last = {"index": 0, "delta": self._delta({} if self._role_sent else {"content": ""}), "logprobs": None, "finish_reason": event.finish_reason}
            out = [self._chunk([last], agentspec=event.stats.model_dump())]
            if self.include_usage:
                out.append(self._chunk([], usage=_usage(event.usage, event.stats)))
            return out
        else:
            delta = None
        if delta is None:
            return []
        return [self._chunk([{"index": 0, "delta": self._delta(delta), "logprobs": None, "finish_reason": None}])]

    def completion(self, message: dict[str, Any], done: Done) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": _usage(done.usage, done.stats),
            "agentspec": done.stats.model_dump(),
        }


class MessageBuilder:
    """Collects a stream's events into the assistant message of a non-streamed reply. A call's
    ``arguments`` is the JSON text the model wrote (its fragments joined), as streaming gives it."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.done: Done | None = None

    def add(self, event: Any) -> None:
        if isinstance(event, TextDelta):
            self.text.append(event.text)
        elif isinstance(event, ToolCallDelta):
            call = self.calls.setdefault(event.index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            call["id"] = event.id or call["id"]
            call["function"]["name"] = event.name or call["function"]["name"]
            call["function"]["arguments"] += event.arguments
        elif isinstance(event, Done):
            self.done = event

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) if self.text or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [self.calls[index] for index in sorted(self.calls)]
        return message
