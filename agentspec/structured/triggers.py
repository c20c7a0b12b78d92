"""``tool_choice="auto"``: free text, or tool calls once the reply's first bytes name a tool (lazy triggers).

Real models open a call in more ways than their chat template shows: Qwen2.5-Coder writes a fenced
```` ```json ```` block or a bare ``{"name": ..., "arguments": ...}``, Llama 3.x a bare object with
``"parameters"`` (often after ``<|python_tag|>``), Mistral sometimes drops ``[TOOL_CALLS]``. A reply
counts as a call when, after optional whitespace, it opens with

    [an opening]  [ws]  ["[" ws]  "{" ws '"name"' ws ":" ws '"' <a tool's name> '"'

where the openings are the fences ```` ```json ```` and ```` ``` ```` plus the family's own marker
(``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``; a marker that is a special token is matched by
its token id). The pattern is matched on the bytes of the tokens as they are committed, whatever the
tokenization: **nothing is masked while the reply is undecided**, so a text answer keeps the model's
own tokens (``auto`` equals ``none`` on it). Once the bytes name a tool, the rest of the call is
forced: the family's arguments key, the tool's arguments (its own compiled grammar, shared by every
opening and cached by the compiler), the closing brace and the opening's closing (fence, tag, list
bracket). A token that straddles the end of the name is continued from its leftover bytes (which may
choose the other spacing). A reply that matches no opening, or names no tool, is text from the first
byte that rules a call out; undecided text is held back by the engine until then (``undecided``).

Where parallel calls are allowed (the family has a separator), a complete call is followed by the
model's choice: an end token, or another call in the same opening (a list goes on with ``", "``),
whose name is then constrained to the tools.

States are ints interned from tuples; ``TEXT`` is -1. The decision is a function of the committed
tokens only, so plain and speculative decoding agree token for token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import regex
import torch

from .formats import ToolFormat
from .grammar import MAX_REGEX_CHARS, States, schema_regex
from .tools import ToolSpec

__all__ = ["AutoCallGrammar", "MAX_UNDECIDED_BYTES", "FENCES", "openings"]

MAX_UNDECIDED_BYTES = 512  # a reply still undecided after this many bytes is text (bounds the held-back text)
FENCES = ("```json", "```")  # fenced blocks, any family
WS = rb"[ \t\r\n]*"
# The family's own markers, by ``ToolFormat.family``; Llama 3.x's is a special token.
MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",)}
CLOSINGS = {"```json": b"\n```", "```": b"\n```", "<tool_call>": b"\n</tool_call>"}
# Hermes 2 Pro's other spelling (llama.cpp's handler takes it): the name in a tag, the arguments alone
# inside, '<function=NAME>{...}</function>' or '<function name="NAME">{...}</function>'.
FUNCTION_TAGS = {"hermes": (b"<function=", b'<function name="')}


def openings(fmt: ToolFormat | None) -> tuple[str, ...]:
    """The openings that may come before a call's ``{`` (besides none at all) for ``fmt``'s family."""
    return (*MARKERS.get(fmt.family, ()), *FENCES) if fmt is not None else FENCES


@dataclass(frozen=True)
class Style:
    """How the reply writes its calls, read from its first call's opening bytes."""

    tool: int  # the call being written (an index into the tools)
    opening: str  # "" (bare), a fence, a marker, or a function tag (no JSON object around the arguments)
    listed: bool  # the calls are items of a JSON list ("[{...}, {...}]")
    spaced: bool  # '"name": "' rather than '"name":"': the fixed text after the name is spaced alike


