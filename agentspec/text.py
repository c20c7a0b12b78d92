"""Tokens → text: the byte table, UTF-8-safe incremental decoding, and stop strings that never leak.

Two guarantees the stream relies on:
- ``TokenDecoder`` never returns half a character: bytes of a split character wait for the rest.
- ``StopMatcher`` never releases text that could still turn out to be the start of a stop string,
  so emitted text is never retracted.
"""

from __future__ import annotations

import codecs
from functools import lru_cache
from typing import Any, Iterable

__all__ = ["token_bytes_table", "TokenDecoder", "StopMatcher"]


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character → byte map of byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in visible}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(code): b for b, code in chars.items()}


@lru_cache(maxsize=1)
def _byte_level_translation() -> dict[int, int]:
    """``str.translate``'s table from the stand-in characters to the bytes they stand for (as
    characters 0-255), and the characters 0-255 that stand for nothing to U+FFFF: a piece translates
    to Latin-1 exactly when it is all stand-ins."""
    alphabet = _byte_level_alphabet()
    return {code: 0xFFFF for code in range(256) if chr(code) not in alphabet} | {ord(char): byte for char, byte in alphabet.items()}


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = repr(backend.decoder)  # its components by name (Sequence([ByteFallback(), ...])), without serialising the vocabulary
        if "ByteLevel" in decoder:
            return "byte_level"
        if "ByteFallback" in decoder or "▁" in decoder:
            return "sentencepiece"
    return "generic"


def token_bytes_table(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """The exact bytes each token id contributes to the text; special tokens contribute none.

    ``vocab_size`` is the model's output size, which may exceed the tokenizer's (padded vocabularies);
    ids the tokenizer does not know map to ``b""``.
    """
    kind = _decoder_kind(tokenizer)
    translation = _byte_level_translation()
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    table: list[bytes] = []
    for token_id, piece in enumerate(pieces):
        if piece is None or token_id in special:
            table.append(b"")
        elif token_id in added:
            table.append(added[token_id].content.encode())
        elif kind == "byte_level" and (stood := _stood_for(piece, translation)) is not None:
            table.append(stood)
        elif kind == "sentencepiece" and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table.append(bytes([int(piece[3:5], 16)]))
        elif kind == "sentencepiece":
            table.append(piece.replace("▁", " ").encode())
        else:
            table.append(tokenizer.convert_tokens_to_string([piece]).encode())
    table.extend(b"" for _ in range(vocab_size - len(table)))
    return table


def _stood_for(piece: str, translation: dict[int, int]) -> bytes | None:
    """The bytes a byte-level piece stands for; None where a character of it stands for none."""
    try:
        return piece.translate(translation).encode("latin-1")
    except UnicodeEncodeError:
        return None


class TokenDecoder:
    """Incremental detokenizer: feed token ids, get back only complete characters."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, token_ids: Iterable[int]) -> str:
        return self._utf8.decode(b"".join(self._token_bytes[t] for t in token_ids))

    def flush(self) -> str:
        """At the end of a response: whatever bytes are left, with U+FFFD for an unfinished character."""
        return self._utf8.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text and holds back any tail that could still become one.

    >>> m = StopMatcher(["\\nUser:"])
    >>> m.feed("Hello\\nUs")       # "\\nUs" may be the start of "\\nUser:" -> held back
    ('Hello', False)
    >>> m.feed("er: hi")          # stop found: text before it is released, decoding stops
    ('', True)
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        if not self.stops:
            return text, False
        buffer = self._held + text
        # (end, start) of each stop's first occurrence: the stop completed first wins, as it would
        # token by token; among stops completed at once, the one starting earlier
        hits = [(i + len(s), i) for s in self.stops if (i := buffer.find(s)) >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)[1]], True
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:n]):
                    hold = n
                    break
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end of a response that did not stop on a string: release what was held back."""
        held, self._held = self._held, ""
        return held
