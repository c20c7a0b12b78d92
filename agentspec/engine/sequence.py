"""One request's decoding: its data (``Sequence``), and the engine-side state that drafts and commits.

``Sequence`` is plain data the runtime and client read; ``SequenceState`` holds what only the engine
touches: the keys/values block, the logits pipeline, the sampling noise keys, the drafters, the detokenizer
and the stop rules. The engine asks a state for its draft (``draft``), and hands it each verdict to
commit (``commit``) and account (``account``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..drafting import NO_DRAFT, Draft, Drafter
from ..drafting.grammar import GrammarDrafter, Spellings
from ..params import GenerationParams
from ..text import StopMatcher, TokenDecoder
from ..types import SpecStats
from .kv import KVBlock, KVLayout
from ..drafting.acceptance import AcceptanceModel
from .lengths import RowBudget
from ..logits import LogitsPipeline
from ..sampling import fresh_seed, position_keys

__all__ = ["GrammarDeadEnd", "Sequence", "SequenceState", "StepOutput"]

log = logging.getLogger("agentspec.engine")


class GrammarDeadEnd(RuntimeError):
    """No token is allowed where decoding must continue: the request fails (EngineError), no other."""


@dataclass(slots=True)
class StepOutput:
    """What one step commits: new verified text and token ids, the finish reason if it ended, and
    whether the reply is a tool call (known once its opening names a tool, under ``tool_choice="auto"``;
    until then nothing is emitted: the undecided text is held back)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    is_call: bool = False


@dataclass(eq=False)
class Sequence:
    """One request's decoding state. Owned by the worker thread."""

    prompt_ids: list[int]
    params: GenerationParams  # a sampled request's seed is always set (drawn if the caller gave none)
    max_new_tokens: int
    grammar: Any = None  # structured output (Grammar, RepeatedGrammar, AutoCallGrammar): every token is checked against it
    submitted_at: float = field(default_factory=time.perf_counter)
    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex[:20]}")

    tokens: list[int] = field(init=False)  # prompt + committed output (stop token included)
    output_ids: list[int] = field(default_factory=list, init=False)  # emitted tokens (no stop token)
    num_cached: int = field(default=0, init=False)  # tokens whose keys/values are in the engine's block
    finish_reason: str | None = field(default=None, init=False)
    stats: SpecStats = field(default_factory=SpecStats, init=False)
    first_token_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if not self.params.greedy and self.params.seed is None:
            # sampled without a seed: draw one now, so the request log can reproduce the run
            self.params = replace(self.params, seed=fresh_seed())

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    def finish_stats(self) -> None:
        """Fill in the derived statistics once the sequence has ended (however it ended)."""
        stats, now = self.stats, time.perf_counter()
        stats.requests = 1
        stats.output_tokens = self.generated
        stats.derive()
        if self.first_token_at is not None:  # a request cancelled before its first token has no TTFT
            stats.ttft_ms = (self.first_token_at - self.submitted_at) * 1e3
            stats.tpot_ms = (now - self.first_token_at) * 1e3 / (self.generated - 1) if self.generated > 1 else 0.0


