"""N-gram drafting: continue the longest suffix of the text that already occurred in it.

Agents copy: a document answer quotes its source, a code edit repeats most of the code, a tool
call repeats ids from the conversation. Matching the last few tokens against everything earlier in
the prompt and the output finds those continuations for free (no model runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .base import Draft
from .byte_ngrams import ByteNgramIndex

if TYPE_CHECKING:
    from ..model import LoadedModel
    from ..params import GenerationParams

__all__ = ["propose_ngram", "NgramIndex", "NgramDrafter", "ngram_drafter"]


def propose_ngram(tokens: Sequence[int], k: int, *, min_n: int = 1, max_n: int = 4) -> tuple[list[int], int]:
    """Reference algorithm. Returns (draft, matched n).

    For n from ``max_n`` down to ``min_n``: find the most recent earlier occurrence of the last n
    tokens and propose the (up to) k tokens that followed it. Example, k=3::

        tokens = [5, 6, 7, 8, 9, 5, 6]
        suffix [5, 6] occurred at 0..1, followed by [7, 8, 9]  ->  ([7, 8, 9], 2)

    No match (or k == 0) gives ([], 0).
    """
    length = len(tokens)
    if k <= 0:
        return [], 0
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k]), n
    return [], 0


class NgramIndex:
    """Incremental ``propose_ngram``: O(max_n) per appended token and per proposal.

    For each n it maps an n-gram to the position right after its most recent occurrence that ends
    before the last token, i.e. strictly earlier than the current suffix.
    """

    def __init__(self, *, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # n-grams ending just before the newest token
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    self._after[n][tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int, pending: Sequence[int] = ()) -> tuple[list[int], int]:
        """``propose_ngram(tokens + pending, k)``, continuing from occurrences in ``tokens`` only
        (``pending``: tokens already drafted by another source this step)."""
        if k <= 0:
            return [], 0
        text = self.tokens + list(pending) if pending else self.tokens
        length = len(text)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._after[n].get(tuple(text[length - n :]))
            if start is not None:
                return self.tokens[start : start + k], n
        return [], 0


class NgramDrafter:
    """The prompt-and-output n-gram drafter (``source="ngram"``).

    Given the model's ``loaded`` vocabulary it also matches across token boundaries
    (``byte_ngrams.ByteNgramIndex``) when that covers more of the last tokens than a token n-gram does;
    the evidence is the number of last tokens the match covers either way.
    """

    source = "ngram"

    def __init__(self, *, min_n: int = 1, max_n: int = 4, loaded: LoadedModel | None = None) -> None:
        self.min_n, self.max_n, self.loaded = min_n, max_n, loaded
        self.index, self.byte_ngrams = self._empty_indexes()

    def _empty_indexes(self) -> tuple[NgramIndex, ByteNgramIndex | None]:
        byte_ngrams = None
        if self.loaded is not None:
            tokenizer = self.loaded.tokenizer
            byte_ngrams = ByteNgramIndex(self.loaded.token_bytes, lambda text: tokenizer.encode(text, add_special_tokens=False), max_n=self.max_n)
        return NgramIndex(min_n=self.min_n, max_n=self.max_n), byte_ngrams

    def reset(self, prompt: Sequence[int]) -> None:
        self.index, self.byte_ngrams = self._empty_indexes()
        self.index.extend(prompt)
        if self.byte_ngrams is not None:
            self.byte_ngrams.extend(prompt)

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        tokens, n = self.index.propose(k, after)
        if self.byte_ngrams is not None and n < self.max_n:
            byte_tokens, m = self.byte_ngrams.propose(k, after, longer_than=max(n, self.min_n - 1))
            if byte_tokens:
                tokens, n = byte_tokens, m
        return Draft(tokens=tokens, source=self.source, evidence=n)

    def observe(self, committed: Sequence[int]) -> None:
        self.index.extend(committed)
        if self.byte_ngrams is not None:
            self.byte_ngrams.extend(committed)


def ngram_drafter(params: GenerationParams, loaded: LoadedModel | None = None) -> NgramDrafter | None:
    """The n-gram drafter a request's settings ask for; None when it does not speculate. With the
    model's ``loaded`` vocabulary it also copies text whose token boundaries moved."""
    spec = params.spec
    if not spec.speculates or "ngram" not in spec.sources:
        return None
    return NgramDrafter(min_n=spec.ngram_min, max_n=spec.ngram_max, loaded=loaded)
