"""The asyncio client: ``Client`` and its per-request ``Stream``.

Lifecycle of a client: NEW → (start) → RUNNING → (aclose) → CLOSED. Model loading and calibration
run on a worker thread, never on the event loop. A stream submits its request on first use and
always cleans up: ``aclose()``, leaving ``async with``, breaking out of ``async for`` (the stream is
dropped and its finalizer cancels it), or cancelling the consuming task all stop decoding of that
request before its next engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import logging
import os
import random
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable, TypeVar

import anyio
import torch

from .drafting.base import common_prefix
from .drafting.sources import DraftSources, check_draft_reference
from .engine import Engine, Sequence, StepOutput
from .errors import ClientClosedError, ContextLengthError, InvalidRequestError
from .metrics import MetricsAggregator, log_request
from .model import DTYPES, LoadedModel, load_model
from .structured.grammar import AutoCallGrammar, Grammar, RepeatedGrammar, schema_regex
from .params import GenerationParams, parse_params
from .engine.prefix import PrefixCache
from .engine.weights import WEIGHTS
from .runtime import Channel, RequestHandle, Runtime
from .structured.tools import ToolCallParser, with_tool_prompt
from .types import Completion, Done, Limits, SpecConfig, SpecStats, TextDelta, ToolCall, ToolCallDelta, Usage

__all__ = ["Client", "Stream"]

log = logging.getLogger("agentspec.client")

T = TypeVar("T")


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class Stream:
    """Verified events of one request: an async iterator and an async context manager."""

    def __init__(self, runtime: Runtime, seq: Sequence, grammar: Callable[[], Any] | None = None) -> None:
        self._runtime = runtime
        self._seq = seq
        self._grammar = grammar  # builds the request's grammar (seconds for a big schema: off the loop)
        self._handle: RequestHandle | None = None
        self._events: deque[Any] = deque()
        self._state = _State.NEW
        mode = seq.params.tool_mode
        # "auto" stays undecided (None) until the first token: the opening of a call, or text.
        self._call: ToolCallParser | None = ToolCallParser() if mode == "forced" else None
        self._decided = mode != "auto"

    async def _submit(self) -> RequestHandle:
        if self._grammar is not None:
            build, self._grammar = self._grammar, None
            self._seq.grammar = await anyio.to_thread.run_sync(build)  # outlines_core releases the GIL
        channel = Channel(asyncio.get_running_loop())
        self._seq.submitted_at = time.perf_counter()  # a `timeout` counts from here
        handle = RequestHandle(self._seq, channel, self._runtime)
        self._runtime.submit(handle)
        self._handle = handle
        self._state = _State.RUNNING
        weakref.finalize(self, handle.cancel)  # a stream dropped without aclose() frees the engine
        return handle

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
        """This request's id, as in agentspec's log lines."""
        return self._seq.request_id

    async def __anext__(self) -> TextDelta | ToolCallDelta | ToolCall | Done:
        if self._state is _State.NEW:
            await self._submit()
        while not self._events:
            if self._state is _State.CLOSED:
                raise StopAsyncIteration
            assert self._handle is not None
            try:
                item = await self._handle.channel.receive()
            except BaseException:  # cancelled consumer: stop decoding, then propagate
                await self.aclose()
                raise
            if isinstance(item, BaseException):
                self._state = _State.CLOSED
                raise item
            self._events.extend(self._to_events(item))
        return self._events.popleft()

    def _to_events(self, output: StepOutput) -> list[TextDelta | ToolCallDelta | ToolCall | Done]:
        events: list[TextDelta | ToolCallDelta | ToolCall | Done] = []
        if not self._decided and output.token_ids:
            self._call = ToolCallParser() if output.is_call else None
            self._decided = True
        if self._call is not None:
            events.extend(self._call.feed(output.text))
        elif output.text or output.token_ids:
            events.append(TextDelta(text=output.text, token_ids=output.token_ids))
        finish = output.finish_reason
        if finish is not None:
            if self._call is not None and finish == "stop":  # the last call is complete
                events.extend(self._call.finish())
                finish = "tool_calls"
            seq = self._seq  # the worker has released it: reading is safe
            prompt, completion = len(seq.prompt_ids), seq.generated
            usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            events.append(Done(finish_reason=finish, usage=usage, stats=seq.stats.model_copy(deep=True)))
            self._state = _State.CLOSED
        return events

    async def aclose(self) -> None:
        """Stop decoding this request (idempotent). Events not yet read are dropped."""
        if self._handle is not None:
            self._handle.cancel()
        self._state = _State.CLOSED
        self._events.clear()


def _parse(response_model: Any, text: str) -> Any:
    """The pydantic instance of a structured response; None if it was cut short (e.g. max_tokens)."""
    if response_model is None:
        return None
    try:
        return response_model.model_validate_json(text)
    except ValueError:
        return None


def _grammar_builder(loaded: LoadedModel, params: GenerationParams) -> Callable[[], Any] | None:
    """Validate the request's schema now (raising InvalidRequestError); build its index later."""
    if params.schema is None:
        return None
    compiler = loaded.grammars
    regex = schema_regex(params.schema, strict=params.tool_mode == "off")  # tools: checked per tool by parse_tools

    def build() -> Grammar | RepeatedGrammar | AutoCallGrammar:
        grammar = compiler.compile(params.schema, regex=regex)
        if params.tool_mode == "off":
            return grammar
        calls = RepeatedGrammar(grammar) if params.parallel_tool_calls else grammar
        return AutoCallGrammar(calls) if params.tool_mode == "auto" else calls

    return build


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


