"""Copying text whose token boundaries moved: n-gram matching on bytes, drafts re-tokenized.

Token n-grams miss a copy when the same text is tokenized differently in the output than in the
prompt. A JSON string value starts right after ``"``, so the model writes ``maria.garcia@...`` as
``mar|ia|.|g|arc|ia`` where the prompt had `` maria`` (one token, with its space): no token of the
value ever occurred before, and the token drafter proposes nothing for the whole value. Matching the
*bytes* of the last tokens anywhere in the earlier text finds the copy, and tokenizing the bytes that
followed gives the draft. Example (bytes shown as text)::

    text  = ... 'to maria.garcia@example.com with' ... '{"to":"' 'mar'
    key   = 'mar'  (the last token's bytes; found inside ' maria')
    after = 'ia.garcia@example.com with ...'  ->  tokens  ia | . | g | arc | ia | @ | example | ...

Tokenization is context-sensitive (BPE merges run over a whole pre-token), so the continuation is
tokenized together with the last token's bytes and the draft is what follows that token; when the
tokenizer would split those bytes differently, the continuation is tokenized alone. A draft is only
a proposal: verification decides, so a re-tokenization the model would not produce costs acceptance,
never correctness.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

__all__ = ["ByteNgramIndex", "SEPARATOR"]

SEPARATOR = b"\xff"  # stands for a special token (never in UTF-8 text): a copy neither matches nor runs across it
BYTES_PER_TOKEN = 6  # continuation bytes read per draft token wanted (English averages about 4)


class ByteNgramIndex:
    """The prompt and committed output as one byte string (a special token as ``SEPARATOR``).

    ``propose(k, pending, longer_than)`` matches the bytes of the last m tokens (m from ``max_n``
    down to ``longer_than + 1``; keys shorter than ``min_bytes`` are skipped) at their most recent
    earlier occurrence, at any byte offset, and returns up to ``k`` tokens of what followed, with m.
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        encode: Callable[[str], list[int]],
        *,
        max_n: int = 8,
        min_bytes: int = 3,
    ) -> None:
        self.token_bytes, self.encode = token_bytes, encode
        self.max_n, self.min_bytes = max_n, min_bytes
        self.text = bytearray()
        self.recent: deque[int] = deque(maxlen=max_n)  # the last tokens: a key is made of at most max_n

    def bytes_of(self, token: int) -> bytes:
        return (self.token_bytes[token] if token < len(self.token_bytes) else b"") or SEPARATOR

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.text += self.bytes_of(token)
            self.recent.append(token)

    def propose(self, k: int, pending: Sequence[int] = (), *, longer_than: int = 0) -> tuple[list[int], int]:
        if k <= 0:
            return [], 0
        context = [*self.recent, *pending]
        pieces = [self.bytes_of(token) for token in context]
        for m in range(min(self.max_n, len(context)), longer_than, -1):
            key = b"".join(pieces[len(pieces) - m :])
            if len(key) < self.min_bytes or SEPARATOR in key:
                continue
            # an earlier occurrence with at least one byte after it (excludes the key itself when
            # nothing is pending, since the key then ends the text)
            start = self.text.rfind(key, 0, len(self.text) - 1)
            if start < 0:
                continue
            tokens = self._tokenize_after(start + len(key), context[-1], k)
            if tokens:
                return tokens, m
        return [], 0

    def _tokenize_after(self, offset: int, last: int, k: int) -> list[int]:
        """Up to k whole tokens of the text from ``offset``, as they would follow the token ``last``."""
        window = bytes(self.text[offset : offset + BYTES_PER_TOKEN * (k + 1)])
        cut = window.find(SEPARATOR)
        reaches_end = offset + len(window) >= len(self.text) or cut >= 0
        if cut >= 0:
            window = window[:cut]
        if not window:
            return []
        anchor = self.token_bytes[last]  # plain text: a key holding a special token (SEPARATOR) is skipped
        tokens = self.encode((anchor + window).decode("utf-8", "ignore"))
        if tokens and tokens[0] == last:
            tokens = tokens[1:]
        else:  # the tokenizer merges the last token's bytes with what follows: tokenize the rest alone
            tokens = self.encode(window.decode("utf-8", "ignore"))
        if not reaches_end:
            tokens = tokens[:-1]  # the window may end inside a word: its last token may be cut short
        return tokens[:k]
