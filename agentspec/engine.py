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
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from .budget import AcceptanceModel, CostModel, choose_draft_length
from .drafting import NO_DRAFT, Draft, Drafter, ngram_drafter
from .grammar import AutoCallGrammar, Grammar, RepeatedGrammar
from .logits import LogitsPipeline
from .model import LoadedModel
from .params import GenerationParams
from .text import StopMatcher, TokenDecoder
from .types import SpecStats
from .verify import verify_greedy, verify_sampling

__all__ = ["Engine", "GrammarDeadEnd", "Sequence", "StepOutput"]

log = logging.getLogger("agentspec.engine")

DrafterFactory = Callable[[GenerationParams], Drafter | None]


class GrammarDeadEnd(RuntimeError):
    """No token is allowed where decoding must continue: the request fails (EngineError), no other."""


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
    grammar: Grammar | RepeatedGrammar | AutoCallGrammar | None = None  # structured output: every token is checked against it
    submitted_at: float = field(default_factory=time.perf_counter)
    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex[:20]}")

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

    def __init__(self, loaded: LoadedModel, *, max_draft_tokens: int = 16, drafter_factory: DrafterFactory = ngram_drafter) -> None:
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

    def __contains__(self, seq: Sequence) -> bool:
        """Whether ``seq`` is started and not yet released."""
        return seq in self._state

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
        draft_tokens, masks = state.grammar_walk(draft_tokens)  # cut at the first token it rejects
        forced = min(draft.forced, len(draft_tokens))
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
            accepted, token = verify_greedy(state.pipeline.greedy(logits, draft_tokens, masks), draft_tensor)
        else:
            draft_probs = draft.probs[: len(draft_tokens)] if draft.probs is not None else None
            target_probs = state.pipeline.probs(logits, draft_tokens, masks)
            accepted, token = verify_sampling(target_probs, draft_tensor, draft_probs, state.generator)
        if masks is not None and not bool(masks[accepted].any()):  # rows before it accepted a draft token
            raise GrammarDeadEnd(
                f"The grammar allows no token after {seq.generated + accepted} generated tokens; the schema cannot "
                "be continued with this vocabulary. Simplify the schema."
            )
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
            by_source = stats.accepted_by_source
            if forced:
                by_source["grammar"] = by_source.get("grammar", 0) + min(kept, forced)
            if kept > forced:
                by_source[draft.source] = by_source.get(draft.source, 0) + kept - forced
            stats.rollbacks += accepted < len(draft_tokens)
            if len(draft_tokens) > forced and accepted >= forced:  # learn about the unforced part only
                state.acceptance.observe(draft.source, draft.evidence, len(draft_tokens) - forced, accepted - forced)
        elif draft.tokens and not draft.forced:  # free evidence: would the first token have been accepted?
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
        self.grammar = seq.grammar
        self.grammar_state = seq.grammar.initial_state if seq.grammar is not None else 0

    def draft(self) -> Draft:
        """Grammar-forced tokens first, then the drafter's continuation after them.

        A drafter that raises costs this step its own tokens, nothing more.
        """
        seq = self.seq
        room = seq.max_new_tokens - seq.generated - 1  # leave room for the recovered/bonus token
        k = min(seq.params.spec.max_draft_tokens, room) if seq.params.spec.enabled else 0
        if k <= 0:
            return NO_DRAFT
        forced = self.grammar.forced(self.grammar_state)[:k] if self.grammar is not None else []
        if self.drafter is None or len(forced) >= k:
            return Draft(forced, "grammar", forced=len(forced)) if forced else NO_DRAFT
        try:
            rest = self.drafter.propose(k - len(forced), after=forced) if forced else self.drafter.propose(k)
        except Exception:
            log.exception("drafter %s failed; no draft from it this step", type(self.drafter).__name__)
            seq.stats.fallback_steps += 1
            rest = NO_DRAFT
        tokens = forced + rest.tokens[: k - len(forced)]
        source = rest.source if rest.tokens else "grammar"
        return Draft(tokens, source, rest.probs, rest.evidence, forced=len(forced))

    def choose_length(self, draft: Draft) -> int:
        """All grammar-forced tokens (they always verify), then what pays off of the rest."""
        free = len(draft.tokens) - draft.forced
        if free <= 0 or not self.seq.params.spec.adaptive:
            return len(draft.tokens)
        acceptance = self.acceptance.rate(draft.source, draft.evidence)
        return draft.forced + choose_draft_length(free, acceptance.first, self.engine.costs, acceptance.rest)

    def grammar_walk(self, draft: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """The draft up to the first token the grammar rejects, and the mask at each position: [P, V]."""
        if self.grammar is None:
            return draft, None
        states = [self.grammar_state]
        for token in draft:
            following = self.grammar.advance(states[-1], token)
            if following is None:
                break
            states.append(following)
        if all(self.grammar.unconstrained(s) for s in states):
            return draft, None
        return draft[: len(states) - 1], torch.stack([self.grammar.mask(s) for s in states])

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
            if self.grammar is not None:
                self.grammar_state = self.grammar.next_state(self.grammar_state, token)
                if self.grammar.is_complete(self.grammar_state):
                    finish = "stop"  # the structured output is complete
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
