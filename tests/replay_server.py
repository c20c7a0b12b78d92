"""An OpenAI-compatible replay server: chat completions answered from chunks recorded in the wire
formats of real servers, for testing ``Client(base_url=...)`` without a model.

    python tests/replay_server.py --port 0 [--api-key KEY]

prints ``replay server ready at http://127.0.0.1:PORT/v1`` once listening. The requested model id
picks the server whose format is replayed (``GET /v1/models`` tells it in ``owned_by``); the last
user message picks the scenario, e.g. ``"scenario:tool_call"`` (see ``SCENARIOS`` and ``ERRORS``).

=================  ==========================================================================
server             what its finishing chunks carry
=================  ==========================================================================
vllm               ``metrics.speculative_decoding`` (``--per-request-spec-decode-metrics``);
                   usage in a last chunk without choices (``stream_options.include_usage``)
sglang             the finishing choice's ``meta_info`` (``spec_verify_ct``, ...); usage chunk
llamacpp           ``timings`` (``draft_n``, ``draft_n_accepted``) on the last chunk; usage chunk
plain              nothing: no statistics, no usage chunk even when asked
=================  ==========================================================================

For the tests: ``GET /last_request`` is ``{"count": requests so far, "body": the last body}`` and
``GET /replies/{id}`` is a streamed reply's state: streaming, finished, failed or disconnected.
With ``--api-key`` every route needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from functools import partial
from typing import Any, AsyncIterator, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from agentspec.serve.run import AnnouncingServer

MODELS = {"vllm-model": "vllm", "sglang-model": "sglang", "llamacpp-model": "llamacpp", "plain-model": "someone-else"}
FORMATS = ("vllm", "sglang", "llamacpp")  # an owner not listed here gets the plain format

TEXT = ["Paris is", " the capital", " of France", "."]
JSON_TEXT = ['{"city": "Par', 'is", "sun', 'ny": true}']
CALLS = [("call_replay_0", "get_weather", ['{"city": ', '"Paris"', "}"]), ("call_replay_1", "get_weather", ['{"ci', 'ty": "Lyon"}'])]
BAD_CALLS = [("call_replay_bad", "get_weather", ['{"city": ', "42}"])]  # city must be a string
USAGE = {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26}
# Each server's speculation counts for a reply; different numbers per server, so a mix-up shows.
VLLM_SPEC = {"num_spec_steps": 3, "num_draft_tokens": 12, "num_accepted_draft_tokens": 7}
SGLANG_SPEC = {"spec_verify_ct": 4, "spec_accept_token_num": 3, "spec_draft_token_num": 8}
LLAMACPP_SPEC = {"draft_n": 10, "draft_n_accepted": 6}

FIRST_TOKEN_DELAY_S = 0.05  # before the first text: a lower bound for the client's TTFT
SLOW_S = 60.0  # "scenario:slow" stalls this long after its first chunk
LONG_CHUNKS, LONG_INTERVAL_S = 500, 0.02  # "scenario:long": ten seconds of text, for closing early
MID_STREAM_ERROR = "replay: the engine failed while decoding"

ERRORS = {  # scenario → (HTTP status, OpenAI error object)
    "fail_500": (500, {"message": "replay: the engine crashed", "type": "InternalServerError", "param": None, "code": 500}),
    "overloaded": (429, {"message": "replay: too many requests in flight", "type": "requests", "param": None, "code": "rate_limit_exceeded"}),
    "context_length": (400, {
        "message": "replay: this model's maximum context length is 2048 tokens, but the messages have 4100.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded",
    }),
}
DONE = "data: [DONE]\n\n"


class Reply:
    """The chunks of one streamed reply in one server's format."""

    def __init__(self, id: str, model: str, include_usage: bool) -> None:
        self.id, self.model = id, model
        self.format = MODELS[model] if MODELS[model] in FORMATS else "plain"
        self.include_usage = include_usage and self.format != "plain"
        self.created = int(time.time())

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [choice]}

    def opening(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": None if self.format == "llamacpp" else ""})

    def ending(self, finish: str) -> list[dict[str, Any]]:
        """The finishing chunk and the usage chunk, the statistics where this server puts them."""
        final = self.chunk({}, finish)
        usage = {**self.chunk({}), "choices": [], "usage": USAGE} if self.include_usage else None
        if self.format == "vllm":
            final["metrics"] = {"speculative_decoding": VLLM_SPEC}
        elif self.format == "sglang":
            tokens = {"prompt_tokens": USAGE["prompt_tokens"], "completion_tokens": USAGE["completion_tokens"]}
            final["choices"][0]["meta_info"] = {**tokens, **SGLANG_SPEC}
        elif self.format == "llamacpp":  # on the very last chunk
            timings = {"prompt_n": USAGE["prompt_tokens"], "prompt_ms": 9.5, "predicted_n": USAGE["completion_tokens"], "predicted_ms": 41.0}
            (usage or final)["timings"] = {**timings, **LLAMACPP_SPEC}
        return [final, usage] if usage else [final]


# -- scenarios: each yields chunks (dicts) or raw SSE text -------------------------------------------

async def text(reply: Reply, pieces: list[str] = TEXT) -> AsyncIterator[Any]:
    yield reply.opening()
    await asyncio.sleep(FIRST_TOKEN_DELAY_S)
    for piece in pieces:
        yield reply.chunk({"content": piece})
    for chunk in reply.ending("stop"):
        yield chunk
    yield DONE


async def tool_call(reply: Reply, calls: list = CALLS) -> AsyncIterator[Any]:
    """vLLM's shape: id, type and name in a call's first delta, then fragments of its arguments."""
    yield reply.opening()
    for index, (call_id, name, fragments) in enumerate(calls):
        yield reply.chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]})
        for fragment in fragments:
            yield reply.chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
    for chunk in reply.ending("tool_calls"):
        yield chunk
    yield DONE