class AutoCallGrammar:
    """A reply that is text, or tool calls of ``tools`` opened in any of the family's ways.

    compiler: the vocabulary's ``GrammarCompiler``; fmt: the template's family syntax (None: agentspec's
    own ``"arguments"`` key, no marker); parallel: several calls per reply (where the family allows);
    max_chars, build_index: each tool's arguments grammar bounded and built as ``GrammarCompiler.compile``
    builds a request's (Limits.max_grammar_chars; a child process under ``serve``).
    """

    TEXT = -1

    def __init__(
        self, compiler: Any, tools: Sequence[ToolSpec], fmt: ToolFormat | None, *, parallel: bool, max_chars: int = MAX_REGEX_CHARS,
        build_index: Callable[[str], tuple[Any, int]] | None = None,
    ) -> None:
        self.compiler = compiler
        self.tools = list(tools)
        self.key = b'"parameters"' if fmt is not None and '"parameters"' in fmt.call else b'"arguments"'
        self.parallel = parallel and (fmt is None or fmt.separator is not None)
        # the JSON part: one grammar per tool's arguments, the same for every opening (cached by the compiler)
        self.arguments = [
            compiler.compile(t.parameters, regex=schema_regex(t.parameters, strict=False, max_chars=max_chars), build_index=build_index) for t in self.tools
        ]
        self.names = compiler.compile({"enum": [t.name for t in self.tools]}, build_index=build_index) if self.parallel else None
        self.markers: dict[int, bytes] = {}  # a special token that opens a call → its text
        for marker in openings(fmt):
            token = compiler.special_token(marker)
            if token is not None:
                self.markers[token] = marker.encode()
        alternatives = b"|".join(regex.escape(o.encode()) for o in openings(fmt))
        names = b"|".join(regex.escape(t.name.encode()) for t in sorted(self.tools, key=lambda t: -len(t.name)))
        tags = FUNCTION_TAGS.get(fmt.family, ()) if fmt is not None else ()
        function = rb"|(?P<tag>" + b"|".join(map(regex.escape, tags)) + rb")(?P<tagged>" + names + rb')"?>' if tags else b""
        self.trigger = regex.compile(
            WS + rb"(?:(?:(?P<open>" + alternatives + rb")" + WS + rb")?(?P<list>\[" + WS + rb")?\{" + WS
            + rb'"name"(?P<colon>' + WS + rb":" + WS + rb')"(?P<name>' + names + rb')"' + function + rb")"
        )  # fmt: skip
        self._states = States()
        self._next: dict[tuple[int, int], int | None] = {}
        self._masks: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        vocab, device = compiler.vocab_size, compiler.device
        self._free = torch.ones(vocab, dtype=torch.bool, device=device)
        self._stops = torch.zeros(vocab, dtype=torch.bool)
        self._stops[list(compiler.stop_token_ids)] = True
        self._stops = self._stops.to(device)
        self.initial_state = self._id(("undecided", b""))

    # -- states -------------------------------------------------------------------------------------

    def _id(self, key: tuple[Any, ...]) -> int:
        return self._states.id(key)

    def _key(self, state: int) -> tuple[Any, ...]:
        return ("text",) if state == self.TEXT else self._states.key(state)

    def _inner(self, key: tuple[Any, ...]) -> tuple[Any, int] | None:
        """The grammar that rules at ``key`` and its state there: a tool's arguments or the tools'
        names (None at fixed text, choices and outside a call)."""
        if key[0] == "arguments":
            return self.arguments[key[1].tool], key[2]
        if key[0] == "name":
            return self.names, key[2]
        return None

    def undecided(self, state: int) -> bool:
        """Whether the reply may still become a call or text (its text is held back meanwhile)."""
        return self._key(state)[0] == "undecided"

    def is_call(self, state: int) -> bool:
        return self._key(state)[0] not in ("undecided", "text")

    def unconstrained(self, state: int) -> bool:
        return self._key(state)[0] in ("undecided", "text")

    def is_complete(self, state: int) -> bool:
        return self._key(state)[0] == "done"

    # -- the fixed text of a call ---------------------------------------------------------------------

    def _texts(self, part: str, style: Style) -> bytes:
        """The fixed bytes of ``part`` of a call written in ``style``."""
        colon = b": " if style.spaced else b":"
        comma = b", " if style.spaced else b","
        closing = CLOSINGS.get(style.opening, b"")
        tagged = style.opening.startswith("<function")
        if part == "middle":  # after the name's closing quote, up to the arguments
            return b"" if tagged else comma + self.key + colon
        if part == "end":  # after the arguments
            if tagged:
                return b"</function>"
            return b"}" if style.listed and self.parallel else b"}" + (b"]" if style.listed else b"") + closing
        if part == "close":  # a list's end
            return b"]" + closing
        # "next": another call, up to the name's opening quote
        opening = b"" if style.listed else b"\n" + (style.opening.encode() + b"\n" if style.opening else b"")
        return (comma if style.listed else opening) + b'{"name' + b'"' + colon

    def _after(self, part: str, style: Style) -> tuple[Any, ...]:
        """The state past the end of fixed ``part``."""
        if part == "middle":
            return self._enter_arguments(style, self.arguments[style.tool].initial_state)
        if part == "end":
            return ("choice", style) if self.parallel and not style.opening.startswith("<function") else ("done",)
        if part == "close":
            return ("done",)
        return ("name", style, self.names.initial_state, b"")

    def _fixed(self, part: str, style: Style, offset: int) -> tuple[Any, ...]:
        return ("fixed", part, style, offset) if offset < len(self._texts(part, style)) else self._after(part, style)

    def _enter_arguments(self, style: Style, state: int) -> tuple[Any, ...]:
        return self._fixed("end", style, 0) if self.arguments[style.tool].is_complete(state) else ("arguments", style, state)

    def _choices(self, style: Style) -> list[tuple[str, int]]:
        """After a complete call, where parallel calls are allowed: (part, its first token) each."""
        parts = ["next", "close"] if style.listed else ["next"]
        return [(part, self.compiler.encode(self._texts(part, style))[0]) for part in parts]

    # -- the decision -------------------------------------------------------------------------------

    def _decide(self, written: bytes) -> tuple[Any, ...]:
        """The state after the reply's first bytes ``written`` (nothing decided yet before them)."""
        found = self.trigger.match(written, partial=True)
        if found is None or (found.partial and len(written) > MAX_UNDECIDED_BYTES):
            return ("text",)
        if found.partial:
            return ("undecided", written)
        groups = found.groupdict()  # "tag"/"tagged" only where the family has function tags
        name = (groups["name"] or groups.get("tagged")).decode()
        spaced = b" " in (groups["colon"] or b"")
        for spacing in (spaced, not spaced):
            # spaced as the name was; where a token straddling the name's end already wrote the
            # other spacing ('"name": "f","'), that one: the forced rest goes on from its bytes
            style = Style(
                tool=next(i for i, t in enumerate(self.tools) if t.name == name),
                opening=(groups["open"] or groups.get("tag") or b"").decode(),
                listed=groups["list"] is not None,
                spaced=spacing,
            )
            following = self._feed(self._fixed("middle", style, 0), written[found.end() :])
            if following is not None:
                return following
        return ("text",)

    def _feed(self, key: tuple[Any, ...], data: bytes) -> tuple[Any, ...] | None:
        """``key`` advanced by the bytes ``data`` (a token's leftover past the trigger); None if the
        call's grammar rejects them."""
        while data and key is not None:
            if key[0] == "fixed":
                _, part, style, offset = key
                text = self._texts(part, style)[offset:]
                size = min(len(text), len(data))
                if data[:size] != text[:size]:
                    return None
                key, data = self._fixed(part, style, offset + size), data[size:]
            elif key[0] == "arguments":
                grammar = self.arguments[key[1].tool]
                state = key[2]
                for at, byte in enumerate(data):
                    if grammar.is_complete(state):
                        break
                    state = grammar.advance_bytes(state, bytes([byte]))
                    if state is None:
                        return None
                else:
                    at = len(data)
                key, data = self._enter_arguments(key[1], state), data[at:]
            else:
                return None  # a token reaching past a whole call: not how any model writes one
        return key

    # -- the grammar protocol ---------------------------------------------------------------------------

    def advance(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None where the call's grammar rejects it."""
        if state == self.TEXT:
            return self.TEXT
        with self._lock:
            if (state, token) in self._next:
                return self._next[(state, token)]
        following = self._advance(state, token)
        with self._lock:
            self._next[(state, token)] = following
        return following

    def _advance(self, state: int, token: int) -> int | None:
        key = self._key(state)
        kind = key[0]
        if kind == "undecided":
            piece = self.markers.get(token, self.compiler.token_bytes[token])
            following = self._decide(key[1] + piece)
            return self.TEXT if following[0] == "text" else self._id(following)
        if not bool(self.mask(state)[token]) or token in self.compiler.stop_token_ids:
            return None
        piece = self.compiler.token_bytes[token]
        if kind == "arguments":
            grammar = self.arguments[key[1].tool]
            following = grammar.advance(key[2], token)
            return None if following is None else self._id(self._enter_arguments(key[1], following))
        if kind == "name":
            _, style, names_state, written = key
            names_state = self.names.advance(names_state, token)
            if names_state is None:
                return None
            written += piece
            if not self.names.is_complete(names_state):
                return self._id(("name", style, names_state, written))
            tool = next(i for i, t in enumerate(self.tools) if t.name.encode() == written.strip(b'"'))
            return self._id(self._fixed("middle", replace(style, tool=tool), 0))
        if kind == "choice":
            part = next(part for part, first in self._choices(key[1]) if first == token)
            following = self._feed(self._fixed(part, key[1], 0), piece)
        else:  # "fixed"
            following = self._feed(key, piece)
        return None if following is None else self._id(following)

    def next_state(self, state: int, token: int) -> int:
        following = self.advance(state, token)
        if following is None:
            raise ValueError(f"token {token} was committed where the tool-call grammar rejects it")
        return following

    def mask(self, state: int) -> torch.Tensor:
        """[V] bool: the tokens allowed at ``state`` (all while undecided or text)."""
        with self._lock:
            cached = self._masks.get(state)
        if cached is not None:
            return cached
        key = self._key(state)
        kind = key[0]
        inner = self._inner(key)
        if inner is not None:
            mask = inner[0].mask(inner[1])
        elif kind in ("undecided", "text"):
            mask = self._free
        elif kind == "done":
            mask = self._stops
        else:
            firsts = [first for _, first in self._choices(key[1])] if kind == "choice" else self.forced(state)[:1]
            mask = self._stops.clone() if kind == "choice" and not key[1].listed else torch.zeros_like(self._stops)
            mask[firsts] = True
        with self._lock:
            self._masks[state] = mask
        return mask

    def forced(self, state: int) -> list[int]:
        """Canonical tokens of the text forced from ``state``: fixed text, then what the arguments' or
        names' grammar forces after it."""
        key = self._key(state)
        inner = self._inner(key)
        if inner is not None:
            return inner[0].forced(inner[1])
        if key[0] != "fixed":
            return []
        _, part, style, offset = key
        tokens = self.compiler.encode(self._texts(part, style)[offset:])
        after = self._inner(self._after(part, style))
        return tokens + after[0].forced(after[1]) if after is not None else tokens

    def held(self, state: int) -> int | None:
        key = self._key(state)
        inner = self._inner(key) if key[0] != "fixed" else self._inner(self._after(key[1], key[2]))
        return inner[0].held(inner[1]) if inner is not None else None
