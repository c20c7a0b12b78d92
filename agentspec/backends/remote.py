"""The remote backend: requests run on an OpenAI-compatible chat-completions server.

Built on the ``openai`` SDK's async client (its SSE decoding, its HTTP connection pool). What the
client validated is sent in the wire format; streamed chunks come back as ``Step``s. A server's own
speculation statistics fill ``SpecStats`` where it reports them:

============  ==========================================================================
server        where its statistics are read
============  ==========================================================================
agentspec     the ``agentspec`` field of the finishing chunk: every ``SpecStats`` field
vllm          ``metrics.speculative_decoding`` (``--per-request-spec-decode-metrics``)
sglang        ``meta_info`` (``spec_verify_ct``, ``spec_accept_token_num``, ...)
llamacpp      ``timings`` (``draft_n``, ``draft_n_accepted``)
============  ==========================================================================

A field the server does not report stays ``None``; TTFT and TPOT are measured here, as the caller
sees them. Errors become agentspec's typed errors with the server's message; text already streamed
stands. Closing a stream closes its HTTP response, which makes the server abort the request.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
import weakref
from typing import Any

from ..errors import (
    AgentSpecError,
    ClientClosedError,
    ContextLengthError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RemoteError,
    RequestTimeoutError,
    UnsupportedFeatureError,
)
from ..metrics import MetricsAggregator
from ..params import GenerationParams
from ..types import SpecConfig, SpecStats, Usage
from .base import CallFragment, Request, Step

__all__ = ["RemoteBackend", "RemoteStream", "SERVERS", "API_KEY_ENV", "request_body", "chunk_step", "server_stats"]

API_KEY_ENV = "AGENTSPEC_API_KEY"
CONNECT_TIMEOUT_S = 10.0

# The kind of server, from the ``owned_by`` of its model (GET /v1/models), and the sampling options
# beyond OpenAI's that it takes (under agentspec's name → its own name).
SERVERS: dict[str, dict[str, str]] = {
    "agentspec": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"},
    "vllm": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"},
    "sglang": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"},
    "llamacpp": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repeat_penalty"},
    "openai": {},
}
# llama.cpp's own server says "llamacpp"; llama-cpp-python's says "me".
OWNERS = {"agentspec": "agentspec", "vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "llama.cpp": "llamacpp", "me": "llamacpp"}
NEUTRAL = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# What the SDK's ``chat.completions.create`` takes by name; the rest of a body goes as ``extra_body``.
SDK_PARAMETERS = frozenset({"model", "messages", "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "seed", "stop",
                            "response_format", "max_tokens", "temperature", "top_p"})
UNKNOWN_USAGE = Usage(prompt_tokens=None, completion_tokens=None, total_tokens=None)
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "function_call": "tool_calls", "abort": "cancelled"}


def _server_kind(owned_by: Any) -> str:
    return OWNERS.get(str(owned_by).lower(), "openai")


def _response_format(params: GenerationParams, given: Any, server: str) -> Any:
    """A pydantic class becomes OpenAI's json_schema object, other values go as the caller gave
    them; llama.cpp's servers enforce a schema only as ``{"type": "json_object", "schema": ...}``."""
    if isinstance(given, dict) and given.get("type") in ("text", "json_object"):
        return given
    if server == "llamacpp":
        return {"type": "json_object", "schema": params.schema}
    if params.response_model is None:
        return given
    name = getattr(params.response_model, "__name__", "response")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": params.schema, "strict": True}}


