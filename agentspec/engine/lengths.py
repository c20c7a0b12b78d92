"""How many draft tokens to verify: expected tokens per millisecond, from measurements.

Two measured inputs decide every step:
- ``CostModel``: milliseconds of one target pass by number of positions, shared by all requests of an
  engine. Seeded by a calibration at start-up, then the fastest of each shape's latest passes:
  interference (another process, a busy core) only adds time, and an average would let one slow
  verification shut drafting off for good — a shape that looks slow is not chosen again, so it is
  not measured again. The cost need not grow with the positions (kernels change with the row
  count), so a pass of P positions is padded to the cheapest measured shape of at least P positions.
- ``AcceptanceModel`` (``drafting.acceptance``): per request, the probability that a draft token is
  accepted, kept per (source, evidence) bucket with decaying counts and a prior.

With first-token acceptance f and later-token acceptance r, verifying k tokens commits on average
1 + f (1 - r^k) / (1 - r) tokens (the accepted run plus the recovered/bonus token), so the engine
picks the k in 0..K that maximises that over the cost of k + 1 positions. k = 0 is a plain step.

Under load many sequences share one pass (``choose_lengths``): the pass costs what all their
positions together cost, so each sequence's drafts are weighed against the cost they add to
everyone's step. As the batch grows and the device saturates, the extra positions stop paying off
and every K falls to 0 — from the measured cost curve, not a constant — and comes back when load drops.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from ..drafting.acceptance import Acceptance, expected_tokens

__all__ = ["CostModel", "RowBudget", "choose_lengths"]


class CostModel:
    """Measured cost (ms) of a target pass over P positions, P = 1..max_positions."""

    WINDOW = 8  # latest measurements kept per shape: its cost is the fastest of them

    def __init__(self, max_positions: int) -> None:
        self.max_positions = max_positions
        self._latest: list[deque[float]] = [deque(maxlen=self.WINDOW) for _ in range(max_positions + 1)]
        self._ms: list[float | None] = [None] * (max_positions + 1)  # per shape: min(_latest), or None
        # What each further sequence in a pass adds (its attention call per layer, its logits rows),
        # measured at calibration. The curve itself is kept for one sequence, so every shape stays
        # comparable whichever batches it was measured in.
        self.segment_ms = 0.0
        # effective_cost by positions, worked out when first asked after a shape's cost changed: a step
        # asks for it once per draft length it weighs, per source, per sequence
        self._effective: dict[int, float] = {}

    def copy_from(self, other: "CostModel") -> None:
        """Take ``other``'s measurements (of the shapes both have)."""
        for positions in range(1, min(self.max_positions, other.max_positions) + 1):
            self._latest[positions] = deque(other._latest[positions], maxlen=self.WINDOW)
            self._ms[positions] = other._ms[positions]
        self.segment_ms = other.segment_ms
        self._effective.clear()

    def pass_cost(self, positions: int, segments: int = 1) -> float:
        """Expected ms of a pass over ``positions`` positions from ``segments`` sequences, padded."""
        return self.effective_cost(positions) + (segments - 1) * self.segment_ms

    def record(self, positions: int, ms: float, segments: int = 1) -> None:
        if positions > self.max_positions:
            return
        latest = self._latest[positions]
        latest.append(max(ms - (segments - 1) * self.segment_ms, 0.1))
        fastest = min(latest)
        if fastest != self._ms[positions]:  # most passes are not their shape's fastest: nothing changes
            self._ms[positions] = fastest
            self._effective.clear()

    def measured(self, positions: int) -> bool:
        """Whether a pass of this shape has been measured (at calibration or as it ran)."""
        return positions <= self.max_positions and self._ms[positions] is not None

    def cost(self, positions: int) -> float:
        """Measured ms for this shape, or a linear extrapolation from the nearest measured one."""
        measured = [(p, ms) for p, ms in enumerate(self._ms) if ms is not None]
        if not measured:
            return float(positions)  # uncalibrated: cost proportional to positions (never speculates)
        exact = self._ms[positions] if positions <= self.max_positions else None
        if exact is not None:
            return exact
        p, ms = min(measured, key=lambda item: abs(item[0] - positions))
        return ms * max(positions, 1) / max(p, 1) if positions > p else ms

    def best_shape(self, positions: int) -> int:
        """The cheapest measured shape with at least ``positions`` positions (padding is free to add)."""
        candidates = [p for p in range(positions, self.max_positions + 1) if self._ms[p] is not None]
        return min(candidates, key=lambda p: (self._ms[p], p)) if candidates else positions

    def effective_cost(self, positions: int) -> float:
        """The cost of a pass of ``positions`` positions, padded to the cheapest shape that holds them."""
        cost = self._effective.get(positions)
        if cost is None:
            cost = self._effective[positions] = self.cost(self.best_shape(positions))
        return cost


class RowBudget(NamedTuple):
    """One sequence's part of a pass: ``fixed`` positions it runs anyway (uncached tokens and
    grammar-forced drafts, which always verify) committing ``tokens`` on their own, ``available``
    free draft tokens, and their acceptance (None: verify them all, no choice)."""

    fixed: int
    tokens: float
    available: int
    acceptance: Acceptance | None


def choose_lengths(rows: list[RowBudget], costs: CostModel) -> list[int]:
    """Free draft tokens to verify per row, maximising the tokens committed by the whole pass per
    millisecond of it. Draft tokens are added one at a time where they gain the most (each row's gains
    shrink with k), and the best total along the way is kept (the cost curve need not be monotonic)."""
    lengths = [0 if row.acceptance is not None else row.available for row in rows]
    positions = sum(row.fixed for row in rows) + sum(lengths)
    total = sum(row.tokens for row in rows)

    def gain(i: int) -> float:
        row, k = rows[i], lengths[i]
        assert row.acceptance is not None
        first, rest = row.acceptance
        return expected_tokens(first, k + 1, rest) - expected_tokens(first, k, rest)

    free = [i for i, row in enumerate(rows) if row.acceptance is not None and row.available > 0]
    best, best_rate = list(lengths), total / costs.pass_cost(positions, len(rows))
    while free:
        i = max(free, key=gain)
        total += gain(i)
        lengths[i] += 1
        positions += 1
        if lengths[i] == rows[i].available:
            free.remove(i)
        rate = total / costs.pass_cost(positions, len(rows))
        if rate > best_rate:
            best, best_rate = list(lengths), rate
    return best
