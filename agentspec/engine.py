"""The speculative decoding engine: synchronous torch code, driven by one worker thread.

One ``Engine.step_many(seqs)`` advances every given sequence by one step, in ONE target pass:

1. **Draft** per sequence up to K tokens (grammar-forced tokens, then the drafter's continuation);
   then cut every draft to the length that maximises the tokens the whole pass commits per
   millisecond of it (``budget.choose_lengths``, from measured acceptance and the measured cost of
   passes by their number of positions). Under load extra positions stop paying off and K falls to 0.
2. **Verify**: the sequences' uncached tokens and drafts run packed in one pass (``kv.forward_packed``:
   per-sequence positions and keys/values, no padding between sequences). Row i of a sequence's
   logits scores the token after draft[:i], through that sequence's logits pipeline; then greedy
   matching or rejection sampling (``verify``) yields its accepted run and one recovered/bonus token.
3. **Commit** token by token, applying the stop rules exactly as plain decoding would (stop tokens,
   stop strings, grammar completion, max_tokens), then roll the sequence's keys/values back to the
   committed tokens (setting its block's length).
4. **Account**: statistics, acceptance and cost measurements.

Plain decoding is this loop with K = 0, which is what makes "identical to plain decoding" testable;
a sequence decodes the same alone or in any batch (up to float rounding between pass shapes, as
between a verification and a plain step). A sequence's first steps are its prefill (chunks of at most
``PREFILL_CHUNK`` tokens, minus what the prefix cache supplies).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from .budget import AcceptanceModel, CostModel, RowBudget, choose_lengths
from .drafting import NO_DRAFT, Draft, Drafter, ngram_drafter
from .errors import ModelLoadError
from .grammar import AutoCallGrammar, Grammar, RepeatedGrammar
from .kv import KVBlock, KVLayout, PackedRow, check_packed, forward_packed, use_packed_attention
from .logits import LogitsPipeline
from .model import LoadedModel
from .params import GenerationParams
from .prefix import PrefixCache
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
    """Decodes sequences of one model. Not thread-safe: one worker thread calls ``start``/``step_many``."""

    PREFILL_CHUNK = 512  # prompt tokens per pass: a long prompt joining a batch delays the others' step by at most this
    CALIBRATION_SHAPES = (24, 32, 48, 64)  # beyond 1..K+1: the passes of a batch

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_draft_tokens: int = 16,
        drafter_factory: DrafterFactory | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.stop_token_ids = loaded.stop_token_ids
        use_packed_attention(self.model)
        self.layout = KVLayout.of(self.model)
        self.costs = CostModel(max_positions=max(max_draft_tokens + 1, *self.CALIBRATION_SHAPES))
        self._calibrate_shapes = [*range(1, max_draft_tokens + 2), *self.CALIBRATION_SHAPES]
        self.drafter_factory = drafter_factory or (lambda params: ngram_drafter(params, loaded))
        self.prefix_cache = prefix_cache
        # How the model writes the tokens grammars hold back (DESIGN §3 look-back), learned from every
        # sequence's output: {held token: the tokens the model wrote for its bytes}. Drafts only.
        self.spellings: dict[int, list[int]] = {}
        # Per-sequence helpers live here, keyed by the sequence, so `Sequence` stays plain data.
        self._state: dict[Sequence, _SequenceState] = {}

    # -- lifecycle ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def calibrate(self, context: int = 64, repeats: int = 3) -> None:
        """Check the packed attention against the model's own, then measure every pass shape (which
        also warms the kernels up). The fastest of ``repeats`` runs is kept: interference from other
        processes only adds time."""
        try:
            check_packed(self.model, self.layout)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{self.loaded.name}: this architecture's attention is not supported by agentspec's batched passes ({exc})."
            ) from exc
        block = KVBlock(self.layout)
        self._forward([PackedRow(block, list(range(100, 100 + context)), 1)])
        for positions in self._calibrate_shapes:
            timings = []
            for _ in range(repeats):
                started = time.perf_counter()
                self._forward([PackedRow(block, [100] * positions, positions)])
                self._sync()
                block.length -= positions
                timings.append((time.perf_counter() - started) * 1e3)
            self.costs.record(positions, min(timings))
        self._calibrate_segments(context, repeats)

    def _calibrate_segments(self, context: int, repeats: int, segments: int = 8) -> None:
        """What each further sequence adds to a pass: ``segments`` sequences of one token each against
        one sequence of ``segments`` tokens (same positions, same linear layers)."""
        blocks = [KVBlock(self.layout) for _ in range(segments)]
        self._forward([PackedRow(b, list(range(100, 100 + context)), 1) for b in blocks])
        timings = []
        for _ in range(repeats):
            started = time.perf_counter()
            self._forward([PackedRow(b, [100], 1) for b in blocks])
            self._sync()
            timings.append((time.perf_counter() - started) * 1e3)
            for b in blocks:
                b.length -= 1
        self.costs.segment_ms = max(0.0, (min(timings) - self.costs.cost(segments)) / (segments - 1))

    def start(self, seq: Sequence) -> None:
        """Register a sequence; its first ``step`` is the prefill (of what the prefix cache lacks)."""
        state = _SequenceState(self, seq)
        if self.prefix_cache is not None:
            seq.num_cached = self.prefix_cache.fill(state.block, seq.prompt_ids)
            seq.stats.cached_prompt_tokens = seq.num_cached
        self._state[seq] = state

    def release(self, seq: Sequence) -> None:
        """Free a sequence's keys/values and helpers (finished, cancelled or failed). A finished
        sequence's keys/values go to the prefix cache: the next turn of a conversation starts with them."""
        state = self._state.pop(seq, None)
        if state is not None and self.prefix_cache is not None and seq.finish_reason in ("stop", "length"):
            self.prefix_cache.add(seq.tokens[: state.block.length], state.block)

    def close(self) -> None:
        """Drop every sequence and the prefix cache (their keys/values are freed now)."""
        self._state.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def active(self) -> int:
        return len(self._state)

    @property
    def kv_bytes(self) -> int:
        """Memory held by the keys/values of active sequences."""
        return sum(state.block.nbytes for state in self._state.values())

    def __contains__(self, seq: Sequence) -> bool:
        """Whether ``seq`` is started and not yet released."""
        return seq in self._state

    # -- the step ----------------------------------------------------------------------------------

    def step(self, seq: Sequence) -> StepOutput:
        """One step of one sequence; raises what failed it."""
        result = self.step_many([seq])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    @torch.inference_mode()
    def step_many(self, seqs: list[Sequence]) -> list[StepOutput | Exception]:
        """One step of every sequence in one target pass: what each committed, or what failed it.

        A failure in one sequence (its drafter, grammar, logits) ends that sequence only. If the
        shared pass itself fails (out of memory, say), each sequence is retried in a pass of its own,
        so only the ones that fail alone fail.
        """
        results: list[StepOutput | Exception | None] = [None] * len(seqs)
        plans: list[_Plan] = []
        for i, seq in enumerate(seqs):
            try:
                plans.append(self._state[seq].draft_plan(i))
            except Exception as exc:
                results[i] = exc
        self._choose_lengths(plans)
        for plan in list(plans):
            try:
                plan.finish_draft()
            except Exception as exc:
                results[plan.index] = exc
                plans.remove(plan)
        self._pad(plans)
        if plans:
            self._run_pass(plans, results)
        return [result if result is not None else RuntimeError("not stepped") for result in results]

    def _run_pass(self, plans: list["_Plan"], results: list[StepOutput | Exception | None]) -> None:
        """One target pass over ``plans``, then each one's verification and commit into ``results``.
        If the pass itself fails with several sequences in it, each is retried in a pass of its own."""
        started = time.perf_counter()
        try:
            logits = self._forward([plan.row for plan in plans])
            self._sync()
        except Exception as exc:
            if len(plans) == 1:
                results[plans[0].index] = exc
                return
            log.warning("a batched pass failed (%s); retrying its %d sequences one by one", exc, len(plans))
            for plan in plans:
                self._run_pass([plan], results)
            return
        pass_ms = (time.perf_counter() - started) * 1e3
        if all(plan.decoding for plan in plans):  # a prefill says nothing about verification cost
            self.costs.record(sum(len(plan.row.tokens) for plan in plans), pass_ms, segments=len(plans))
        for plan, rows in zip(plans, logits):
            try:
                results[plan.index] = plan.state.verify_commit(plan, rows, pass_ms)
            except Exception as exc:
                results[plan.index] = exc

    def _choose_lengths(self, plans: list["_Plan"]) -> None:
        """Cut every free draft to the length that pays off for the whole pass (``budget.choose_lengths``)."""
        budgets = [plan.budget() for plan in plans]
        if not any(b.available for b in budgets):
            return
        for plan, length in zip(plans, choose_lengths(budgets, self.costs)):
            plan.cut(length)

    def _pad(self, plans: list["_Plan"]) -> None:
        """Pad a pass to the cheapest measured shape with at least its positions (on a 2-core CPU a
        pass over 2-3 positions costs more than one over 4-9: two plain sequences step faster padded
        to 4). A lone plain step (one position) is never padded, so plain decoding of one request
        does not depend on timings. Padded positions are written past the committed tokens and
        dropped with the rejected drafts."""
        if not plans or not all(plan.decoding for plan in plans):
            return
        positions = sum(len(plan.row.tokens) for plan in plans)
        if positions == 1:
            return
        pad = self.costs.best_shape(positions) - positions
        if pad <= 0:
            return
        window = self.loaded.context_window
        plan = max(plans, key=lambda p: window - p.state.block.length - len(p.row.tokens))
        if window - plan.state.block.length - len(plan.row.tokens) >= pad:
            plan.row.tokens.extend([plan.row.tokens[-1]] * pad)
            plan.row.pad = pad

    # -- helpers -----------------------------------------------------------------------------------

    def _forward(self, rows: list[PackedRow]) -> list[torch.Tensor]:
        return forward_packed(self.model, rows)

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
        self.block = KVBlock(engine.layout)
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
        self.draft_forced = "grammar" in params.spec.sources  # else forced text is decoded a token per pass
        self.held_watch: tuple[int, int] | None = None  # (index in seq.tokens, token): the last held token drafted

    def draft(self) -> Draft:
        """The grammar's tokens first (its forced text, then the token its look-back held back, as the
        model last wrote it: ``Engine.spellings``), then the drafter's continuation after them.

        A drafter that raises costs this step its own tokens, nothing more.
        """
        seq = self.seq
        room = seq.max_new_tokens - seq.generated - 1  # leave room for the recovered/bonus token
        k = min(seq.params.spec.max_draft_tokens, room) if seq.params.spec.enabled else 0
        if k <= 0:
            return NO_DRAFT
        prefix: list[int] = []
        if self.grammar is not None and self.draft_forced:
            prefix = self.grammar.forced(self.grammar_state)
            held = self.grammar.held(self.grammar_state)
            if held is not None:
                if self.held_watch is None:
                    self.held_watch = (len(seq.tokens) + len(prefix), held)
                prefix = prefix + self.engine.spellings.get(held, [held])
            prefix = prefix[:k]
        if self.drafter is None or len(prefix) >= k:
            return Draft(prefix, "grammar", forced=len(prefix)) if prefix else NO_DRAFT
        try:
            rest = self.drafter.propose(k - len(prefix), after=prefix) if prefix else self.drafter.propose(k)
        except Exception:
            log.exception("drafter %s failed; no draft from it this step", type(self.drafter).__name__)
            seq.stats.fallback_steps += 1
            rest = NO_DRAFT
        tokens = prefix + rest.tokens[: k - len(prefix)]
        source = rest.source if rest.tokens else "grammar"
        probs = rest.probs  # [len(rest), V] under sampling: the grammar's tokens before them are one-hot
        if probs is not None and prefix:
            one_hot = torch.zeros(len(prefix), probs.shape[-1], dtype=probs.dtype, device=probs.device)
            one_hot[torch.arange(len(prefix), device=probs.device), torch.tensor(prefix, device=probs.device)] = 1.0
            probs = torch.cat([one_hot, probs])
        return Draft(tokens, source, probs, rest.evidence, forced=len(prefix))

    def learn_spelling(self) -> None:
        """Once the text of the look-back's held token is committed, remember how the model wrote it
        (compact JSON's ``":"`` is one canonical token, but the model writes ``":`` then ``"``), so
        later drafts propose the model's spelling. A token merged with the free text teaches nothing."""
        at, held = self.held_watch
        target = self.engine.loaded.token_bytes[held]
        written, end = b"", at
        tokens = self.seq.tokens
        while len(written) < len(target) and end < len(tokens):
            written += self.engine.loaded.token_bytes[tokens[end]]
            end += 1
        if len(written) < len(target):
            return  # not all of it is committed yet
        self.held_watch = None
        if written == target:
            self.engine.spellings[held] = tokens[at:end]

    def draft_plan(self, index: int) -> "_Plan":
        """This sequence's part of the next pass: a prefill chunk, or its uncached token and a draft."""
        seq = self.seq
        started = time.perf_counter()
        uncached = seq.tokens[seq.num_cached :]
        if len(uncached) > self.engine.PREFILL_CHUNK:  # a long prompt: this pass only writes its keys/values
            return _Plan(index, self, NO_DRAFT, PackedRow(self.block, uncached[: self.engine.PREFILL_CHUNK], 0), decoding=False)
        draft = self.draft()
        plan = _Plan(index, self, draft, PackedRow(self.block, uncached, 1), decoding=len(uncached) == 1)
        plan.draft_tokens = list(draft.tokens)
        plan.draft_ms = (time.perf_counter() - started) * 1e3
        return plan

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

    def verify_commit(self, plan: "_Plan", logits: torch.Tensor, pass_ms: float) -> StepOutput:
        """Verify this sequence's draft against its rows of the pass's logits, commit, roll back."""
        seq, params, stats = self.seq, self.seq.params, self.seq.stats
        stats.target_forward_passes += 1
        stats.verify_ms += pass_ms
        stats.draft_ms += plan.draft_ms
        if not plan.row.logits:  # a prefill chunk
            seq.num_cached = self.block.length
            return StepOutput("", [])
        draft, draft_tokens, masks = plan.draft, plan.draft_tokens, plan.masks
        draft_tensor = torch.tensor(draft_tokens, dtype=torch.long, device=self.engine.device)
        if params.greedy:
            accepted, token = verify_greedy(self.pipeline.greedy(logits, draft_tokens, masks), draft_tensor)
        else:
            draft_probs = draft.probs[: len(draft_tokens)] if draft.probs is not None else None
            target_probs = self.pipeline.probs(logits, draft_tokens, masks)
            accepted, token = verify_sampling(target_probs, draft_tensor, draft_probs, self.generator)
        if masks is not None and not bool(masks[accepted].any()):  # rows before it accepted a draft token
            raise GrammarDeadEnd(
                f"The grammar allows no token after {seq.generated + accepted} generated tokens; the schema cannot "
                "be continued with this vocabulary. Simplify the schema."
            )

        # Commit, then roll the keys/values back to the committed tokens (all but the newest one).
        committed_before = len(seq.tokens)
        output = self.commit(draft_tokens[:accepted] + [token])
        self.block.length = seq.num_cached = committed_before + accepted

        # Account.
        forced = plan.forced
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
                self.acceptance.observe(draft.source, draft.evidence, len(draft_tokens) - forced, accepted - forced)
        elif draft.tokens and not draft.forced:  # free evidence: would the first token have been accepted?
            self.acceptance.observe(draft.source, draft.evidence, 1, int(draft.tokens[0] == token))
        if output.finish_reason is not None:
            self.engine.finish_stats(seq)
        return output

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
        if self.held_watch is not None and finish is None:
            self.learn_spelling()
        self.pipeline.observe(new_tokens[:committed])
        if self.drafter is not None and finish is None:
            try:
                self.drafter.observe(new_tokens[:committed])
            except Exception:  # its state is now unknown: decode the rest of this request plainly
                log.exception("drafter %s failed to observe; speculation off for this request", type(self.drafter).__name__)
                self.drafter = None
        seq.finish_reason = finish
        return StepOutput("".join(text), emitted, finish)


