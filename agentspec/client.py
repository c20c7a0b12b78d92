"""The asyncio client: ``Client`` and its per-request ``Stream``.

A client validates requests and turns what its backend returns into events; the backend runs them:
the embedded engine (``LocalBackend``), or with ``base_url`` an OpenAI-compatible server
(``RemoteBackend``: ``agentspec serve``, vLLM, SGLang, llama.cpp's server). Either way a caller sees
the same ``TextDelta``/``ToolCallDelta``/``ToolCall``/``Done`` events and the same typed errors.

Lifecycle of a client: NEW → (start) → RUNNING → (aclose) → CLOSED. A stream submits its request on
first use and always cleans up: ``aclose()``, leaving ``async with``, breaking out of ``async for``
(the stream is dropped and its finalizer cancels it), or cancelling the consuming task all stop
decoding of that request before its next engine step (a remote request: its connection is closed,
which makes the server abort it).
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections import deque
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from .backends.base import Backend, BackendStream, Request, Step
from .backends.local import LocalBackend
from .drafting.sources import DraftSources, check_draft_reference
from .engine import Engine
from .errors import ClientClosedError, EngineError, InvalidRequestError, UnsupportedFeatureError
from .model import DTYPES, LoadedModel
from .params import GenerationParams, check_json_depth, parse_params
from .passes.weights import WEIGHTS
from .structured.tools import CallAssembler, ToolCallParser
from .types import Completion, Done, Limits, SpecConfig, SpecStats, TextDelta, ToolCall, ToolCallDelta, Usage

__all__ = ["Client", "Stream"]

T = TypeVar("T")

class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class Stream:
    """Verified events of one request: an async iterator and an async context manager."""

    def __init__(self, request: BackendStream, params: GenerationParams) -> None:
        self._request = request
        self.params = params  # the request's validated parameters (``response_model``: Completion.parsed)
        self._events: deque[Any] = deque()
        self._state = _State.NEW
        self._token_ids: list[int] = []
        self._call: ToolCallParser | None = None  # the engine's call text (a step says whether it writes a call)
        self._assembler = CallAssembler(params.tools)  # a server's structured calls

    async def _submit(self) -> None:
        self._state = _State.RUNNING
        try:
            await self._request.submit()
        except BaseException:
            self._state = _State.CLOSED
            await self._request.aclose()
            raise

    async def __aenter__(self) -> "Stream":
        if self._state is _State.NEW:
            await self._submit()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def __aiter__(self) -> "Stream":
        return self

    @property
    def request_id(self) -> str:
        """This request's id, as in agentspec's log lines (a remote request: the server's id once known)."""
        return self._request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The output token ids received so far (empty from a server that does not report ids)."""
        return list(self._token_ids)

    async def __anext__(self) -> TextDelta | ToolCallDelta | ToolCall | Done:
        if self._state is _State.NEW:
            await self._submit()
        while not self._events:
            if self._state is _State.CLOSED:
                raise StopAsyncIteration
            try:
                step = await self._request.receive()
            except BaseException:  # a failed request, or a cancelled consumer: stop decoding, then propagate
                await self.aclose()
                raise
            self._events.extend(self._to_events(step))
        return self._events.popleft()

    def _to_events(self, step: Step) -> list[TextDelta | ToolCallDelta | ToolCall | Done]:
        events: list[TextDelta | ToolCallDelta | ToolCall | Done] = []
        self._token_ids.extend(step.token_ids)
        if step.is_call and self._call is None:
            self._call = ToolCallParser()
        if self._call is not None:
            events.extend(self._call.feed(step.text))
        elif step.text or step.token_ids:
            events.append(TextDelta(text=step.text, token_ids=list(step.token_ids)))
        for fragment in step.calls:
            events.extend(self._assembler.feed(fragment.index, fragment.id, fragment.name, fragment.arguments))
        finish = step.finish_reason
        if finish is not None:
            if self._call is not None and finish == "stop":  # the last call is complete
                events.extend(self._call.finish())
                finish = "tool_calls"
            if self._assembler.calls and finish in ("stop", "tool_calls"):
                try:
                    events.extend(self._assembler.finish())
                except ValueError as exc:
                    self._state = _State.CLOSED
                    raise EngineError(f"The server's reply is not a valid tool call: {exc}.") from None
                finish = "tool_calls"
            events.append(Done(finish_reason=finish, usage=step.usage or Usage(), stats=step.stats or SpecStats()))
            self._state = _State.CLOSED
        return events

    async def aclose(self) -> None:
        """Stop decoding this request (idempotent). Events not yet read are dropped."""
        self._state = _State.CLOSED
        self._events.clear()
        await self._request.aclose()


def _parse(response_model: Any, text: str) -> Any:
    """The pydantic instance of a structured response; None if it was cut short (e.g. max_tokens)."""
    if response_model is None:
        return None
    try:
        return response_model.model_validate_json(text)
    except ValueError:
        return None


def _check_model_options(model: Any, device: Any, dtype: Any, weights: Any) -> None:
    """Reject a malformed model reference, device, dtype or weights before anything loads (their existence is
    checked by loading: a missing file or an absent GPU is a ModelLoadError from ``start``)."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InvalidRequestError(f"`model` must be None, a path or a hub id string, got {model!r}.")
    if device != "auto":
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise InvalidRequestError(f"Unknown `device` {device!r}; use 'auto', 'cpu' or 'cuda[:N]'.") from None
    if not (isinstance(dtype, torch.dtype) or (isinstance(dtype, str) and (dtype == "auto" or dtype in DTYPES))):
        raise InvalidRequestError(f"Unknown `dtype` {dtype!r}; use 'auto', one of {', '.join(DTYPES)}, or a torch.dtype.")
    if weights not in WEIGHTS:
        raise InvalidRequestError(f"Unknown `weights` {weights!r}; use one of {', '.join(map(repr, WEIGHTS))}.")


def _check_remote_options(base_url: Any, api_key: Any, server_timeout: Any, local: dict[str, Any]) -> None:
    """Reject a malformed server address, key or timeout, and local-engine options (``local``: name →
    (value, default)) given with ``base_url``, before anything connects."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"`base_url` must be an http(s) URL such as 'http://127.0.0.1:8000/v1', got {base_url!r}.")
    if api_key is not None and not isinstance(api_key, str):
        raise InvalidRequestError(f"`api_key` must be a string, got {type(api_key).__name__}.")
    if isinstance(server_timeout, bool) or not isinstance(server_timeout, (int, float)) or not server_timeout > 0:
        raise InvalidRequestError(f"`server_timeout` must be a positive number of seconds, got {server_timeout!r}.")
    given = [name for name, (value, default) in local.items() if value != default]
    if given:
        raise InvalidRequestError(
            f"{', '.join(f'`{name}`' for name in given)} configure a local engine; with `base_url` the server has its own. "
            "Drop them, or drop `base_url` to run the model in this process."
        )


class Client:
    """A model with lossless speculative decoding: embedded, or on an OpenAI-compatible server.

    >>> async with agentspec.Client() as client:                      # doctest: +SKIP
    ...     async for ev in client.stream([{"role": "user", "content": "Hi"}], max_tokens=32):
    ...         print(ev)

    ``Client(base_url="http://host:8000/v1", api_key=..., model=...)`` sends the same requests to a
    server (``agentspec serve``, vLLM, SGLang, llama.cpp's server); ``model`` is then the server's
    model id (default: the first it lists). ``server_timeout`` bounds each wait for the server.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        server_timeout: float = 600.0,
        draft: Any = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        weights: str = "auto",
        spec: SpecConfig = SpecConfig(),
        limits: Limits = Limits(),
    ) -> None:
        if not isinstance(spec, SpecConfig):
            raise InvalidRequestError(f"`spec` must be an agentspec.SpecConfig, got {type(spec).__name__}.")
        if not isinstance(limits, Limits):
            raise InvalidRequestError(f"`limits` must be an agentspec.Limits, got {type(limits).__name__}.")
        self.backend: Backend
        if base_url is not None:
            local = {"draft": (draft, None), "device": (device, "auto"), "dtype": (dtype, "auto"), "weights": (weights, "auto"), "limits": (limits, Limits())}
            _check_remote_options(base_url, api_key, server_timeout, local)
            if model is not None and not isinstance(model, str):
                raise InvalidRequestError(f"With `base_url`, `model` is the server's model id (a string), got {model!r}.")
            from .backends.remote import RemoteBackend  # needs the `openai` package (the remote extra)

            self.backend = RemoteBackend(base_url, api_key=api_key, model=model, timeout=float(server_timeout))
        else:
            _check_model_options(model, device, dtype, weights)
            check_draft_reference(draft)
            self.backend = LocalBackend(model, draft=draft, device=device, dtype=dtype, weights=weights, spec=spec, limits=limits)
        self.limits = limits
        self.model_ref = model
        self.base_url = base_url
        self.draft = draft
        self.device = device
        self.dtype = dtype
        self.weights = weights  # the target pass: "auto" (fastest measured), "eager", "onednn", "fused"; "bf16" (rounded weights)
        self.spec = spec
        self._state = _State.NEW
        self._start_lock = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> "Client":
        """Local: load the model (off the event loop), measure verification costs, start the worker.
        Remote: check that the server answers, accepts the key and serves the model."""
        async with self._start_lock:  # concurrent start() calls load once
            if self._state is _State.NEW:
                await self.backend.start()
                if self._state is _State.CLOSED:  # aclose() was called while loading
                    await self.backend.aclose()
                else:
                    self._state = _State.RUNNING
        if self._state is _State.CLOSED:
            raise ClientClosedError("This client is closed; create a new agentspec.Client.")
        return self

    async def aclose(self) -> None:
        """Cancel running streams (they end with finish_reason 'cancelled') and stop. Idempotent."""
        running, self._state = self._state is _State.RUNNING, _State.CLOSED
        if running:
            await self.backend.aclose()

    async def __aenter__(self) -> "Client":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def _require_running(self) -> None:
        if self._state is _State.NEW:
            raise ClientClosedError("The client is not started; use `async with agentspec.Client() as client` or `await client.start()`.")
        if self._state is _State.CLOSED:
            raise ClientClosedError("This client is closed; create a new agentspec.Client.")

    def _local(self, what: str) -> LocalBackend:
        self._require_running()
        if not isinstance(self.backend, LocalBackend):
            raise UnsupportedFeatureError(f"`{what}` is about the embedded engine; a client with `base_url` has none (the server runs the model).")
        assert self.backend.runtime is not None
        return self.backend

    # -- the embedded engine (local clients) --------------------------------------------------------

    async def run_on_worker(self, fn: Callable[[], T]) -> T:
        """Run blocking torch code on the engine's thread, between steps (e.g. a baseline to compare)."""
        runtime = self._local("run_on_worker").runtime
        assert runtime is not None
        return await asyncio.wrap_future(runtime.call(fn))

    @property
    def loaded(self) -> LoadedModel:
        loaded = self._local("loaded").loaded
        assert loaded is not None
        return loaded

    @property
    def engine(self) -> Engine:
        """The engine that decodes this client's requests (diagnostics, benchmarks, tests). It runs on
        the worker thread: call into it through ``run_on_worker``, or read it while no request runs."""
        runtime = self._local("engine").runtime
        assert runtime is not None and runtime.engine is not None
        return runtime.engine

    @property
    def draft_sources(self) -> DraftSources:
        """The client-wide draft sources (the suffix cache of earlier outputs, the draft model)."""
        sources = self._local("draft_sources").sources
        assert sources is not None
        return sources

    @property
    def pending_requests(self) -> int:
        """Requests submitted and not yet finished (queued or decoding)."""
        runtime = self._local("pending_requests").runtime
        assert runtime is not None
        return runtime.running

    async def clear_caches(self) -> None:
        """Forget earlier requests: the prefix cache's keys/values and the suffix cache's outputs
        (benchmarks that repeat a request use it so it is not replayed). Runs between engine steps."""
        engine, sources = self.engine, self.draft_sources

        def clear() -> None:
            if engine.prefix_cache is not None:
                engine.prefix_cache.clear()
            sources.clear_suffixes()

        await self.run_on_worker(clear)

    # -- requests ----------------------------------------------------------------------------------

    def stream(self, messages: Any, **params: Any) -> Stream:
        """Validate the request now (raising ``InvalidRequestError``) and return its event stream."""
        self._require_running()
        check_json_depth("messages", messages, self.limits.max_json_depth)
        limits = self.limits
        generation = parse_params(params, default_spec=self.spec, max_json_depth=limits.max_json_depth, max_grammar_chars=limits.max_grammar_chars)
        return Stream(self.backend.open(Request(messages, generation, params)), generation)

    async def generate(self, messages: Any, **params: Any) -> Completion:
        """Run a request to completion and collect its events."""
        text: list[str] = []
        tool_calls: list[ToolCall] = []
        stream = self.stream(messages, **params)
        async with stream:
            async for event in stream:
                if isinstance(event, TextDelta):
                    text.append(event.text)
                elif isinstance(event, ToolCall):
                    tool_calls.append(event)
                elif isinstance(event, Done):
                    return Completion(
                        text="".join(text),
                        parsed=_parse(stream.params.response_model, "".join(text)),
                        tool_calls=tool_calls,
                        token_ids=stream.token_ids,
                        finish_reason=event.finish_reason,
                        usage=event.usage,
                        stats=event.stats,
                    )
        raise ClientClosedError("The stream ended without finishing; was the client closed?")

    # -- observability -----------------------------------------------------------------------------

    def metrics(self, tag: str | None = None) -> SpecStats:
        """Speculation statistics summed over every finished request of this client, or over the
        requests sent with ``tag=tag``."""
        return self.backend.metrics(tag)

    def metrics_text(self) -> str:
        """``metrics()`` in Prometheus text exposition format, with per-tag series."""
        return self.backend.metrics_text()