def request_body(request: Request, *, model: str, server: str) -> dict[str, Any]:
    """The ``POST /v1/chat/completions`` body (streamed) of a validated request for this kind of
    server. Raises ``UnsupportedFeatureError`` for what the server cannot honour."""
    params, given = request.params, request.options
    extras = SERVERS[server]
    body: dict[str, Any] = {"model": model, "messages": request.messages, "stream": True, "stream_options": {"include_usage": True}}
    for name in ("tools", "tool_choice", "parallel_tool_calls", "seed", "stop"):
        if given.get(name) is not None:
            body[name] = given[name]
    if given.get("response_format") is not None:
        body["response_format"] = _response_format(params, given["response_format"], server)
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens  # the name every server takes; OpenAI's newer one is not in all
    body["temperature"] = params.temperature
    body["top_p"] = params.top_p
    for name, neutral in NEUTRAL.items():
        value = getattr(params, name)
        if value == neutral:
            continue
        if name not in extras:
            raise UnsupportedFeatureError(f"`{name}`={value!r} is not an option of this server ({server}); leave it out.")
        body[extras[name]] = value
    if params.spec != SpecConfig():  # asked of this request, or the client's default
        if server != "agentspec":
            raise UnsupportedFeatureError(
                f"Speculation settings per request are not supported by this server ({server}): it speculates as it was "
                "started (vLLM: --speculative-config; SGLang: --speculative-algorithm). Leave `speculative` and `spec` out."
            )
        body["speculative"] = params.spec.model_dump(mode="json")
    if params.tag is not None and server == "agentspec":
        body["tag"] = params.tag
    if params.cache_salt is not None:  # agentspec serve and vLLM take it by this name
        body["cache_salt"] = params.cache_salt
    return body


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def server_stats(server: str, chunk: dict[str, Any], output_tokens: int | None) -> SpecStats | None:
    """The speculation statistics a chunk (or a whole response) reports, or None if it has none."""
    if server == "agentspec" and isinstance(chunk.get("agentspec"), dict):
        return SpecStats.model_validate(chunk["agentspec"])
    drafted = accepted = passes = None
    if isinstance((chunk.get("metrics") or {}).get("speculative_decoding"), dict):  # vLLM
        spec = chunk["metrics"]["speculative_decoding"]
        drafted, accepted = _count(spec.get("num_draft_tokens")), _count(spec.get("num_accepted_draft_tokens"))
    else:
        choices = chunk.get("choices") or [{}]
        meta = chunk.get("meta_info") or (choices[0] or {}).get("meta_info")
        timings = chunk.get("timings")
        if isinstance(meta, dict):  # SGLang
            drafted, accepted = _count(meta.get("spec_draft_token_num")), _count(meta.get("spec_accept_token_num"))
            passes = _count(meta.get("spec_verify_ct")) or None  # 0: it did not speculate, and did not count passes
        elif isinstance(timings, dict) and "draft_n" in timings:  # llama.cpp
            drafted, accepted = _count(timings.get("draft_n")), _count(timings.get("draft_n_accepted"))
        else:
            return None
    stats = _unknown_stats(output_tokens)
    stats.drafted_tokens, stats.accepted_tokens, stats.target_forward_passes = drafted, accepted, passes
    return stats.derive()


def _unknown_stats(output_tokens: int | None) -> SpecStats:
    """What any server lets us know: one request and its output tokens; the rest is None."""
    known = ("requests", "output_tokens", "accepted_by_source", "shadow_checks", "quality_diff_sampled")  # the last 3: local checks, none ran
    unknown = {name: None for name in SpecStats.model_fields if name not in known}
    return SpecStats(requests=1, output_tokens=output_tokens, **unknown)