class _Plan:
    """One sequence's part of a pass, from its draft to its row of the packed input."""

    def __init__(self, index: int, state: _SequenceState, draft: Draft, row: PackedRow, *, decoding: bool) -> None:
        self.index, self.state, self.draft, self.row, self.decoding = index, state, draft, row, decoding
        self.draft_tokens: list[int] = []
        self.masks: torch.Tensor | None = None
        self.forced = 0
        self.draft_ms = 0.0

    def budget(self) -> RowBudget:
        draft = self.draft
        free = len(self.draft_tokens) - draft.forced
        fixed = len(self.row.tokens) + draft.forced
        if free <= 0 or not self.state.seq.params.spec.adaptive:
            return RowBudget(fixed, 1.0 + draft.forced, max(free, 0), None)
        return RowBudget(fixed, 1.0 + draft.forced, free, self.state.acceptance.rate(draft.source, draft.evidence))

    def cut(self, free: int) -> None:
        """Keep the forced tokens and ``free`` more."""
        before = len(self.draft_tokens)
        self.draft_tokens = self.draft_tokens[: self.draft.forced + free]
        if before and not self.draft_tokens:
            self.state.seq.stats.fallback_steps += 1  # speculation predicted to lose: a plain step

    def finish_draft(self) -> None:
        """Cut the draft at the first token the grammar rejects; append it to the pass's row."""
        if not self.row.logits:
            return
        started = time.perf_counter()
        self.draft_tokens, self.masks = self.state.grammar_walk(self.draft_tokens)
        self.forced = min(self.draft.forced, len(self.draft_tokens))
        self.row.tokens = self.row.tokens + self.draft_tokens
        self.row.logits = len(self.draft_tokens) + 1
        self.draft_ms += (time.perf_counter() - started) * 1e3
