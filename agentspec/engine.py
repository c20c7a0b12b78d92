"""The speculative decoding engine: synchronous torch code, driven by one worker thread.

One ``Engine.step(seq)`` advances one sequence:

1. **Draft** up to K tokens (n-gram continuation of prompt + output), cut to the length that
   maximises expected tokens per millisecond (``budget``); K = 0 is a plain decoding step.
2. **Verify** with one target pass over ``[uncommitted-to-cache tokens] + draft``: the logits
   pipeline runs at every position with that position's prefix, then greedy matching or rejection
   sampling (``verify``) yields the accepted run and one recovered/bonus token.
3. **Commit** token by token, applying the stop rules exactly as plain decoding would (stop tokens,
   stop strings, max_tokens), then roll the KV cache back to the committed length.
4. **Account**: statistics, acceptance and cost measurements.

Plain decoding is this loop with K = 0, which is what makes "identical to plain decoding" testable.
The first step of a sequence is its prefill: the prompt is the uncached input, drafts included.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from .budget import AcceptanceModel, CostModel, choose_draft_length
from .drafting import NO_DRAFT, Draft, Drafter, NgramDrafter
from .logits import LogitsPipeline
from .model import LoadedModel
from .params import GenerationParams
from .text import StopMatcher, TokenDecoder
from .types import SpecStats
from .verify import verify_greedy, verify_sampling

__all__ = ["Engine", "Sequence", "StepOutput"]

log = logging.getLogger("agentspec.engine")

DrafterFactory = Callable[[GenerationParams], Drafter | None]


def default_drafter(params: GenerationParams) -> Drafter | None:
    spec = params.spec
    if not spec.enabled or spec.max_draft_tokens == 0:
        return None
    return NgramDrafter(min_n=spec.ngram_min, max_n=spec.ngram_max)


@dataclass(slots=True)
class StepOutput:
    """What one step commits: new verified text and token ids, and the finish reason if it ended."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass(eq=False)
class Sequence:
    """One request's decoding state. Owned by the worker thread."""

    prompt_ids: list[int]
    params: GenerationParams
    max_new_tokens: int
    submitted_at: float = field(default_factory=time.perf_counter)

    tokens: list[int] = field(init=False)  # prompt + committed output (stop token included)
    output_ids: list[int] = field(default_factory=list, init=False)  # emitted tokens (no stop token)
    num_cached: int = field(default=0, init=False)  # tokens whose keys/values are in `cache`
    finish_reason: str | None = field(default=None, init=False)
    stats: SpecStats = field(default_factory=SpecStats, init=False)
    first_token_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


class Engine:
    """Decodes sequences of one model. Not thread-safe: one worker thread calls ``start``/``step``."""

    def __init__(self, loaded: LoadedModel, *, max_draft_tokens: int = 16, drafter_factory: DrafterFactory = default_drafter) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.stop_token_ids = loaded.stop_token_ids
        self.costs = CostModel(max_positions=max_draft_tokens + 1)
        self.drafter_factory = drafter_factory
        # Per-sequence helpers live here, keyed by the sequence, so `Sequence` stays plain data.
        self._state: dict[Sequence, _SequenceState] = {}

    # -- lifecycle ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def calibrate(self, context: int = 64, repeats: int = 3) -> None:
        """Measure every verification shape (also warms the kernels up).

        The fastest of ``repeats`` runs is kept: interference from other processes only adds time.
        """
        cache = DynamicCache()
        self._forward(torch.arange(context, device=self.device).unsqueeze(0) + 100, cache, 1)
        for positions in range(1, self.costs.max_positions + 1):
            timings = []
            for _ in range(repeats):
                started = time.perf_counter()
                self._forward(torch.full((1, positions), 100, device=self.device), cache, positions)
                self._sync()
                cache.crop(-positions)
                timings.append((time.perf_counter() - started) * 1e3)
            self.costs.record(positions, min(timings))

    def start(self, seq: Sequence) -> None:
        """Register a sequence; its first ``step`` is the prefill."""
        self._state[seq] = _SequenceState(self, seq)

    def release(self, seq: Sequence) -> None:
        """Free a sequence's KV cache and helpers (finished, cancelled or failed)."""
        self._state.pop(seq, None)

    @property
    def active(self) -> int:
        return len(self._state)

    # -- the step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, seq: Sequence) -> StepOutput:
        state = self._state[seq]
        params, stats = seq.params, seq.stats

        # 1. Draft.
        started = time.perf_counter()
        draft = state.draft()
        draft_tokens = draft.tokens[: state.choose_length(draft)]
        if draft.tokens and not draft_tokens:
            stats.fallback_steps += 1  # speculation predicted to lose: a plain step
        stats.draft_ms += (time.perf_counter() - started) * 1e3

        # 2. Verify: one target pass; row i of the logits scores the token after draft[:i].
        started = time.perf_counter()
        uncached = seq.tokens[seq.num_cached :]
        positions = len(draft_tokens) + 1
        shape = self._shape(positions, seq)
        pad = [seq.tokens[-1]] * (shape - positions)  # keys/values of padding are cropped below
        inputs = torch.tensor([uncached + draft_tokens + pad], device=self.device)
        logits = self._forward(inputs, state.cache, shape)[0, :positions]  # [K+1, V]
        draft_tensor = torch.tensor(draft_tokens, dtype=torch.long, device=self.device)
        if params.greedy:
            accepted, token = verify_greedy(state.pipeline.greedy(logits, draft_tokens), draft_tensor)
        else:
            draft_probs = draft.probs[: len(draft_tokens)] if draft.probs is not None else None
            accepted, token = verify_sampling(state.pipeline.probs(logits, draft_tokens), draft_tensor, draft_probs, state.generator)
        self._sync()
        verify_ms = (time.perf_counter() - started) * 1e3

        # 3. Commit, then roll the cache back to the committed tokens (all but the newest one).
        committed_before = len(seq.tokens)
        output = state.commit(draft_tokens[:accepted] + [token])
        cache_length = state.cache.get_seq_length()
        keep = committed_before + accepted
        if cache_length > keep:
            state.cache.crop(keep - cache_length)
        seq.num_cached = keep

        # 4. Account.
        stats.target_forward_passes += 1
        stats.verify_ms += verify_ms
        if len(uncached) == 1:  # decode steps only: a prefill says nothing about verification cost
            self.costs.record(shape, verify_ms)
        if draft_tokens:
            kept = min(accepted, len(seq.tokens) - committed_before)  # a stop may cut the accepted run
            stats.drafted_tokens += len(draft_tokens)
            stats.accepted_tokens += kept
            stats.accepted_by_source[draft.source] = stats.accepted_by_source.get(draft.source, 0) + kept
            stats.rollbacks += accepted < len(draft_tokens)
            state.acceptance.observe(draft.source, draft.evidence, len(draft_tokens), accepted)
        elif draft.tokens:  # free evidence: would the draft's first token have been accepted?
            state.acceptance.observe(draft.source, draft.evidence, 1, int(draft.tokens[0] == token))
        if output.finish_reason is not None:
            self.finish_stats(seq)
        return output

    # -- helpers -----------------------------------------------------------------------------------

    def _shape(self, positions: int, seq: Sequence) -> int:
        """Positions to run: a verification is padded to the cheapest measured shape, never past the
        context window. A plain step is never padded, so plain decoding does not depend on timings."""
        if positions == 1:
            return 1
        room = self.loaded.context_window - len(seq.tokens) + 1
        return max(positions, min(self.costs.best_shape(positions), room))

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache, logits_to_keep: int) -> torch.Tensor:
        return self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep).logits

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finish_stats(self, seq: Sequence) -> None:
        """Fill in the derived statistics of a sequence that just ended."""
        stats, now = seq.stats, time.perf_counter()
        stats.requests = 1
        stats.output_tokens = seq.generated
        stats.derive()
        if seq.first_token_at is not None:  # a request cancelled before its first token has no TTFT
            stats.ttft_ms = (seq.first_token_at - seq.submitted_at) * 1e3
            stats.tpot_ms = (now - seq.first_token_at) * 1e3 / (seq.generated - 1) if seq.generated > 1 else 0.0