class Client:
    """An embedded model with lossless speculative decoding.

    >>> async with agentspec.Client() as client:                      # doctest: +SKIP
    ...     async for ev in client.stream([{"role": "user", "content": "Hi"}], max_tokens=32):
    ...         print(ev)
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        draft: Any = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        weights: str = "auto",
        spec: SpecConfig = SpecConfig(),
        limits: Limits = Limits(),
    ) -> None:
        _check_model_options(model, device, dtype, weights)
        check_draft_reference(draft)
        if not isinstance(spec, SpecConfig):
            raise InvalidRequestError(f"`spec` must be an agentspec.SpecConfig, got {type(spec).__name__}.")
        if not isinstance(limits, Limits):
            raise InvalidRequestError(f"`limits` must be an agentspec.Limits, got {type(limits).__name__}.")
        self.limits = limits
        self.model_ref = model
        self.draft = draft
        self._sources: DraftSources | None = None
        self.device = device
        self.dtype = dtype
        self.weights = weights  # the target pass's linear kernels: "auto" (fastest measured), "eager", "onednn"
        self.spec = spec
        self._state = _State.NEW
        self._loaded: LoadedModel | None = None
        self._runtime: Runtime | None = None
        self._metrics = MetricsAggregator()
        self._shadow_rng = random.Random()
        self._start_lock = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> "Client":
        """Load the model (off the event loop), measure verification costs, start the worker."""
        async with self._start_lock:  # concurrent start() calls load once
            if self._state is _State.NEW:
                await self._start()
        if self._state is _State.CLOSED:
            raise ClientClosedError("This client is closed; create a new agentspec.Client.")
        return self

    async def _start(self) -> None:
        limits = self.limits
        runtime = Runtime(limits=limits, on_finished=self._finished)
        runtime.start()

        def set_up() -> LoadedModel:  # on the worker thread, which runs all of this client's torch work
            loaded = load_model(self.model_ref, device=self.device, dtype=self.dtype)
            engine = Engine(
                loaded,
                max_draft_tokens=max(SpecConfig().max_draft_tokens, self.spec.max_draft_tokens),
                prefix_cache=PrefixCache(int(limits.prefix_cache_mb * 2**20)) if limits.prefix_cache_mb else None,
                weights=self.weights,
            )
            self._sources = DraftSources(loaded, self.draft, engine.costs, device=self.device, dtype=self.dtype)
            engine.drafter_factory = self._sources.drafter
            engine.calibrate()
            runtime.engine = engine
            return loaded

        try:
            loaded = await asyncio.wrap_future(runtime.call(set_up))
        except BaseException:
            runtime.stop(timeout=0)  # the worker exits after the job in flight; never block the loop
            raise
        if self._state is _State.CLOSED:  # aclose() was called while loading
            runtime.stop(timeout=0)
            return
        self._loaded, self._runtime, self._state = loaded, runtime, _State.RUNNING

    async def run_on_worker(self, fn: Callable[[], T]) -> T:
        """Run blocking torch code on the engine's thread, between steps (e.g. a baseline to compare)."""
        return await asyncio.wrap_future(self._require_running().call(fn))

    async def aclose(self) -> None:
        """Cancel running streams (they end with finish_reason 'cancelled') and stop. Idempotent."""
        runtime, self._runtime, self._state = self._runtime, None, _State.CLOSED
        if runtime is not None:
            await anyio.to_thread.run_sync(runtime.stop, abandon_on_cancel=True)

    async def __aenter__(self) -> "Client":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    @property
    def loaded(self) -> LoadedModel:
        self._require_running()
        assert self._loaded is not None
        return self._loaded

    @property
    def engine(self) -> Engine:
        """The engine that decodes this client's requests (diagnostics, benchmarks, tests). It runs on
        the worker thread: call into it through ``run_on_worker``, or read it while no request runs."""
        engine = self._require_running().engine
        assert engine is not None
        return engine

    @property
    def draft_sources(self) -> DraftSources:
        """The client-wide draft sources (the suffix cache of earlier outputs, the draft model)."""
        self._require_running()
        assert self._sources is not None
        return self._sources

    @property
    def pending_requests(self) -> int:
        """Requests submitted and not yet finished (queued or decoding)."""
        return self._require_running().running

    async def clear_caches(self) -> None:
        """Forget earlier requests: the prefix cache's keys/values and the suffix cache's outputs
        (benchmarks that repeat a request use it so it is not replayed). Runs between engine steps."""
        engine, sources = self.engine, self.draft_sources

        def clear() -> None:
            if engine.prefix_cache is not None:
                engine.prefix_cache.clear()
            sources.suffixes.clear()

        await self.run_on_worker(clear)

    def _require_running(self) -> Runtime:
        if self._state is _State.NEW:
            raise ClientClosedError("The client is not started; use `async with agentspec.Client() as client` or `await client.start()`.")
        if self._state is _State.CLOSED or self._runtime is None:
            raise ClientClosedError("This client is closed; create a new agentspec.Client.")
        return self._runtime

    # -- requests ----------------------------------------------------------------------------------

    def stream(self, messages: Any, **params: Any) -> Stream:
        """Validate the request now (raising ``InvalidRequestError``) and return its event stream."""
        runtime = self._require_running()
        generation = parse_params(params, default_spec=self.spec)
        loaded = self.loaded
        if generation.tools:
            messages = with_tool_prompt(messages, list(generation.tools))
        prompt_ids = loaded.chat.encode(messages)
        room = loaded.context_window - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"The prompt is {len(prompt_ids)} tokens but the model's context window is {loaded.context_window}; "
                "shorten the messages (drop old turns or trim documents)."
            )
        max_new = min(generation.max_tokens or room, room)
        grammar = _grammar_builder(loaded, generation)
        return Stream(runtime, Sequence(prompt_ids, generation, max_new_tokens=max_new), grammar)

    async def generate(self, messages: Any, **params: Any) -> Completion:
        """Run a request to completion and collect its events."""
        text: list[str] = []
        tool_calls: list[ToolCall] = []
        stream = self.stream(messages, **params)
        response_model = stream._seq.params.response_model
        async with stream:
            async for event in stream:
                if isinstance(event, TextDelta):
                    text.append(event.text)
                elif isinstance(event, ToolCall):
                    tool_calls.append(event)
                elif isinstance(event, Done):
                    return Completion(
                        text="".join(text),
                        parsed=_parse(response_model, "".join(text)),
                        tool_calls=tool_calls,
                        token_ids=list(stream._seq.output_ids),
                        finish_reason=event.finish_reason,
                        usage=event.usage,
                        stats=event.stats,
                    )
        raise ClientClosedError("The stream ended without finishing; was the client closed?")

    # -- observability -----------------------------------------------------------------------------

    def metrics(self, tag: str | None = None) -> SpecStats:
        """Speculation statistics summed over every finished request of this client, or over the
        requests sent with ``tag=tag``."""
        return self._metrics.snapshot(tag)

    def metrics_text(self) -> str:
        """``metrics()`` in Prometheus text exposition format, with per-tag series."""
        return self._metrics.prometheus_text()

    def _finished(self, seq: Sequence) -> None:
        """Worker thread: a request ended. Count it, log it, maybe schedule its shadow check."""
        self._metrics.add(seq.stats, seq.params.tag)
        log_request(seq)
        completed = seq.finish_reason in ("stop", "length")  # not cancelled, not failed
        if self._sources is not None and completed and seq.output_ids:
            self._sources.finished(seq.output_ids)
        spec = seq.params.spec
        if (
            completed
            and spec.shadow_rate > 0
            and spec.speculates
            and self._shadow_rng.random() < spec.shadow_rate
            and self._runtime is not None
        ):
            plain = dataclasses.replace(seq.params, spec=spec.model_copy(update={"enabled": False}))
            shadow = Sequence(seq.prompt_ids, plain, max_new_tokens=seq.max_new_tokens, grammar=seq.grammar)
            self._runtime.shadow(shadow, functools.partial(self._compare, seq))

    def _compare(self, original: Sequence, shadow: Sequence) -> None:
        same = shadow.tokens == original.tokens
        self._metrics.add_shadow(same, original.params.tag)
        if not same:
            at = common_prefix(original.output_ids, shadow.output_ids)
            log.error(
                "quality_diff: request %s differs from its plain decoding (first at output token %s); "
                "speculation must be lossless, please report this",
                original.request_id,
                at,
            )
