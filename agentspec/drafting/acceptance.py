"""How likely a draft is to be accepted, learned per request, and what a draft of k tokens yields.

``AcceptanceModel`` keeps, per (source, evidence) bucket, decaying counts of accepted draft tokens
with a prior, so it follows the text as it changes. ``expected_tokens`` turns acceptance into the mean
tokens a step commits; the engine's draft lengths (``engine.lengths``) and the arbiter weigh that
against measured costs.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Acceptance", "AcceptanceModel", "expected_tokens"]


class Acceptance(NamedTuple):
    """Acceptance probabilities of a draft: its first token, and each later token given the previous."""

    first: float
    rest: float


class AcceptanceModel:
    """Acceptance per (source, evidence) bucket, with decay and a prior.

    Two probabilities per bucket, because drafts copy: whether the first token is right is uncertain
    (did the text go back to copying here?), but once it is, the following ones usually are too.
    """

    DECAY = 0.9  # weight of older observations after each new one
    PRIOR_WEIGHT = 2.0  # pseudo-trials behind the prior
    MAX_EVIDENCE = 8  # evidence levels kept apart; stronger evidence shares the top bucket
    PRIOR_REST = 0.7  # a copied run, once started, usually goes on

    def __init__(self) -> None:
        # bucket -> [first accepted, first trials, rest accepted, rest trials]
        self._counts: dict[tuple[str, int], list[float]] = {}

    @classmethod
    def _bucket(cls, source: str, evidence: int) -> tuple[str, int]:
        return source, min(max(evidence, 1), cls.MAX_EVIDENCE)

    @staticmethod
    def prior(evidence: int) -> float:
        """First-token acceptance before any observation: 0.3 for a 1-token match, +0.1 per token, at most 0.8."""
        return min(0.2 + 0.1 * evidence, 0.8)

    def rate(self, source: str, evidence: int) -> Acceptance:
        bucket = self._bucket(source, evidence)
        first_acc, first_trials, rest_acc, rest_trials = self._counts.get(bucket, (0.0, 0.0, 0.0, 0.0))
        weight = self.PRIOR_WEIGHT
        return Acceptance(
            first=(first_acc + self.prior(bucket[1]) * weight) / (first_trials + weight),
            rest=(rest_acc + self.PRIOR_REST * weight) / (rest_trials + weight),
        )

    def observe(self, source: str, evidence: int, drafted: int, accepted: int) -> None:
        """``drafted`` tokens were verified and the first ``accepted`` kept (a run ends at a rejection)."""
        if drafted <= 0:
            return
        counts = self._counts.setdefault(self._bucket(source, evidence), [0.0, 0.0, 0.0, 0.0])
        counts[:] = [c * self.DECAY for c in counts]
        counts[0] += accepted > 0
        counts[1] += 1
        if accepted > 0:  # later tokens: accepted - 1 successes, then the rejection if there was one
            counts[2] += accepted - 1
            counts[3] += min(accepted, drafted - 1)


def expected_tokens(first: float, k: int, rest: float | None = None) -> float:
    """Mean tokens committed by a step verifying k drafts: the accepted run plus one token.

    The first draft token is accepted with probability ``first``, each later one (given the previous)
    with ``rest`` (default: ``first``, i.e. independent tokens: (1 - a^(k+1)) / (1 - a)).
    """
    rest = first if rest is None else rest
    if k == 0:
        return 1.0
    run = k if rest >= 1.0 else (1.0 - rest**k) / (1.0 - rest)  # 1 + rest + ... + rest^(k-1)
    return 1.0 + first * run
