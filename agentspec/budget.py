"""How many draft tokens to verify: expected tokens per millisecond, from measurements.

Two measured inputs decide every step:
- ``CostModel``: milliseconds of one target pass by number of positions, shared by all requests of an
  engine. Seeded by a calibration at start-up and tracked with an exponential moving average. The
  cost is not monotonic on every device (on a 2-core CPU, 2-3 positions cost more than 4-9), so a
  pass of P positions is padded to the cheapest measured shape of at least P positions.
- ``AcceptanceModel``: per request, the probability that a draft token is accepted, kept per
  (source, evidence) bucket with decaying counts and a prior, so it follows the text as it changes.

With per-token acceptance a, verifying k tokens commits on average (1 - a^(k+1)) / (1 - a) tokens
(the accepted run plus the recovered/bonus token), so the engine picks the k in 0..K that maximises
that over the cost of k + 1 positions. k = 0 is a plain decoding step.
"""

from __future__ import annotations

__all__ = ["CostModel", "AcceptanceModel", "choose_draft_length", "expected_tokens"]


class CostModel:
    """Measured cost (ms) of a target pass over P positions, P = 1..max_positions."""

    SMOOTHING = 0.2  # weight of a new measurement in the moving average

    def __init__(self, max_positions: int) -> None:
        self.max_positions = max_positions
        self._ms: list[float | None] = [None] * (max_positions + 1)

    def record(self, positions: int, ms: float) -> None:
        if positions > self.max_positions:
            return
        old = self._ms[positions]
        self._ms[positions] = ms if old is None else old + self.SMOOTHING * (ms - old)

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
        return self.cost(self.best_shape(positions))


class AcceptanceModel:
    """Per-token acceptance probability per (source, evidence) bucket, with decay and a prior."""

    DECAY = 0.9  # weight of older observations after each new one
    PRIOR_WEIGHT = 2.0  # pseudo-trials behind the prior
    MAX_EVIDENCE = 8  # evidence levels kept apart; stronger evidence shares the top bucket

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], tuple[float, float]] = {}

    @classmethod
    def _bucket(cls, source: str, evidence: int) -> tuple[str, int]:
        return source, min(max(evidence, 1), cls.MAX_EVIDENCE)

    @staticmethod
    def prior(evidence: int) -> float:
        """Acceptance before any observation: 0.3 for a 1-token match, +0.1 per matched token, at most 0.8."""
        return min(0.2 + 0.1 * evidence, 0.8)

    def rate(self, source: str, evidence: int) -> float:
        bucket = self._bucket(source, evidence)
        accepted, trials = self._counts.get(bucket, (0.0, 0.0))
        prior = self.prior(bucket[1])
        return (accepted + prior * self.PRIOR_WEIGHT) / (trials + self.PRIOR_WEIGHT)

    def observe(self, source: str, evidence: int, drafted: int, accepted: int) -> None:
        """``drafted`` tokens were verified and the first ``accepted`` kept (a run ends at a rejection)."""
        if drafted <= 0:
            return
        bucket = self._bucket(source, evidence)
        old_accepted, old_trials = self._counts.get(bucket, (0.0, 0.0))
        trials = min(accepted + 1, drafted)
        self._counts[bucket] = (old_accepted * self.DECAY + accepted, old_trials * self.DECAY + trials)


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens committed by a step verifying k drafts with per-token acceptance ``acceptance``."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def choose_draft_length(available: int, acceptance: float, costs: CostModel) -> int:
    """The k in 0..available with the most expected tokens per millisecond (0 = plain step)."""
    best_k, best_rate = 0, 1.0 / costs.effective_cost(1)
    for k in range(1, available + 1):
        rate = expected_tokens(acceptance, k) / costs.effective_cost(k + 1)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
