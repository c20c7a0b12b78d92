"""Suffix drafting: continue the current text the way an *earlier response* continued it.

Agents repeat themselves across requests: the same tool called with the same argument layout, the
same answer template, the same boilerplate, in requests whose prompts do not contain the earlier
outputs. ``SuffixCache`` keeps the outputs of finished requests (per client, bounded, least recently
used documents evicted first); ``SuffixDrafter`` matches the last few tokens of the current request
against them and proposes what followed there.

Each cached document is an ``NgramIndex`` (the n-gram drafter's incremental index), queried with
the current text's suffix as its ``pending`` tokens: the longest match over all documents wins, the
most recently used document on a tie.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import count

from .base import Draft
from .ngram import NgramIndex

__all__ = ["SuffixCache", "SuffixDrafter"]


class SuffixCache:
    """Earlier outputs, at most ``max_tokens`` tokens in all. Thread-safe.

    min_n/max_n: the shortest and longest suffix matched (a 1-token match across requests is
      mostly noise, so 2 by default; 8 as the n-gram drafter, to find the right place to copy from).
    """

    def __init__(self, *, max_tokens: int = 16384, min_n: int = 2, max_n: int = 8) -> None:
        if max_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"SuffixCache needs max_tokens >= 1 and 1 <= min_n <= max_n, got {max_tokens}, {min_n}, {max_n}.")
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self._documents: OrderedDict[int, NgramIndex] = OrderedDict()  # oldest use first
        self._ids = count()
        self._size = 0
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one finished output (its last ``max_tokens`` tokens); evict the least recently used."""
        tokens = list(tokens)[-self.max_tokens :]
        if len(tokens) <= self.min_n:  # too short to continue anything
            return
        document = NgramIndex(min_n=self.min_n, max_n=self.max_n)
        document.extend(tokens)
        with self._lock:
            self._documents[next(self._ids)] = document
            self._size += len(tokens)
            while self._size > self.max_tokens:
                _, evicted = self._documents.popitem(last=False)
                self._size -= len(evicted.tokens)

    def lookup(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the end of ``context``,
        and the matched length n (``([], 0)`` when nothing matches). Marks the document used."""
        if k <= 0:
            return [], 0
        suffix = list(context[-self.max_n :])
        best: tuple[list[int], int] = ([], 0)
        best_id = None
        with self._lock:
            for doc_id in reversed(self._documents):  # most recently used first: it wins ties
                tokens, n = self._documents[doc_id].propose(k, suffix)
                if n > best[1] and n <= len(suffix) and tokens:  # n > len(suffix) would straddle the document's end
                    best, best_id = (tokens, n), doc_id
                    if n == self.max_n:
                        break
            if best_id is not None:
                self._documents.move_to_end(best_id)
        return best

    def clear(self) -> None:
        """Forget every earlier output."""
        with self._lock:
            self._documents.clear()
            self._size = 0

    @property
    def size(self) -> int:
        """Tokens held."""
        return self._size

    def __len__(self) -> int:
        return len(self._documents)


class SuffixDrafter:
    """Drafts from a shared ``SuffixCache`` (``source="suffix"``, evidence = the matched length).

    It does not add its own output to the cache: observe is not called on a request's last step, so
    the owner adds ``seq.output_ids`` when the request finishes (the client's ``on_finished``).
    """

    source = "suffix"

    def __init__(self, cache: SuffixCache) -> None:
        self.cache = cache
        self.tail: list[int] = []  # the last max_n committed tokens

    def reset(self, prompt: Sequence[int]) -> None:
        self.tail = list(prompt[-self.cache.max_n :])

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        tokens, n = self.cache.lookup(self.tail + list(after), k)
        return Draft(tokens=tokens, source=self.source, evidence=n)

    def observe(self, committed: Sequence[int]) -> None:
        self.tail = (self.tail + list(committed))[-self.cache.max_n :]