class SequenceState:
    """The engine-side helpers of one sequence: cache, logits pipeline, drafters, text, stops."""

    def __init__(
        self,
        seq: Sequence,
        *,
        layout: KVLayout,
        vocab_size: int,
        device: torch.device,
        token_bytes: list[bytes],
        stop_token_ids: frozenset[int],
        drafter: Drafter | None,
        spellings: Spellings,
    ) -> None:
        self.seq = seq
        params = seq.params
        self.block = KVBlock(layout)
        self.pipeline = LogitsPipeline(params, vocab_size, device)
        self.pipeline.observe(seq.prompt_ids)
        self.acceptance = AcceptanceModel()
        self.decoder = TokenDecoder(token_bytes)
        self.stopper = StopMatcher(params.stop)
        self.stop_token_ids = stop_token_ids
        self.drafter = drafter
        if drafter is not None:
            drafter.reset(seq.prompt_ids)
        self.grammar: GrammarDrafter | None = None
        if seq.grammar is not None:
            self.grammar = GrammarDrafter(seq.grammar, spellings, proposes="grammar" in params.spec.sources)
        self._undecided: tuple[list[str], list[int]] = ([], [])  # text and ids held back until "auto" decides

    # -- draft --------------------------------------------------------------------------------------

    def draft(self) -> tuple[Draft, list[int]]:
        """This step's draft and the grammar states along it ([] without a grammar).

        The grammar's tokens come first (forced text, then the held token), then the drafter's
        continuation after them; the whole draft is cut at the first token the grammar rejects.
        A drafter that raises costs this step its own tokens, nothing more.
        """
        seq = self.seq
        room = seq.max_new_tokens - seq.generated - 1  # leave room for the recovered/bonus token
        k = min(seq.params.spec.max_draft_tokens, room) if seq.params.spec.speculates else 0
        forced = self.grammar.propose(k) if self.grammar is not None else NO_DRAFT
        draft = forced
        if self.drafter is not None and len(forced.tokens) < k:
            try:
                rest = self.drafter.propose(k - len(forced.tokens), after=forced.tokens) if forced.tokens else self.drafter.propose(k)
            except Exception:
                log.exception("drafter %s failed; no draft from it this step", type(self.drafter).__name__)
                seq.stats.fallback_steps += 1
                rest = NO_DRAFT
            if rest.tokens:
                draft = Draft(forced.tokens + rest.tokens, rest.source, rest.evidence, forced=len(forced.tokens))
        if self.grammar is None:
            return draft.cut(k), []
        states = self.grammar.walk(draft.tokens[:k])
        return draft.cut(len(states) - 1), states

    def budget(self, draft: Draft, fixed: int) -> RowBudget:
        """The draft's part in choosing the pass's draft lengths: ``fixed`` positions run anyway
        (uncached tokens and forced drafts); its free tokens only if they pay."""
        free = len(draft.tokens) - draft.forced
        fixed += draft.forced
        if free <= 0 or not self.seq.params.spec.adaptive:
            return RowBudget(fixed, 1.0 + draft.forced, max(free, 0), None)
        return RowBudget(fixed, 1.0 + draft.forced, free, self.acceptance.rate(draft.source, draft.evidence))

    # -- verify -------------------------------------------------------------------------------------

    def target(self, logits: torch.Tensor, draft: Draft, masks: torch.Tensor | None) -> torch.Tensor:
        """This sequence's rows of the pass through its logits pipeline: [K+1] greedy tokens, or
        [K+1, V] sampling distributions."""
        if self.seq.params.greedy:
            return self.pipeline.greedy(logits, draft.tokens, masks)
        return self.pipeline.probs(logits, draft.tokens, masks)

    def noise_keys(self, rows: int) -> list[int]:
        """The sampling noise keys of ``rows`` rows verified from the next output position on."""
        return position_keys(self.seq.params.seed, range(self.seq.generated, self.seq.generated + rows))

    # -- commit -------------------------------------------------------------------------------------

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
            if token in self.stop_token_ids:
                finish = "stop"
                break
            seq.output_ids.append(token)
            emitted.append(token)
            piece, hit = self.stopper.feed(self.decoder.decode((token,)))
            text.append(piece)
            if hit:
                finish = "stop"
                break
            if self.grammar is not None and self.grammar.advance(token):
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
        kept = new_tokens[:committed]
        self.pipeline.observe(kept)
        if finish is None:
            self._observe(kept)
        seq.finish_reason = finish
        held_text, held_ids = self._undecided
        if finish is None and self.grammar is not None and self.grammar.grammar.undecided(self.grammar.state):
            held_text.extend(text)
            held_ids.extend(emitted)
            return StepOutput("", [], None, False)
        if held_ids or held_text:  # decided (or ended): what was held back comes first
            text, emitted = held_text + text, held_ids + emitted
            self._undecided = ([], [])
        return StepOutput("".join(text), emitted, finish, self.is_call)

    @property
    def wants_features(self) -> bool:
        """Whether the drafter reads the target's features (a draft head): the pass then keeps them."""
        return bool(getattr(self.drafter, "wants_features", False))

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features [n, H] of committed positions ``start`` .. ``start + n - 1``."""
        if self.drafter is None:
            return
        try:
            self.drafter.observe_features(start, features)  # type: ignore[attr-defined]
        except Exception:  # as a failed observe: decode the rest of this request plainly
            log.exception("drafter %s failed to observe features; speculation off for this request", type(self.drafter).__name__)
            self.drafter = None

    def _observe(self, committed: list[int]) -> None:
        if self.grammar is not None:
            self.grammar.observe(committed)
        if self.drafter is not None:
            try:
                self.drafter.observe(committed)
            except Exception:  # its state is now unknown: decode the rest of this request plainly
                log.exception("drafter %s failed to observe; speculation off for this request", type(self.drafter).__name__)
                self.drafter = None

    @property
    def is_call(self) -> bool:
        """Whether the reply is a tool call: always when forced, or once ``auto`` opened one."""
        mode = self.seq.params.tool_mode
        return mode == "forced" or (mode == "auto" and self.grammar is not None and self.grammar.grammar.is_call(self.grammar.state))

    # -- account ------------------------------------------------------------------------------------

    def account(self, proposed: Draft, draft: Draft, verdict: tuple[int, int] | None, committed_before: int, draft_ms: float, pass_ms: float) -> None:
        """Record one step: its statistics, and what it says about the drafts' acceptance.

        proposed: the draft before the pass's draft lengths cut it; draft: the one verified;
        verdict: (accepted, recovered or bonus token), None for a prefill chunk.
        """
        seq, stats = self.seq, self.seq.stats
        stats.target_forward_passes += 1
        stats.verify_ms += pass_ms
        stats.draft_ms += draft_ms
        if verdict is None:
            return
        accepted, token = verdict
        forced = draft.forced
        if draft.tokens:
            kept = min(accepted, len(seq.tokens) - committed_before)  # a stop may cut the accepted run
            stats.drafted_tokens += len(draft.tokens)
            stats.accepted_tokens += kept
            by_source = stats.accepted_by_source
            if forced:
                by_source["grammar"] = by_source.get("grammar", 0) + min(kept, forced)
            if kept > forced:
                by_source[draft.source] = by_source.get(draft.source, 0) + kept - forced
            stats.rollbacks += accepted < len(draft.tokens)
            if len(draft.tokens) > forced and accepted >= forced:  # learn about the unforced part only
                self.acceptance.observe(draft.source, draft.evidence, len(draft.tokens) - forced, accepted - forced)
        elif proposed.tokens:
            stats.fallback_steps += 1  # speculation predicted to lose: a plain step
            if not proposed.forced:  # free evidence: would the first token have been accepted?
                self.acceptance.observe(proposed.source, proposed.evidence, 1, int(proposed.tokens[0] == token))