def chunk_step(chunk: dict[str, Any]) -> Step | None:
    """A streamed ``chat.completion.chunk``'s content and call fragments (finish handled by the caller)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    delta = choices[0].get("delta") or {}
    text = delta.get("content") or ""
    calls = tuple(
        CallFragment(
            index=int(call.get("index", i)),
            id=call.get("id"),
            name=(call.get("function") or {}).get("name"),
            arguments=(call.get("function") or {}).get("arguments") or "",
        )
        for i, call in enumerate(delta.get("tool_calls") or [])
    )
    return Step(text=text, calls=calls) if text or calls else None


def _message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
    return str(exc) or type(exc).__name__


def _error_kind(exc: BaseException) -> tuple[str | None, str | None]:
    body = getattr(exc, "body", None)
    error = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None, None
    return error.get("type"), error.get("code")


def remote_error(exc: BaseException, where: str) -> AgentSpecError:
    """agentspec's typed error for what the server (or the connection to it) did."""
    import openai

    if isinstance(exc, AgentSpecError):
        return exc
    message = _message(exc)
    if isinstance(exc, openai.APITimeoutError):
        return RequestTimeoutError(f"{where}: the server did not answer in time ({message}); raise `server_timeout` or lower `max_tokens`.")
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc
        return RemoteError(f"{where}: the connection to the server failed ({type(cause).__name__}: {cause}); is it running at this `base_url`?")
    status = getattr(exc, "status_code", None)
    kind, code = _error_kind(exc)
    if code == "context_length_exceeded":
        return ContextLengthError(f"{where}: {message}")
    if status == 429 or kind == "rate_limit_error":
        return EngineOverloadedError(f"{where}: the server is overloaded ({message}); retry later.")
    if status in (408, 504) or kind == "timeout_error":
        return RequestTimeoutError(f"{where}: {message}")
    if status in (401, 403) or kind == "authentication_error":
        return RemoteError(f"{where}: the server refused the API key ({message}); pass the server's key as `api_key` (or set {API_KEY_ENV}).", status=status)
    if status in (400, 404, 413, 422) or kind == "invalid_request_error":
        return InvalidRequestError(f"{where}: the server refused the request: {message}")
    if isinstance(exc, (ValueError, KeyError, TypeError)):  # a chunk that is not the format
        return RemoteError(f"{where}: the server sent a malformed chunk ({type(exc).__name__}: {exc}).")
    return RemoteError(f"{where}: the server failed the request: {message}", status=status)


