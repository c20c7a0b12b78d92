"""The drafter contract: every draft source implements these three methods, nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = ["Draft", "Drafter", "NO_DRAFT", "common_prefix"]


@dataclass(frozen=True, slots=True)
class Draft:
    """Proposed continuation of the committed tokens.

    tokens: up to K proposed token ids; source: "grammar" | "ngram" | "suffix" | "model";
    evidence: how strong the proposal is on the drafter's own scale (n-gram: the matched length).
      The engine keeps acceptance statistics per (source, evidence) to decide how much to verify.
    forced: how many leading tokens come from the grammar: the text it forces (always verifies), then
      the token its look-back held back, as the model last wrote it (nearly always verifies). The
      engine's budget never cuts them.
    """

    tokens: list[int]
    source: str
    evidence: int = 0
    forced: int = 0

    def cut(self, length: int) -> "Draft":
        """The first ``length`` tokens of this draft (its forced count cut alike)."""
        if length >= len(self.tokens):
            return self
        return Draft(self.tokens[:length], self.source, self.evidence, min(self.forced, length))


NO_DRAFT = Draft(tokens=[], source="none")


class Drafter(Protocol):
    """One instance per request. The engine calls, in order:
    ``reset(prompt)``, then per step ``propose(k)`` followed by ``observe(committed)``.
    A drafter that raises costs its request one plain step and nothing else.
    """

    def reset(self, prompt: Sequence[int]) -> None:
        """Start over from the prompt's token ids."""

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        """Up to ``k`` tokens that may follow everything observed so far, then ``after`` (tokens
        another source, the grammar, already drafted ahead in this step)."""

    def observe(self, committed: Sequence[int]) -> None:
        """Tokens committed since the last call (verified; never rolled back)."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (how much of a proposal the text confirmed)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
