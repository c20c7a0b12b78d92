"""The embedded backend: one model, one engine, its draft sources and the worker thread that runs
every target pass. Model loading and calibration run on the worker, never on the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import anyio

from ..drafting.base import common_prefix
from ..drafting.sources import DraftSources
from ..engine import Engine, Sequence, StepOutput
from ..engine.prefix import PrefixCache
from ..errors import ContextLengthError
from ..metrics import MetricsAggregator, log_request
from ..model import LoadedModel, load_model
from ..params import GenerationParams
from ..runtime import Channel, RequestHandle, Runtime
from ..structured.formats import CallListGrammar, CallTranscriber, call_grammar, call_regex
from ..structured.grammar import Grammar, RepeatedGrammar, schema_regex
from ..structured.triggers import AutoCallGrammar
from ..structured.tools import schema_tool_names
from ..types import Limits, SpecConfig, SpecStats, Usage
from .base import Request, Step

__all__ = ["LocalBackend", "LocalStream"]

log = logging.getLogger("agentspec.client")


def _grammar_builder(loaded: LoadedModel, params: GenerationParams) -> Callable[[], Any] | None:
    """Validate the request's schema now (raising InvalidRequestError); build its index later."""
    if params.schema is None:
        return None
    compiler = loaded.grammars
    fmt = loaded.chat.tool_format if params.tool_mode != "off" else None
    names = schema_tool_names(params.schema) if params.tool_mode != "off" else set()
    tools = [tool for tool in params.tools if tool.name in names]
    if params.tool_mode == "auto":  # the call is triggered by the reply's opening; its arguments checked by parse_tools

        def build_auto() -> AutoCallGrammar:
            return AutoCallGrammar(compiler, tools, fmt, parallel=params.parallel_tool_calls)

        return build_auto
    if fmt is not None:  # the model family's call syntax around each allowed tool's arguments
        call_regex(fmt, tools)  # raises now, not on the worker
    else:
        regex = schema_regex(params.schema, strict=params.tool_mode == "off")  # tools: checked per tool by parse_tools

    def build() -> Grammar | RepeatedGrammar | CallListGrammar:
        if fmt is not None:
            return call_grammar(compiler, fmt, tools, params.schema, parallel=params.parallel_tool_calls)
        grammar = compiler.compile(params.schema, regex=regex)
        if params.tool_mode == "off":
            return grammar
        return RepeatedGrammar(grammar) if params.parallel_tool_calls else grammar

    return build


