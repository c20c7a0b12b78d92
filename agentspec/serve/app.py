"""The ASGI application: OpenAI-compatible routes over one shared, started ``Client``.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /metrics``
(the client's Prometheus text), ``GET /health``. With an API key, every route but ``/health`` needs
``Authorization: Bearer <key>``. Every error is an OpenAI error body (``wire.error_reply``).

A reply watches its connection while it decodes: when the caller disconnects — mid-stream, or while
waiting for a non-streamed reply — the reply is cancelled and its ``Stream`` closed, which stops
decoding of that request before its next engine step.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..client import Client, Stream
from ..errors import AgentSpecError, ClientClosedError
from ..types import Done
from .wire import HTTPError, MessageBuilder, ReplyShaper, error_reply, parse_chat_request, sse

__all__ = ["create_app", "MAX_BODY_BYTES"]

# A request is messages, tools and schemas for a model with a context window of a few thousand
# tokens: 4 MiB is far past any prompt the model can take, and bounds what one caller makes us buffer.
MAX_BODY_BYTES = 4 * 2**20
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


def create_app(client: Client, *, model_name: str, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The OpenAI-compatible application over ``client`` (started; the caller owns its lifetime),
    serving it as the model ``model_name``."""
    expected = api_key.encode() if api_key else None
    started = int(time.time())

    def authorize(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise HTTPError(
                401,
                "Missing or wrong API key: send `Authorization: Bearer <key>` with the key this server was started with.",
                kind="authentication_error",
                code="invalid_api_key",
            )

    async def json_body(request: Request) -> Any:
        too_large = HTTPError(413, f"The request body is over {max_body_bytes} bytes; send fewer or shorter messages.", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > max_body_bytes:
                raise too_large
        try:
            return json.loads(body)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
            raise HTTPError(400, f"The request body is not valid JSON ({exc}); send a JSON object.") from None

    async def chat_completions(request: Request) -> ChatReply:
        authorize(request)
        chat = parse_chat_request(await json_body(request), model=model_name)
        stream = client.stream(chat.messages, **chat.params)  # validates: InvalidRequestError → 400
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
        return PlainTextResponse(client.metrics_text() + pending, media_type="text/plain; version=0.0.4; charset=utf-8")

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
    return Starlette(routes=routes, exception_handlers=handlers)