class RemoteStream:
    """One request on the server: its HTTP response, read chunk by chunk."""

    def __init__(self, backend: "RemoteBackend", body: dict[str, Any], params: GenerationParams) -> None:
        self._backend = backend
        self._body = body
        self._params = params
        self._id = f"req_{uuid.uuid4().hex[:20]}"  # until the server's id is known
        self._response: Any = None
        self._chunks: Any = None
        self._deadline: float | None = None
        self._started = 0.0
        self._first: float | None = None
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._stats: SpecStats | None = None
        self._done = False
        self.cancelled = False  # the client was closed: the stream ends with finish_reason "cancelled"

    @property
    def request_id(self) -> str:
        return self._id

    def _remaining(self) -> float | None:
        if self._deadline is None:
            return None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeoutError(f"Request {self._id} ran past its timeout of {self._params.timeout} s; text streamed so far stands.")
        return left

    async def submit(self) -> None:
        if self.cancelled:
            raise ClientClosedError("This client is closed; create a new agentspec.Client.")
        self._started = time.monotonic()
        if self._params.timeout is not None:
            self._deadline = self._started + self._params.timeout
        named = {key: value for key, value in self._body.items() if key in SDK_PARAMETERS}
        extra = {key: value for key, value in self._body.items() if key not in SDK_PARAMETERS}
        try:
            async with asyncio.timeout(self._remaining()):
                self._response = await self._backend.api.chat.completions.create(**named, extra_body=extra or None)
        except TimeoutError:
            raise RequestTimeoutError(f"Request {self._id} ran past its timeout of {self._params.timeout} s before the server answered.") from None
        except Exception as exc:
            raise remote_error(exc, f"POST {self._backend.base_url}/chat/completions") from exc
        self._chunks = self._response.__aiter__()
        response = self._response
        loop = asyncio.get_running_loop()
        weakref.finalize(self, _close_soon, loop, response)  # a stream dropped without aclose() ends the request

    async def receive(self) -> Step:
        assert self._chunks is not None, "submit() first"
        while True:
            if self.cancelled:
                self._finish = "cancelled"
                return self._end()
            try:
                async with asyncio.timeout(self._remaining()):
                    chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                return self._end()
            except TimeoutError:
                await self.aclose()
                raise RequestTimeoutError(f"Request {self._id} ran past its timeout of {self._params.timeout} s; text streamed so far stands.") from None
            except Exception as exc:
                if self.cancelled or self._finish is not None:  # closed under us, or only the usage chunk was lost
                    self._finish = "cancelled" if self.cancelled else self._finish
                    return self._end()
                raise remote_error(exc, f"request {self._id}") from exc
            step = self._read(chunk.model_dump() if hasattr(chunk, "model_dump") else dict(chunk))
            if step is not None:
                return step

    def _read(self, chunk: dict[str, Any]) -> Step | None:
        if isinstance(chunk.get("id"), str) and chunk["id"]:
            self._id = chunk["id"]
        server = self._backend.name
        usage = chunk.get("usage")
        if isinstance(usage, dict) and _count(usage.get("completion_tokens")) is not None:
            self._usage = Usage(
                prompt_tokens=_count(usage.get("prompt_tokens")),
                completion_tokens=usage["completion_tokens"],
                total_tokens=_count(usage.get("total_tokens")),
            )
        stats = server_stats(server, chunk, self._usage.completion_tokens if self._usage else None)
        if stats is not None:
            self._stats = stats
        choices = chunk.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            self._finish = FINISH.get(choices[0]["finish_reason"], "stop")
        step = chunk_step(chunk)
        if step is not None and self._first is None:
            self._first = time.monotonic()
        return step

    def _end(self) -> Step:
        """The stream is over: the finishing step, with usage and statistics."""
        if self._done:
            raise RemoteError(f"request {self._id}: read past its end.")
        self._done = True
        if self._finish is None:
            raise RemoteError(f"request {self._id}: the server closed the stream before the reply finished; text streamed so far stands.")
        usage = self._usage
        stats = self._stats or _unknown_stats(usage.completion_tokens if usage else None)
        if stats.output_tokens is None and usage is not None:
            stats.output_tokens = usage.completion_tokens
        now = time.monotonic()
        if self._first is not None:
            stats.ttft_ms = (self._first - self._started) * 1e3
            count = stats.output_tokens
            stats.tpot_ms = None if count is None else ((now - self._first) * 1e3 / (count - 1) if count > 1 else 0.0)
        stats.derive()
        self._backend.record(stats, self._params.tag)
        return Step(finish_reason=self._finish, usage=usage or UNKNOWN_USAGE, stats=stats)

    async def aclose(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            await response.close()


def _close_soon(loop: asyncio.AbstractEventLoop, response: Any) -> None:
    """Close an HTTP response from any thread (a finalizer): the server sees the disconnect."""
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(lambda: loop.create_task(response.close()))


class RemoteBackend:
    """An OpenAI-compatible server as a backend."""

    def __init__(self, base_url: str, *, api_key: str | None, model: str | None, timeout: float) -> None:
        try:
            import openai
        except ImportError:
            raise ModelLoadError("`base_url` needs the openai package: pip install 'agentspec-llm[remote]'.") from None
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = "openai"  # the kind of server, known after start()
        key = api_key or os.environ.get(API_KEY_ENV) or "none"  # a server without a key ignores it
        self.api = openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=openai.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)))
        self._metrics = MetricsAggregator()
        self._streams: weakref.WeakSet[RemoteStream] = weakref.WeakSet()

    async def start(self) -> None:
        try:
            models = [model async for model in self.api.models.list()]
        except Exception as exc:
            error = remote_error(exc, f"GET {self.base_url}/models")
            raise ModelLoadError(f"The server at {self.base_url} cannot be used: {error}") from exc
        ids = [model.id for model in models]
        if not ids:
            raise ModelLoadError(f"The server at {self.base_url} lists no models; start it with a model.")
        if self.model is None:
            self.model = ids[0]
        elif self.model not in ids:
            raise ModelLoadError(f"The server at {self.base_url} does not serve {self.model!r}; it serves: {', '.join(ids)}.")
        owner = next(model for model in models if model.id == self.model).owned_by
        self.name = _server_kind(owner)

    async def aclose(self) -> None:
        """Running streams end with finish_reason "cancelled" (their responses closed: the server aborts them)."""
        streams = list(self._streams)
        for stream in streams:
            stream.cancelled = True
        await asyncio.gather(*(stream.aclose() for stream in streams), return_exceptions=True)
        await self.api.close()

    def open(self, request: Request) -> RemoteStream:
        assert self.model is not None, "start() first"
        stream = RemoteStream(self, request_body(request, model=self.model, server=self.name), request.params)
        self._streams.add(stream)
        return stream

    def record(self, stats: SpecStats, tag: str | None) -> None:
        self._metrics.add(stats, tag)

    def metrics(self, tag: str | None = None) -> SpecStats:
        return self._metrics.snapshot(tag)

    def metrics_text(self) -> str:
        return self._metrics.prometheus_text()