async def beginning(reply: Reply, pieces: int) -> AsyncIterator[Any]:
    yield reply.opening()
    for piece in TEXT[:pieces]:
        yield reply.chunk({"content": piece})


async def error_event_mid_stream(reply: Reply) -> AsyncIterator[Any]:
    async for item in beginning(reply, 2):
        yield item
    yield {"error": {"message": MID_STREAM_ERROR, "type": "InternalServerError", "param": None, "code": 500}}
    yield DONE


async def drop_mid_stream(reply: Reply) -> AsyncIterator[Any]:
    async for item in beginning(reply, 2):
        yield item
    raise ConnectionAbortedError("replay: dropping the connection mid-stream")  # uvicorn closes it, body unfinished


async def truncated_sse(reply: Reply) -> AsyncIterator[Any]:
    async for item in beginning(reply, 2):
        yield item
    yield 'data: {"id": "' + reply.id + '", "object": "chat.completion.chunk", "choices": [{"ind'  # and the body ends


async def malformed_chunk(reply: Reply) -> AsyncIterator[Any]:
    async for item in beginning(reply, 1):
        yield item
    yield "data: {not json\n\n"
    yield DONE


async def slow(reply: Reply) -> AsyncIterator[Any]:
    async for item in beginning(reply, 1):
        yield item
    await asyncio.sleep(SLOW_S)
    for chunk in reply.ending("stop"):
        yield chunk
    yield DONE


async def long(reply: Reply) -> AsyncIterator[Any]:
    yield reply.opening()
    for i in range(LONG_CHUNKS):
        yield reply.chunk({"content": f" word{i}"})
        await asyncio.sleep(LONG_INTERVAL_S)
    for chunk in reply.ending("length"):
        yield chunk
    yield DONE


SCENARIOS: dict[str, Callable[[Reply], AsyncIterator[Any]]] = {
    "text": text, "json": partial(text, pieces=JSON_TEXT), "tool_call": tool_call, "bad_tool_call": partial(tool_call, calls=BAD_CALLS),
    "error_event_mid_stream": error_event_mid_stream, "drop_mid_stream": drop_mid_stream,
    "truncated_sse": truncated_sse, "malformed_chunk": malformed_chunk, "slow": slow, "long": long,
}


# -- the app ------------------------------------------------------------------------------------------

def _error(status: int, message: str, type: str, code: Any = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": code}}, status_code=status)


def _scenario(body: dict[str, Any]) -> str:
    users = [m for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    return content.removeprefix("scenario:") if isinstance(content, str) and content.startswith("scenario:") else ""


def create_app(api_key: str | None) -> Any:
    requests: dict[str, Any] = {"count": 0, "body": None}
    replies: dict[str, str] = {}

    async def models(request: Request) -> JSONResponse:
        data = [{"id": id, "object": "model", "created": 0, "owned_by": owner} for id, owner in MODELS.items()]
        return JSONResponse({"object": "list", "data": data})

    async def chat_completions(request: Request) -> Any:
        body = await request.json()
        requests["count"] += 1
        requests["body"] = body
        model, name = body.get("model"), _scenario(body)
        if model not in MODELS:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", 404)
        if name in ERRORS:
            status, error = ERRORS[name]
            return JSONResponse({"error": error}, status_code=status)
        if name not in SCENARIOS:
            return _error(400, f"Unknown scenario {name!r}; the last user message must be one of: scenario:{', scenario:'.join(SCENARIOS)}.", "BadRequestError", 400)
        reply = Reply(f"chatcmpl-replay-{requests['count']}", model, bool((body.get("stream_options") or {}).get("include_usage")))
        return StreamingResponse(_replay(SCENARIOS[name](reply), reply.id, replies), media_type="text/event-stream")

    async def last_request(request: Request) -> JSONResponse:
        return JSONResponse(requests)

    async def reply_state(request: Request) -> JSONResponse:
        id = request.path_params["id"]
        return JSONResponse({"id": id, "state": replies.get(id)}, status_code=200 if id in replies else 404)

    routes = [
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/last_request", last_request),
        Route("/replies/{id}", reply_state),
    ]
    app = Starlette(routes=routes)
    return RequireKey(app, api_key) if api_key else app


async def _replay(items: AsyncIterator[Any], id: str, replies: dict[str, str]) -> AsyncIterator[str]:
    """The scenario's items as SSE text, noting how the reply ended (a disconnect cancels it)."""
    replies[id] = "streaming"
    try:
        async for item in items:
            yield item if isinstance(item, str) else f"data: {json.dumps(item)}\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        replies[id] = "disconnected"
        raise
    except Exception:
        replies[id] = "failed"
        raise
    replies[id] = "finished"


class RequireKey:
    """ASGI middleware: every route needs ``Authorization: Bearer <key>`` (401, OpenAI's error body)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
            refused = _error(401, "replay: incorrect API key provided.", "invalid_request_error", "invalid_api_key")
            return await refused(scope, receive, send)
        await self.app(scope, receive, send)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (the ready line names it)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route")
    args = parser.parse_args()
    config = uvicorn.Config(create_app(args.api_key), host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=2)
    asyncio.run(AnnouncingServer(config, "replay server ready at {url}").serve())


if __name__ == "__main__":
    main()
