"""The embedded backend: one model, one engine, its draft sources and the worker thread that runs
every target pass. Model loading and calibration run on the worker, never on the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import random
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import anyio

from ..deadline import call_with_deadline
from ..drafting.base import common_prefix
from ..drafting.sources import DraftSources
from ..engine import Engine, Sequence, StepOutput
from ..engine.prefix import PrefixCache
from ..errors import ContextLengthError, LimitExceededError
from ..metrics import MetricsAggregator, log_request
from ..model import LoadedModel, load_model
from ..params import GenerationParams
from ..runtime import Channel, RequestHandle, Runtime
from ..structured.formats import CallListGrammar, CallTranscriber, call_grammar, call_regex
from ..structured.grammar import Grammar, RepeatedGrammar, schema_regex
from ..structured.isolated import ProcessIndexBuilder
from ..structured.triggers import AutoCallGrammar
from ..structured.tools import schema_tool_names
from ..types import Limits, SpecConfig, SpecStats, Usage
from .base import Request, Step

__all__ = ["LocalBackend", "LocalStream"]

log = logging.getLogger("agentspec.client")

GRAMMAR_THREADS = 4  # requests building their grammars at once (each index build uses one core, or waits for a process)
ISOLATED_GRACE_S = 0.5  # a child process's build is killed at the limit itself: time to hear of it


def _grammar_timeout(limits: Limits) -> LimitExceededError:
    return LimitExceededError(
        f"The request's grammar took over {limits.grammar_timeout_s:g} s to build (Limits.grammar_timeout_s; agentspec serve "
        "--grammar-timeout-s); simplify its schema or tools (fewer free-form strings and alternatives).",
        limit="grammar_timeout_s",
        code="grammar_timeout",
    )


def _template_timeout(limits: Limits) -> Callable[[], LimitExceededError]:
    return lambda: LimitExceededError(
        f"Rendering the chat template and tokenizing the prompt took over {limits.template_timeout_s:g} s "
        "(Limits.template_timeout_s; agentspec serve --template-timeout-s); send shorter messages.",
        limit="template_timeout_s",
        code="template_timeout",
    )


def _grammar_builder(loaded: LoadedModel, params: GenerationParams, max_chars: int, build_index: Any) -> Callable[[], Any] | None:
    """Validate the request's schema now (raising InvalidRequestError, or LimitExceededError past
    ``max_chars``: Limits.max_grammar_chars); build its index later (with ``build_index``, if given)."""
    if params.schema is None:
        return None
    compiler = loaded.grammars
    fmt = loaded.chat.tool_format if params.tool_mode != "off" else None
    names = schema_tool_names(params.schema) if params.tool_mode != "off" else set()
    tools = [tool for tool in params.tools if tool.name in names]
    if params.tool_mode == "auto":  # the call is triggered by the reply's opening; its arguments checked by parse_tools
        for tool in tools:  # each tool's arguments grammar bounded now (LimitExceededError), before any is built
            schema_regex(tool.parameters, strict=False, max_chars=max_chars)

        def build_auto() -> AutoCallGrammar:
            return AutoCallGrammar(compiler, tools, fmt, parallel=params.parallel_tool_calls, max_chars=max_chars, build_index=build_index)

        return build_auto
    if fmt is not None:  # the model family's call syntax around each allowed tool's arguments
        call_regex(fmt, tools, max_chars=max_chars)  # raises now, not on the worker
    else:  # tools: checked per tool by parse_tools
        regex = schema_regex(params.schema, strict=params.tool_mode == "off", max_chars=max_chars)

    def build() -> Grammar | RepeatedGrammar | CallListGrammar:
        if fmt is not None:
            return call_grammar(compiler, fmt, tools, params.schema, parallel=params.parallel_tool_calls, max_chars=max_chars, build_index=build_index)
        grammar = compiler.compile(params.schema, regex=regex, build_index=build_index)
        if params.tool_mode == "off":
            return grammar
        return RepeatedGrammar(grammar) if params.parallel_tool_calls else grammar

    return build


class LocalStream:
    """One request in the local engine."""

    def __init__(
        self,
        backend: "LocalBackend",
        seq: Sequence,
        grammar: Callable[[], Any] | None,
        calls: CallTranscriber | None = None,
    ) -> None:
        assert backend.runtime is not None
        self._backend = backend
        self._runtime = backend.runtime
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
            self._runtime.check_room()  # a full queue refuses before seconds of compiling
            self._seq.grammar = await self._backend.build_grammar(build)
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
        # Grammar indexes are built here, not in anyio's pool shared with everything else; their
        # compiler (outlines_core) cannot be interrupted, so a build past its time limit is refused
        # and finishes in the background, holding one of these threads: at most this many at once.
        self._build_index: ProcessIndexBuilder | None = None  # Limits.grammar_processes > 0
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="agentspec-grammar")

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
            grammars = loaded.grammars  # shared by the clients of this model: the smallest budget applies
            grammars.cache.max_bytes = min(grammars.cache.max_bytes, int(limits.grammar_cache_mb * 2**20))
            if limits.grammar_processes:
                self._build_index = ProcessIndexBuilder(
                    grammars.vocabulary, processes=limits.grammar_processes, timeout_s=limits.grammar_timeout_s, on_timeout=lambda: _grammar_timeout(limits)
                )
            self.sources = DraftSources(loaded, self.draft, engine.costs, target=engine.forward, device=self.device, dtype=self.dtype)
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
        # No prompt longer than this fits the context window, whatever its tokens: refused untokenized.
        self._max_prompt_chars = self.loaded.context_window * max(map(len, self.loaded.token_bytes))

    async def aclose(self) -> None:
        runtime, self.runtime = self.runtime, None
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if runtime is not None:
            await anyio.to_thread.run_sync(runtime.stop, abandon_on_cancel=True)

    async def build_grammar(self, build: Callable[[], Any]) -> Any:
        """Run a request's grammar ``build`` on the grammar threads, refused after
        ``Limits.grammar_timeout_s`` (time waiting for a thread included)."""
        future = asyncio.wrap_future(self._grammar_pool.submit(build))
        try:  # a child process's build is killed at the limit; a thread's finishes unseen (grammar_processes=0)
            return await asyncio.wait_for(future, self.limits.grammar_timeout_s + ISOLATED_GRACE_S)  # a build still waiting for a thread is dropped
        except TimeoutError:
            raise _grammar_timeout(self.limits) from None

    def abandon(self) -> None:
        """Stop the worker without waiting (a client closed while it was loading)."""
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.stop(timeout=0)

    def open(self, request: Request) -> LocalStream:
        assert self.loaded is not None and self.runtime is not None, "start() first"
        loaded, params, limits = self.loaded, request.params, self.limits
        prompt_ids = call_with_deadline(  # the template's tool format, or agentspec's section
            lambda: loaded.chat.encode(request.messages, params.tools, max_chars=self._max_prompt_chars),
            limits.template_timeout_s,
            _template_timeout(limits),
        )
        room = loaded.context_window - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"The prompt is {len(prompt_ids)} tokens but the model's context window is {loaded.context_window}; "
                "shorten the messages (drop old turns or trim documents)."
            )
        max_new = min(params.max_tokens or room, room)
        # a family's syntax, or any opening "auto" accepts → the canonical call text Step promises
        calls = CallTranscriber() if params.tool_mode != "off" else None
        grammar = _grammar_builder(loaded, params, limits.max_grammar_chars, self._build_index)
        return LocalStream(self, Sequence(prompt_ids, params, max_new_tokens=max_new), grammar, calls)

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
            self.sources.finished(seq.output_ids, seq.params.cache_salt)
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