class LocalStream:
    """One request in the local engine."""

    def __init__(self, runtime: Runtime, seq: Sequence, grammar: Callable[[], Any] | None, calls: CallTranscriber | None = None) -> None:
        self._runtime = runtime
        self._seq = seq
        self._grammar = grammar  # builds the request's grammar (seconds for a big schema: off the loop)
        self._calls = calls  # a model family's call syntax → the canonical call text Step promises
        self._handle: RequestHandle | None = None

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    async def submit(self) -> None:
        if self._grammar is not None:
            build, self._grammar = self._grammar, None
            self._seq.grammar = await anyio.to_thread.run_sync(build)  # outlines_core releases the GIL
        channel = Channel(asyncio.get_running_loop())
        self._seq.submitted_at = time.perf_counter()  # a `timeout` counts from here
        handle = RequestHandle(self._seq, channel, self._runtime)
        self._runtime.submit(handle)
        self._handle = handle
        weakref.finalize(self, handle.cancel)  # a stream dropped without aclose() frees the engine

    async def receive(self) -> Step:
        assert self._handle is not None, "submit() first"
        item = await self._handle.channel.receive()
        if isinstance(item, BaseException):
            raise item
        return self._step(item)

    def _step(self, output: StepOutput) -> Step:
        text = self._calls.feed(output.text) if output.is_call and self._calls is not None else output.text
        if output.finish_reason is None:
            return Step(text, tuple(output.token_ids), output.is_call)
        seq = self._seq  # the worker has released it: reading is safe
        prompt, completion = len(seq.prompt_ids), seq.generated
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        stats = seq.stats.model_copy(deep=True)
        return Step(text, tuple(output.token_ids), output.is_call, finish_reason=output.finish_reason, usage=usage, stats=stats)

    async def aclose(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


class LocalBackend:
    """The model, engine, draft sources and worker of one ``Client``, and its request metrics."""

    name = "local"

    def __init__(self, model: str | Path | None, *, draft: Any, device: Any, dtype: Any, weights: str, spec: SpecConfig, limits: Limits) -> None:
        self.model_ref, self.draft, self.device, self.dtype, self.weights = model, draft, device, dtype, weights
        self.spec, self.limits = spec, limits
        self.loaded: LoadedModel | None = None
        self.runtime: Runtime | None = None
        self.sources: DraftSources | None = None
        self._metrics = MetricsAggregator(max_tags=limits.max_tags)
        self._shadow_rng = random.Random()

    async def start(self) -> None:
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
            self.sources = DraftSources(loaded, self.draft, engine.costs, device=self.device, dtype=self.dtype)
            engine.drafter_factory = self.sources.drafter
            # a second client on this model starts from the first's measurements; shapes beyond the
            # first two are measured while the client is idle (start-up does not wait for them)
            engine.calibrate(reuse=True, idle=True)
            runtime.engine = engine
            return loaded

        try:
            self.loaded = await asyncio.wrap_future(runtime.call(set_up))
        except BaseException:
            runtime.stop(timeout=0)  # the worker exits after the job in flight; never block the loop
            raise
        self.runtime = runtime

    async def aclose(self) -> None:
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            await anyio.to_thread.run_sync(runtime.stop, abandon_on_cancel=True)

    def abandon(self) -> None:
        """Stop the worker without waiting (a client closed while it was loading)."""
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.stop(timeout=0)

    def open(self, request: Request) -> LocalStream:
        assert self.loaded is not None and self.runtime is not None, "start() first"
        loaded, params = self.loaded, request.params
        prompt_ids = loaded.chat.encode(request.messages, params.tools)  # the template's tool format, or agentspec's section
        room = loaded.context_window - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"The prompt is {len(prompt_ids)} tokens but the model's context window is {loaded.context_window}; "
                "shorten the messages (drop old turns or trim documents)."
            )
        max_new = min(params.max_tokens or room, room)
        # a family's syntax, or any opening "auto" accepts → the canonical call text Step promises
        calls = CallTranscriber() if params.tool_mode != "off" else None
        return LocalStream(self.runtime, Sequence(prompt_ids, params, max_new_tokens=max_new), _grammar_builder(loaded, params), calls)

    # -- observability -----------------------------------------------------------------------------

    def metrics(self, tag: str | None = None) -> SpecStats:
        return self._metrics.snapshot(tag)

    def metrics_text(self) -> str:
        return self._metrics.prometheus_text()

    def _finished(self, seq: Sequence) -> None:
        """Worker thread: a request ended. Count it, log it, maybe schedule its shadow check."""
        self._metrics.add(seq.stats, seq.params.tag)
        log_request(seq)
        completed = seq.finish_reason in ("stop", "length")  # not cancelled, not failed
        if self.sources is not None and completed and seq.output_ids:
            self.sources.finished(seq.output_ids)
        spec = seq.params.spec
        rate = min(spec.shadow_rate, self.limits.max_shadow_rate)  # a request cannot ask for more than its server allows
        if (
            completed
            and rate > 0
            and spec.speculates
            and self._shadow_rng.random() < rate
            and self.runtime is not None
        ):
            plain = dataclasses.replace(seq.params, spec=spec.model_copy(update={"enabled": False}))
            shadow = Sequence(seq.prompt_ids, plain, max_new_tokens=seq.max_new_tokens, grammar=seq.grammar)
            self.runtime.shadow(shadow, functools.partial(self._compare, seq))

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
