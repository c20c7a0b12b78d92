"""The ASGI application: OpenAI-compatible routes over one shared, started ``Client``.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /metrics``
(the client's Prometheus text), ``GET /health``. With an API key, every route but ``/health`` needs
``Authorization: Bearer <key>``. Every error is an OpenAI error body (``wire.error_reply``) whose
message agentspec wrote: it may quote the request, never a traceback or a library's text.

What a stranger can send is checked before any work, in this order: the ``Host`` header against an
allow-list (a web page that rebinds its DNS name to 127.0.0.1 still sends its own name: 403), the
key, a JSON ``Content-Type`` on a body (a cross-site form or ``text/plain`` POST needs none: 415),
the body's size (413) and the time its bytes take to arrive (408), then its nesting depth
(``Limits.max_json_depth``: 400) and the values it holds (``Limits.max_json_values``: 400), both read
from its text before it is parsed.

A reply watches its connection while it decodes: when the caller disconnects — mid-stream, or while
waiting for a non-streamed reply — the reply is cancelled and its ``Stream`` closed, which stops
decoding of that request before its next engine step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hashlib
import hmac
import json
import time
from typing import Any, Sequence

import anyio
import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..client import Client, Stream
from ..errors import AgentSpecError, ClientClosedError
from ..params import MAX_CACHE_SALT_CHARS
from ..types import Done
from .wire import ChatRequest, HTTPError, MessageBuilder, ReplyShaper, error_reply, parse_chat_request, sse

__all__ = ["create_app", "MAX_BODY_BYTES", "BODY_TIMEOUT_S", "LOOPBACK_HOSTS", "HostCheck", "LoopLag", "json_text_shape", "tenant_salt"]

# A request is messages, tools and schemas for a model with a context window of a few thousand
# tokens: 4 MiB is far past any prompt the model can take, and bounds what one caller makes us buffer.
MAX_BODY_BYTES = 4 * 2**20
# A body of 4 MiB arrives in well under a second on any network a model server sits on; a caller that
# trickles its bytes (or sends none after its headers) would otherwise hold a connection forever.
BODY_TIMEOUT_S = 30.0
# The names a browser on this machine uses for a loopback server; any other Host header on a loopback
# server is a DNS-rebinding page or a misdirected proxy.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# Requests parsed, validated, rendered and tokenized at once, off the event loop; more wait their turn
# (each is bounded: the body's size, Limits.max_json_depth, max_grammar_chars, template_timeout_s).
PREPARE_THREADS = 2
# After a body this large is parsed (and refused or queued), the allocator is asked to hand its free
# pages back to the system (glibc's malloc_trim): megabyte bodies parsed side by side otherwise leave
# the process tens of megabytes bigger for good, and a flood of them hundreds.
TRIM_AFTER_BYTES = 256 * 2**10
SHUTTING_DOWN = "The server is shutting down; retry on another instance or after it restarts."


def _error_response(exc: BaseException) -> JSONResponse:
    status, body = error_reply(exc)
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body, ensure_ascii=False).encode()})


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


try:
    _LIBC: Any = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # glibc only
except (OSError, AttributeError):
    _LIBC = None

# The JSON text scan reads a body this many bytes at a time: each numpy pass over a chunk runs
# without the GIL, the loop gets the GIL back between passes, and the scan's arrays stay small.
SCAN_CHUNK_BYTES = 256 * 2**10
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_BRACKET_STEP = np.zeros(256, dtype=np.int32)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1
_VALUE_BEFORE = np.zeros(256, dtype=np.int64)  # a value (or a key) follows each of these
_VALUE_BEFORE[[ord("["), ord("{"), ord(","), ord(":")]] = 1


def json_text_shape(body: bytes | bytearray) -> tuple[int, int]:
    """(depth, values) of the JSON text ``body`` (UTF-8): how deeply it nests lists and objects, and
    how many values it holds, keys included (every one but the first follows a ``[``, ``{``, ``,`` or
    ``:``; an empty list or object counts one more), both read from the bytes outside strings.

    Parsing is what this bounds: ``json.loads`` builds a Python object per value holding the GIL
    throughout (30 ms of CPU for a 1.4 MB body of 100,000 ``logit_bias`` entries on a 2-core Zen 4,
    and several times that in wall time on a busy machine: the event loop waits). This scan builds
    none: numpy passes over ``SCAN_CHUNK_BYTES`` at a time (quotes, the backslashes that escape
    them, a running parity for "inside a string", a running sum of brackets), each without the GIL.
    UTF-8 never uses an ASCII byte inside a multi-byte character, so bytes are read as they are. On
    text that is not JSON the answer means nothing; the parser refuses such text afterwards."""
    data = np.frombuffer(body, dtype=np.uint8)
    depth = deepest = 0
    values = 1
    inside = 0  # 1 while the scan is inside a string
    escaping = False  # the previous chunk ended in an odd run of backslashes
    for start in range(0, len(data), SCAN_CHUNK_BYTES):
        chunk = data[start : start + SCAN_CHUNK_BYTES]
        quote = chunk == _QUOTE
        backslash = chunk == _BACKSLASH
        if escaping or backslash.any():
            # run[i]: the backslashes ending at byte i (0 where it is none); a quote after an odd run is escaped
            position = np.arange(len(chunk), dtype=np.int32)
            run = position - np.maximum.accumulate(np.where(backslash, np.int32(-1), position))
            run[: int(np.argmin(backslash)) if not backslash.all() else len(chunk)] += escaping  # the run the last chunk began
            odd = (run & 1).astype(bool)
            quote[1:] &= ~odd[:-1]
            quote[0] &= not escaping
            escaping = bool(odd[-1])
        parity = (np.cumsum(quote, dtype=np.uint8) + inside) & 1  # uint8 wraps at 256: the parity stands
        structure = chunk[parity == 0]
        inside = int(parity[-1])
        values += int(_VALUE_BEFORE[structure].sum())
        levels = np.cumsum(_BRACKET_STEP[structure], dtype=np.int32) + depth
        if len(levels):
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
    return deepest, values


def trim_heap() -> None:
    """Return the allocator's free memory to the system, where the C library can (glibc)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def tenant_salt(key: bytes) -> str:
    """The cache salt of the tenant a key stands for: a hash, so the key itself is never kept with
    the caches (nor written to a log line that prints a request's parameters)."""
    return "tenant-" + hashlib.sha256(b"agentspec tenant\x00" + key).hexdigest()[:32]


def salted(tenant: str, own: Any) -> Any:
    """A tenant's request's cache salt: the tenant's, then the request's own (which partitions the
    tenant's caches further, never reaches another's). A malformed one is left for validation."""
    if own is None:
        return tenant
    return f"{tenant}/{own}"[:MAX_CACHE_SALT_CHARS] if isinstance(own, str) and own else own


def _host_name(host: str) -> str:
    """A ``Host`` header's name without its port, lower-case; IPv6 addresses keep their brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else (f"[{host}]" if ":" in host else host)


class LoopLag:
    """How late the event loop wakes a task that sleeps ``PERIOD_S`` at a time: the longest time some
    piece of work held the loop that serves every caller. ``watch`` runs as a task beside the server;
    ``/metrics`` shows the worst lateness and how many wake-ups were later than each bound."""

    PERIOD_S = 0.01
    BOUNDS_S = (0.05, 0.1, 0.25, 0.5, 1.0)

    def __init__(self) -> None:
        self.max_s = 0.0
        self.over = [0] * len(self.BOUNDS_S)

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.PERIOD_S)
            late = loop.time() - before - self.PERIOD_S
            self.max_s = max(self.max_s, late)
            for i, bound in enumerate(self.BOUNDS_S):
                if late > bound:
                    self.over[i] += 1

    def metrics_text(self) -> str:
        lines = [
            "# HELP agentspec_event_loop_lag_max_seconds The longest the server's event loop was held (a sleeping task woken late).",
            "# TYPE agentspec_event_loop_lag_max_seconds gauge",
            f"agentspec_event_loop_lag_max_seconds {self.max_s:.6f}",
            "# HELP agentspec_event_loop_stalls_total Wake-ups of the loop watcher later than the bound.",
            "# TYPE agentspec_event_loop_stalls_total counter",
        ]
        lines += [f'agentspec_event_loop_stalls_total{{over="{bound:g}"}} {n}' for bound, n in zip(self.BOUNDS_S, self.over)]
        return "\n".join(lines) + "\n"


class HostCheck:
    """ASGI middleware: answers 403 to any request whose ``Host`` header names a host not in
    ``allowed`` (names, IP addresses; ``"*"`` allows any). Ports are ignored; IPv6 addresses may be
    given with or without brackets. This is what stops DNS rebinding: a page on ``evil.example`` that
    points its name at 127.0.0.1 reaches the port, but its requests say ``Host: evil.example``."""

    def __init__(self, app: Any, allowed: Sequence[str]) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = frozenset(_host_name(name) for name in allowed if name != "*")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.any:
            host = next((value.decode("latin-1") for key, value in scope["headers"] if key == b"host"), "")
            if _host_name(host) not in self.allowed:
                shown = host[:100] or "(none)"
                error = HTTPError(
                    403,
                    f"The Host header {shown!r} is not one this server answers to; call it by one of its names "
                    f"({', '.join(sorted(self.allowed))}), or start it with `agentspec serve --allowed-host NAME`.",
                    kind="permission_error",
                    code="host_not_allowed",
                )
                await _send_json(send, *error_reply(error))
                return
        await self.app(scope, receive, send)


class ChatReply:
    """The ASGI response of one chat completion: submits the request, then streams its chunks as
    server-sent events or sends one ``chat.completion``. Errors before the first byte get their own
    status (an overloaded engine: 429); errors mid-stream are sent as an ``{"error": ...}`` event."""

    def __init__(self, stream: Stream, shaper: ReplyShaper, *, streaming: bool) -> None:
        self.stream = stream
        self.shaper = shaper
        self.streaming = streaming

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
            try:
                await self._reply(send)
            finally:
                await self.stream.aclose()  # stops decoding if it still runs (a disconnect, an error)
                group.cancel_scope.cancel()

    async def _reply(self, send: Send) -> None:
        try:
            await self.stream.__aenter__()  # submits now: a full queue is a 429, not a 200 then an error
        except AgentSpecError as exc:
            await _send_json(send, *error_reply(exc))
            return
        if self.streaming:
            await self._stream_chunks(send)
        else:
            await self._complete(send)

    async def _complete(self, send: Send) -> None:
        message = MessageBuilder()
        try:
            async for event in self.stream:
                message.add(event)
        except AgentSpecError as exc:
            await _send_json(send, *error_reply(exc))
            return
        done = message.done
        if done is None or done.finish_reason == "cancelled":  # the client was closed under us
            await _send_json(send, *error_reply(ClientClosedError(SHUTTING_DOWN)))
            return
        await _send_json(send, 200, self.shaper.completion(message.message(), done))

    async def _stream_chunks(self, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            async for event in self.stream:
                if isinstance(event, Done) and event.finish_reason == "cancelled":
                    raise ClientClosedError(SHUTTING_DOWN)
                for chunk in self.shaper.chunks(event):
                    await send({"type": "http.response.body", "body": sse(chunk), "more_body": True})
            tail = sse("[DONE]")
        except AgentSpecError as exc:  # what was streamed stands; the caller's client raises this
            tail = sse(error_reply(exc)[1])
        await send({"type": "http.response.body", "body": tail})


def create_app(
    client: Client,
    *,
    model_name: str,
    api_key: str | None = None,
    api_keys: Sequence[str] = (),
    share_caches: bool = False,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
    loop_lag: LoopLag | None = None,
) -> Any:
    """The OpenAI-compatible application over ``client`` (started; the caller owns its lifetime),
    serving it as the model ``model_name``, to requests whose ``Host`` is in ``allowed_hosts``
    (``["*"]``: any, e.g. behind a proxy that checks it).

    Keys (``api_key`` and ``api_keys``): each is a tenant. A tenant's requests reuse only its own
    cached prompts and draft only from its own earlier outputs (their ``cache_salt`` is the tenant's,
    followed by any the request sends), so ``cached_prompt_tokens`` and acceptance never reveal what
    another tenant sent or received; ``share_caches`` lets all keys share them (one tenant)."""
    keys = [key.encode() for key in dict.fromkeys([*([api_key] if api_key else []), *api_keys]) if key]
    tenants = [None if share_caches else tenant_salt(key) for key in keys]
    started = int(time.time())
    preparing = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="agentspec-prepare")
    max_depth, max_values = client.limits.max_json_depth, client.limits.max_json_values

    def authorize(request: Request) -> str | None:
        """The caller's tenant (its cache salt; None: no keys, or caches shared), or a 401."""
        if not keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        matches = [hmac.compare_digest(given, key) for key in keys]  # every key compared: the time tells no position
        if scheme.lower() != "bearer" or not any(matches):
            raise HTTPError(
                401,
                "Missing or wrong API key: send `Authorization: Bearer <key>` with the key this server was started with.",
                kind="authentication_error",
                code="invalid_api_key",
            )
        return tenants[matches.index(True)]

    async def json_body(request: Request) -> bytearray:
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise HTTPError(
                415,
                f"The request body must be sent as `Content-Type: application/json`, not {media_type or 'none'!r}.",
                code="unsupported_media_type",
            )
        too_large = HTTPError(413, f"The request body is over {max_body_bytes} bytes; send fewer or shorter messages.", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        body = bytearray()
        with anyio.move_on_after(body_timeout_s) as reading:
            async for piece in request.stream():
                body += piece
                if len(body) > max_body_bytes:
                    raise too_large
        if reading.cancelled_caught:
            raise HTTPError(408, f"The request body did not arrive within {body_timeout_s:g} s; send it at once.", code="request_timeout")
        return body

    def parse_body(body: bytearray) -> Any:
        """The body's JSON value; its depth and size are read from its text first (``json_text_shape``),
        so a body over ``Limits.max_json_depth`` or ``max_json_values`` is never parsed."""
        too_deep = HTTPError(
            400,
            f"The request body nests deeper than {max_depth} levels of lists and objects (Limits.max_json_depth; "
            "agentspec serve --max-json-depth); flatten the messages, tools or schema.",
            code="json_too_deep",
        )
        depth, values = json_text_shape(body)
        if depth > max_depth:
            raise too_deep
        if values > max_values:
            raise HTTPError(
                400,
                f"The request body holds over {max_values} JSON values, keys included (Limits.max_json_values; agentspec "
                "serve --max-json-values); send fewer messages, tools, enum values or logit_bias entries.",
                code="json_too_many_values",
            )
        try:
            text = body.decode("utf-8")  # JSON between systems is UTF-8 (RFC 8259)
        except UnicodeDecodeError:
            raise HTTPError(400, "The request body is not UTF-8 text; send a JSON object encoded as UTF-8.") from None
        try:
            return json.loads(text)
        except RecursionError:  # text that is not JSON, whose brackets the scan read otherwise than the parser
            raise too_deep from None
        except json.JSONDecodeError as exc:
            raise HTTPError(400, f"The request body is not valid JSON (line {exc.lineno}, column {exc.colno}); send a JSON object.") from None

    def prepare(body: bytearray, tenant: str | None) -> tuple[Stream, ChatRequest]:
        """Parse, validate, render and tokenize one request: work whose cost the caller decides, so it
        runs on the server's preparation threads (``client.stream`` bounds the template's time and the
        grammar's size), never on the event loop that serves every caller."""
        try:
            return prepared(body, tenant)
        finally:
            if len(body) > TRIM_AFTER_BYTES:
                del body
                trim_heap()

    def prepared(body: bytearray, tenant: str | None) -> tuple[Stream, ChatRequest]:
        chat = parse_chat_request(parse_body(body), model=model_name)
        if tenant is not None:
            chat.params["cache_salt"] = salted(tenant, chat.params.get("cache_salt"))
        return client.stream(chat.messages, **chat.params), chat  # validates: InvalidRequestError → 400

    async def chat_completions(request: Request) -> ChatReply:
        tenant = authorize(request)
        body = await json_body(request)
        future = asyncio.wrap_future(preparing.submit(prepare, body, tenant))
        stream, chat = await future
        return ChatReply(stream, ReplyShaper(model_name, include_usage=chat.include_usage), streaming=chat.stream)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "agentspec"}

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        authorize(request)
        asked = request.path_params["model"]
        if asked != model_name:
            raise HTTPError(404, f"The model {asked!r} does not exist here; this server serves {model_name!r}.", param="model", code="model_not_found")
        return JSONResponse(model_card())

    async def metrics(request: Request) -> Response:
        authorize(request)
        pending = (
            "# HELP agentspec_pending_requests Requests queued or decoding.\n"
            "# TYPE agentspec_pending_requests gauge\n"
            f"agentspec_pending_requests {client.pending_requests}\n"
        )
        lag = loop_lag.metrics_text() if loop_lag is not None else ""
        return PlainTextResponse(client.metrics_text() + pending + lag, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_name, "pending_requests": client.pending_requests})

    async def on_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):  # Starlette's own: an unknown route (404), a wrong method (405)
            return _error_response(HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}."))
        return _error_response(exc)  # ours and agentspec's; any other is a bug: a 500, and Starlette logs it

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {HTTPException: on_error, HTTPError: on_error, AgentSpecError: on_error, Exception: on_error}
    return HostCheck(Starlette(routes=routes, exception_handlers=handlers), allowed_hosts)
