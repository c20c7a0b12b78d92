"""The arbiter: one drafter that asks several sources and keeps the draft worth verifying.

Every step, for each source in order (cheapest first: n-gram, suffix, then a draft model):

1. **Predict**, for a source that costs real time to run (a draft model; lookups such as n-grams and
   the suffix cache are always run), the best rate it could reach: expected committed tokens per
   millisecond, ``expected_tokens(f, k, r) / (draft_ms(k) + verify_ms(k + 1))`` maximised over
   k, from the source's measured acceptance (f first token, r later ones) and measured draft cost.
   If that cannot beat the best draft in hand (at first: no draft, a plain step at
   ``1 / verify_ms(1)``), the source is not run: a model drafter never runs when a cheap draft wins.
2. **Propose** (timed) and score the actual draft with the acceptance of its evidence bucket;
   keep it if it beats the best so far, cut to its best length.

``observe`` measures every source that proposed this step, chosen or not: the common prefix of its
proposal and the committed tokens is how much it would have had accepted (greedy: exactly; under
sampling a lower bound). A source that is predicted to lose is still tried now and then, so one bad
stretch does not silence it for good: after 16 steps, then after twice as many each time it is
tried and still loses (at most 256), and again after 16 once it is predicted to win.

What is measured about a costly source — its drafting time and its acceptance — is kept in a
``SourceHistory`` that a client's requests share, so each new request does not pay again to learn
that a draft model does not pay (its first proposal in a request prefills the whole prompt).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .acceptance import AcceptanceModel, expected_tokens
from .base import NO_DRAFT, Draft, Drafter, common_prefix

if TYPE_CHECKING:
    from ..engine.lengths import CostModel

__all__ = ["ArbiterDrafter", "SourceHistory"]

# A source cheaper than this per token (a lookup: n-grams, the suffix cache) is always run and judged
# by its actual draft; predicting it from its average acceptance would silence a long, sure match
# because short ones failed before.
CHEAP_DRAFT_MS = 0.5


class SourceHistory:
    """What the arbiters of one client measured about costly sources, across its requests.

    Per source name: recent drafting times (ms per drafted token; their minimum is the cost, as
    interference only adds time), acceptance (``AcceptanceModel`` by source), and when it is next
    tried while predicted to lose. Used from the engine's thread only.
    """

    WINDOW = 8  # recent timings kept per source

    def __init__(self, explore_every: int = 16, max_explore_every: int = 256) -> None:
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        self.acceptance = AcceptanceModel()
        self.timings: dict[str, deque[float]] = {}
        self.steps = 0  # arbiter steps over all requests
        self._interval: dict[str, int] = {}
        self._next_try: dict[str, int] = {}

    def times(self, name: str) -> deque[float]:
        return self.timings.setdefault(name, deque(maxlen=self.WINDOW))

    def explore_due(self, name: str) -> bool:
        """Whether a source predicted to lose is tried this step."""
        return self.steps >= self._next_try.setdefault(name, self.explore_every)

    def explored(self, name: str) -> None:
        """It was tried while predicted to lose: wait twice as long before the next try."""
        interval = min(2 * self._interval.get(name, self.explore_every // 2), self.max_explore_every)
        self._interval[name] = interval
        self._next_try[name] = self.steps + interval

    def won(self, name: str) -> None:
        """It was predicted to pay: back to trying it soon after it stops paying."""
        self._interval.pop(name, None)
        self._next_try[name] = self.steps + self.explore_every


class _Source:
    """A drafter and what the arbiter measured about it."""

    def __init__(self, drafter: Drafter, history: SourceHistory) -> None:
        self.drafter = drafter
        self.name = getattr(drafter, "source", type(drafter).__name__)
        # ms per drafted token: ~0 for lookups, one forward for a model (its catch-up included)
        self.timings = history.times(self.name)
        self.proposal: Draft | None = None  # this step's proposal, if it ran

    def draft_ms(self, k: int) -> float:
        """Predicted cost of drafting k tokens; an unmeasured source is assumed free (so it gets tried)."""
        return min(self.timings, default=0.0) * k

    def record(self, ms: float, tokens: int) -> None:
        self.timings.append(ms / max(tokens, 1))


class ArbiterDrafter:
    """A ``Drafter`` over ``sources`` (cheapest first) that returns the draft with the most expected
    tokens per millisecond, or no draft when a plain step is predicted to be faster.

    costs: the engine's verification ``CostModel`` (ms per target pass by positions);
    history: what earlier requests measured about costly sources (a client shares one); a new one
      when not given.
    """

    def __init__(
        self,
        sources: Sequence[Drafter],
        costs: CostModel,
        *,
        history: SourceHistory | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.history = history if history is not None else SourceHistory()
        self.sources = [_Source(d, self.history) for d in sources]
        self.costs = costs
        self.clock = clock  # seconds; tests pass a fake one
        self.acceptance = AcceptanceModel()  # per (source, evidence): scores an actual draft
        self.by_source = self.history.acceptance  # per source: predicts a draft before running its source
        self.after = 0  # tokens another source (the grammar) drafted ahead this step
        self.chosen: str | None = None  # source of the last returned draft (for tests and logs)

    @property
    def wants_features(self) -> bool:
        """Whether a source reads the target's features (a draft head)."""
        return any(getattr(source.drafter, "wants_features", False) for source in self.sources)

    def observe_features(self, start: int, features: Any) -> None:
        """The target's features of committed positions, for the sources that read them."""
        for source in self.sources:
            if getattr(source.drafter, "wants_features", False):
                source.drafter.observe_features(start, features)  # type: ignore[attr-defined]

    def reset(self, prompt: Sequence[int]) -> None:
        for source in self.sources:
            source.drafter.reset(prompt)
            source.proposal = None
        self.acceptance = AcceptanceModel()  # what the lookups' evidence is worth differs per request

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        history = self.history
        history.steps += 1
        self.after = len(after)
        best, best_rate = NO_DRAFT, 1.0 / self.costs.effective_cost(1)  # a plain step
        for source in self.sources:
            source.proposal = None
            if k <= 0:
                continue
            length = k
            if source.draft_ms(1) > CHEAP_DRAFT_MS:  # costly to run: first predict whether it can win
                first, rest = self.by_source.rate(source.name, 1)
                length, rate = self._best_length(source, k, first, rest)
                if rate > best_rate:
                    history.won(source.name)
                elif history.explore_due(source.name):
                    history.explored(source.name)
                    length = max(length, 1)
                else:
                    continue  # cannot win: do not even run it
            started = self.clock()
            draft = source.drafter.propose(length, after)
            source.record((self.clock() - started) * 1e3, len(draft.tokens))
            source.proposal = draft
            if not draft.tokens:
                continue
            first, rest = self.acceptance.rate(source.name, draft.evidence)
            # its drafting cost is spent: compare what verifying it yields per verification ms
            cut, rate = self._best_length(source, len(draft.tokens), first, rest, sunk=True)
            if cut and rate > best_rate:
                best, best_rate = draft.cut(cut), rate
        self.chosen = best.source if best.tokens else None
        return best

    def observe(self, committed: Sequence[int]) -> None:
        produced = list(committed)[self.after :]  # what followed the grammar's tokens
        for source in self.sources:
            source.drafter.observe(committed)
            proposal = source.proposal
            if proposal is not None and proposal.tokens and produced:
                drafted = min(len(proposal.tokens), len(produced))
                matched = common_prefix(proposal.tokens, produced)
                # all `drafted` matched but the proposal went on: only those were tested
                self.acceptance.observe(source.name, proposal.evidence, drafted, matched)
                self.by_source.observe(source.name, 1, drafted, matched)
            source.proposal = None
        self.after = 0

    # -- helpers ------------------------------------------------------------------------------------

    def _best_length(
        self,
        source: _Source,
        available: int,
        first: float,
        rest: float,
        sunk: bool = False,
    ) -> tuple[int, float]:
        """The k in 1..available with the most expected tokens per ms, and that rate."""
        best_k, best_rate = 0, 0.0
        for k in range(1, available + 1):
            ms = self.costs.effective_cost(k + 1) + (0.0 if sunk else source.draft_ms(k))
            rate = expected_tokens(first, k, rest) / ms
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

