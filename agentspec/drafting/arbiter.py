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
sampling a lower bound). A source that is predicted to lose is still tried every
``EXPLORE_EVERY`` steps, so one bad stretch does not silence it for the rest of the request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from ..budget import AcceptanceModel, CostModel, expected_tokens
from .base import NO_DRAFT, Draft, Drafter, common_prefix

__all__ = ["ArbiterDrafter"]

# A source cheaper than this per token (a lookup: n-grams, the suffix cache) is always run and judged
# by its actual draft; predicting it from its average acceptance would silence a long, sure match
# because short ones failed before.
CHEAP_DRAFT_MS = 0.5


class _Source:
    """A drafter and what the arbiter measured about it."""

    WINDOW = 8  # recent timings kept; their minimum is the cost (interference only adds time)

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = getattr(drafter, "source", type(drafter).__name__)
        # ms per drafted token: ~0 for lookups, one forward for a model (its catch-up included)
        self.timings: deque[float] = deque(maxlen=self.WINDOW)
        self.proposal: Draft | None = None  # this step's proposal, if it ran

    def draft_ms(self, k: int) -> float:
        """Predicted cost of drafting k tokens; an unmeasured source is assumed free (so it gets tried)."""
        return min(self.timings, default=0.0) * k

    def record(self, ms: float, tokens: int) -> None:
        self.timings.append(ms / max(tokens, 1))


class ArbiterDrafter:
    """A ``Drafter`` over ``sources`` (cheapest first) that returns the draft with the most expected
    tokens per millisecond, or no draft when a plain step is predicted to be faster.

    costs: the engine's verification ``CostModel`` (ms per target pass by positions).
    """

    EXPLORE_EVERY = 16  # steps between forced tries of a source predicted to lose

    def __init__(
        self,
        sources: Sequence[Drafter],
        costs: CostModel,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.sources = [_Source(d) for d in sources]
        self.costs = costs
        self.clock = clock  # seconds; tests pass a fake one
        self.acceptance = AcceptanceModel()  # per (source, evidence): scores an actual draft
        self.by_source = AcceptanceModel()  # per source: predicts a draft before running its source
        self.steps = 0
        self.after = 0  # tokens another source (the grammar) drafted ahead this step
        self.chosen: str | None = None  # source of the last returned draft (for tests and logs)

    def reset(self, prompt: Sequence[int]) -> None:
        for source in self.sources:
            source.drafter.reset(prompt)
            source.proposal = None
        self.acceptance, self.by_source = AcceptanceModel(), AcceptanceModel()
        self.steps = 0

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        self.steps += 1
        self.after = len(after)
        explore = self.steps % self.EXPLORE_EVERY == 0
        best, best_rate = NO_DRAFT, 1.0 / self.costs.effective_cost(1)  # a plain step
        for source in self.sources:
            source.proposal = None
            if k <= 0:
                continue
            length = k
            if source.draft_ms(1) > CHEAP_DRAFT_MS:  # costly to run: first predict whether it can win
                first, rest = self.by_source.rate(source.name, 1)
                length, rate = self._best_length(source, k, first, rest)
                if length == 0 or (rate <= best_rate and not explore):
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
                best, best_rate = _cut(draft, cut), rate
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


def _cut(draft: Draft, length: int) -> Draft:
    if length >= len(draft.tokens):
        return draft
    probs = draft.probs[:length] if draft.probs is not None else None
    return Draft(
        draft.tokens[:length],
        draft.source,
        probs,
        draft.evidence,
        min(draft.forced, length),
    )