class _SequenceState:
    """The engine-side helpers of one sequence: cache, logits pipeline, drafter, text, stops."""

    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self.engine, self.seq = engine, seq
        params = seq.params
        # Full (not sliding-window) layers for every model: only those can be cropped back on rollback.
        self.cache = DynamicCache()
        self.pipeline = LogitsPipeline(params, engine.loaded.vocab_size, engine.device)
        self.pipeline.observe(seq.prompt_ids)
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=engine.device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)
        self.acceptance = AcceptanceModel()
        self.decoder = TokenDecoder(engine.loaded.token_bytes)
        self.stopper = StopMatcher(params.stop)
        self.drafter = engine.drafter_factory(params)
        if self.drafter is not None:
            self.drafter.reset(seq.prompt_ids)

    def draft(self) -> Draft:
        """The drafter's proposal; a drafter that raises costs this step its speculation, nothing more."""
        seq = self.seq
        room = seq.max_new_tokens - seq.generated - 1  # leave room for the recovered/bonus token
        k = min(seq.params.spec.max_draft_tokens, room)
        if self.drafter is None or k <= 0:
            return NO_DRAFT
        try:
            draft = self.drafter.propose(k)
            return Draft(draft.tokens[:k], draft.source, draft.probs, draft.evidence)
        except Exception:
            log.exception("drafter %s failed; decoding this step plainly", type(self.drafter).__name__)
            seq.stats.fallback_steps += 1
            return NO_DRAFT

    def choose_length(self, draft: Draft) -> int:
        if not draft.tokens:
            return 0
        if not self.seq.params.spec.adaptive:
            return len(draft.tokens)
        acceptance = self.acceptance.rate(draft.source, draft.evidence)
        return choose_draft_length(len(draft.tokens), acceptance.first, self.engine.costs, acceptance.rest)

    def commit(self, new_tokens: list[int]) -> StepOutput:
        """Append verified tokens one at a time, stopping exactly where plain decoding would."""
        seq = self.seq
        text: list[str] = []
        emitted: list[int] = []
        finish: str | None = None
        hit = False
        committed = 0
        for token in new_tokens:
            committed += 1
            seq.tokens.append(token)
            if token in self.engine.stop_token_ids:
                finish = "stop"
                break
            seq.output_ids.append(token)
            emitted.append(token)
            piece, hit = self.stopper.feed(self.decoder.decode((token,)))
            text.append(piece)
            if hit:
                finish = "stop"
                break
            if seq.generated >= seq.max_new_tokens:
                finish = "length"
                break
        if finish is not None and not hit:
            # The end of the response: release bytes and text held back for later tokens.
            tail, hit = self.stopper.feed(self.decoder.flush())
            text.append(tail if hit else tail + self.stopper.flush())
            finish = "stop" if hit else finish
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        self.pipeline.observe(new_tokens[:committed])
        if self.drafter is not None and finish is None:
            try:
                self.drafter.observe(new_tokens[:committed])
            except Exception:  # its state is now unknown: decode the rest of this request plainly
                log.exception("drafter %s failed to observe; speculation off for this request", type(self.drafter).__name__)
                self.drafter = None
        seq.finish_reason = finish
        return StepOutput("".join(text), emitted, finish)
