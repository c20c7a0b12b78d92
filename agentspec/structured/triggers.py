"""``tool_choice="auto"``: free text, or tool calls once the reply's first bytes name a tool (lazy triggers).

Real models open a call in more ways than their chat template shows: Qwen2.5-Coder writes a fenced
```` ```json ```` block or a bare ``{"name": ..., "arguments": ...}``, Llama 3.x a bare object with
``"parameters"`` (often after ``<|python_tag|>``, and sometimes with ``"arguments"``), Mistral
sometimes drops ``[TOOL_CALLS]``, Hermes-style models wrap the call in tags other than their own. A
reply counts as a call when, after optional whitespace, it opens with

    [fence ws] [opening ws] ["[" ws] "{" ws '"name"' ws ":" ws '"' <a tool's name> '"'

(or, for Hermes, a function tag naming a tool: ``<function=NAME>`` / ``<function name="NAME">``), where
the fences are ```` ```json ```` and ```` ``` ```` (Hermes also ```` ```xml ````) and the openings are the
family's markers and tags (``<tool_call>`` and the other tags llama.cpp's Hermes 2 Pro handler takes,
``[TOOL_CALLS]``, ``<|python_tag|>``; a marker that is a special token is matched by its token id).
The pattern is matched on the bytes of the tokens as they are committed, whatever the tokenization:
**nothing is masked while the reply is undecided**, so a text answer keeps the model's own tokens
(``auto`` equals ``none`` on it). Once the bytes name a tool, the rest of the call is forced: the
arguments key, the tool's arguments (its own compiled grammar, shared by every opening and cached by
the compiler), the closing brace and the openings' closings (tag, fence, list bracket). A token that
straddles the end of the name is continued from its leftover bytes (which may choose the other
spacing). A reply that matches no opening, or names no tool, is text from the first byte that rules
a call out; undecided text is held back by the engine until then (``undecided``).

Where the call's fixed text has alternatives, the model's bytes choose among them and the rest is
forced as soon as they decide: the arguments key is ``"arguments"`` or ``"parameters"`` whatever the
family (models of every family write both; the transcribed call is the same), and a further call
names any of the tools. The mask there allows the first canonical token of each alternative still
open; the family's own key is the one drafted.

Where parallel calls are allowed (the family has a separator), a complete call is followed by the
model's choice: an end token, or another call in the same opening (a list goes on with ``", "``, a
function tag with another tag).

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
KEYS = (b'"arguments"', b'"parameters"')  # the arguments' key: either, in every family (the family's own drafted)
# Per family (``ToolFormat.family``), what may open its calls besides the fences. A marker opens them
# and closes nothing (Llama 3.x's is a special token); a tag wraps one call and is closed by its
# "</...>" twin: Hermes' own <tool_call>, and the tags llama.cpp's Hermes 2 Pro handler also takes
# from Hermes-style models (its grammar's and its parser's), with its further fence ```xml.
MARKERS = {"mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",)}
TAGS = {"hermes": ("<tool_call>", "<function_call>", "<tools>", "<tool>", "<response>", "<json>", "<JSON>", "<xml>")}
FAMILY_FENCES = {"hermes": ("```xml",)}
# Hermes 2 Pro's function tags: the name in the tag and the arguments alone inside,
# '<function=NAME>{...}</function>' or '<function name="NAME">{...}</function>' (tag, end of the name).
FUNCTION_TAGS = {"hermes": (("<function=", ">"), ('<function name="', '">'))}
FUNCTION_END = b"</function>"


def openings(fmt: ToolFormat | None) -> tuple[str, ...]:
    """The openings that may come before a call's ``{`` (besides none at all) for ``fmt``'s family:
    its tags and markers, then the fences (a fence may also come before a tag or marker)."""
    family = fmt.family if fmt is not None else ""
    return (*TAGS.get(family, ()), *MARKERS.get(family, ()), *FENCES, *FAMILY_FENCES.get(family, ()))


def _alternation(texts: Sequence[str]) -> bytes:
    """A regex group body matching any of ``texts`` (the longest first, so no alternative hides another)."""
    return b"|".join(regex.escape(text.encode()) for text in sorted(texts, key=len, reverse=True))


@dataclass(frozen=True)
class Style:
    """How the reply writes its calls, read from its first call's opening bytes."""

    tool: int  # the call being written (an index into the tools)
    fence: str  # "" or the fence the calls are in
    opening: str  # "" (bare), a marker, a tag, or a function tag (no JSON object around the arguments)
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
        family = fmt.family if fmt is not None else ""
        own = b'"parameters"' if fmt is not None and '"parameters"' in fmt.call else b'"arguments"'
        self.keys = (own, *(key for key in KEYS if key != own))  # the family's own first: the one drafted
        self.parallel = parallel and (fmt is None or fmt.separator is not None)
        # the JSON part: one grammar per tool's arguments, the same for every opening (cached by the compiler)
        self.arguments = [
            compiler.compile(t.parameters, regex=schema_regex(t.parameters, strict=False, max_chars=max_chars), build_index=build_index) for t in self.tools
        ]
        self.tags = TAGS.get(family, ())
        self.function_tags = dict(FUNCTION_TAGS.get(family, ()))  # tag → the end of the name
        self.markers: dict[int, bytes] = {}  # a special token that opens a call → its text
        for marker in openings(fmt):
            token = compiler.special_token(marker)
            if token is not None:
                self.markers[token] = marker.encode()
        names = _alternation([t.name for t in self.tools])
        prefixes = (*self.tags, *MARKERS.get(family, ()))
        opening = rb"(?:(?P<opening>" + _alternation(prefixes) + rb")" + WS + rb")?" if prefixes else b""
        call = (
            rb"(?:(?P<fence>" + _alternation((*FENCES, *FAMILY_FENCES.get(family, ()))) + rb")" + WS + rb")?" + opening
            + rb"(?P<list>\[" + WS + rb")?\{" + WS + rb'"name"(?P<colon>' + WS + rb":" + WS + rb')"(?P<name>' + names + rb')"'
        )  # fmt: skip
        for tag, end in self.function_tags.items():  # the regex module lets alternatives share group names
            call += rb"|(?P<tag>" + regex.escape(tag.encode()) + rb")(?P<tagged>" + names + rb")" + regex.escape(end.encode())
        self.trigger = regex.compile(WS + rb"(?:" + call + rb")")
        self._states = States()
        self._next: dict[tuple[int, int], int | None] = {}
        self._masks: dict[int, torch.Tensor] = {}
        self._forced: dict[int, list[int]] = {}  # at fixed text (one encoding per alternative still open)
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
        """The tool's arguments grammar and its state where it rules at ``key`` (None at fixed text,
        choices and outside a call)."""
        return (self.arguments[key[1].tool], key[2]) if key[0] == "arguments" else None

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

    def _texts(self, part: str, style: Style) -> tuple[bytes, ...]:
        """The fixed bytes of ``part`` of a call written in ``style``: its alternatives, the first one
        drafted. Each alternative ends in a delimiter, so none is a prefix of another."""
        colon = b": " if style.spaced else b":"
        comma = b", " if style.spaced else b","
        name_end = self.function_tags.get(style.opening)
        if part == "middle":  # after the name's closing quote, up to the arguments: the key
            return (b"",) if name_end is not None else tuple(comma + key + colon for key in self.keys)
        if part == "end":  # after the arguments
            if name_end is not None:
                return (FUNCTION_END,)
            return (b"}",) if style.listed and self.parallel else (b"}" + (b"]" if style.listed else b"") + self._closing(style),)
        if part == "close":  # a list's end
            return (b"]" + self._closing(style),)
        # "next": another call, up to the end of its name; one alternative per tool
        if name_end is not None:
            return tuple(b"\n" + style.opening.encode() + t.name.encode() + name_end.encode() for t in self.tools)
        opening = comma if style.listed else b"\n" + b"".join(o.encode() + b"\n" for o in (style.fence, style.opening) if o)
        return tuple(opening + b'{"name"' + colon + b'"' + t.name.encode() + b'"' for t in self.tools)

    def _closing(self, style: Style) -> bytes:
        """What closes a call's openings: its tag's twin, then its fence."""
        tag = b"\n</" + style.opening[1:].encode() if style.opening in self.tags else b""
        return tag + (b"\n```" if style.fence else b"")

    def _after(self, part: str, style: Style, chosen: int) -> tuple[Any, ...]:
        """The state past the end of fixed ``part`` (its alternative ``chosen``)."""
        if part == "middle":
            return self._enter_arguments(style, self.arguments[style.tool].initial_state)
        if part == "end":
            return ("choice", style) if self.parallel else ("done",)
        if part == "close":
            return ("done",)
        return self._fixed("middle", replace(style, tool=chosen))  # "next": the alternative is the tool

    def _fixed(self, part: str, style: Style, offset: int = 0, live: tuple[int, ...] | None = None) -> tuple[Any, ...]:
        """The state ``offset`` bytes into ``part`` with the alternatives ``live`` still open (all: None)."""
        texts = self._texts(part, style)
        live = tuple(range(len(texts))) if live is None else live
        ended = [i for i in live if offset >= len(texts[i])]
        return self._after(part, style, ended[0]) if ended else ("fixed", part, style, offset, live)

    def _rests(self, key: tuple[Any, ...]) -> list[bytes]:
        """At a fixed state: the rest of each alternative still open."""
        _, part, style, offset, live = key
        texts = self._texts(part, style)
        return [texts[i][offset:] for i in live]

    def _enter_arguments(self, style: Style, state: int) -> tuple[Any, ...]:
        return self._fixed("end", style) if self.arguments[style.tool].is_complete(state) else ("arguments", style, state)

    def _choices(self, style: Style) -> list[tuple[str, set[int]]]:
        """After a complete call, where parallel calls are allowed: (part, the first tokens of its
        alternatives) each."""
        parts = ["next", "close"] if style.listed else ["next"]
        return [(part, {self.compiler.encode(text)[0] for text in self._texts(part, style)}) for part in parts]

    # -- the decision -------------------------------------------------------------------------------

    def _decide(self, written: bytes) -> tuple[Any, ...]:
        """The state after the reply's first bytes ``written`` (nothing decided yet before them)."""
        found = self.trigger.match(written, partial=True)
        if found is None or (found.partial and len(written) > MAX_UNDECIDED_BYTES):
            return ("text",)
        if found.partial:
            return ("undecided", written)
        groups = found.groupdict()  # "opening", "tag", "tagged" only where the family has them
        name = (groups["name"] or groups.get("tagged")).decode()
        spaced = b" " in (groups["colon"] or b"")
        for spacing in (spaced, not spaced):
            # spaced as the name was; where a token straddling the name's end already wrote the
            # other spacing ('"name": "f","'), that one: the forced rest goes on from its bytes
            style = Style(
                tool=next(i for i, t in enumerate(self.tools) if t.name == name),
                fence=(groups["fence"] or b"").decode(),
                opening=(groups.get("opening") or groups.get("tag") or b"").decode(),
                listed=groups["list"] is not None,
                spaced=spacing,
            )
            following = self._feed(self._fixed("middle", style), written[found.end() :])
            if following is not None:
                return following
        return ("text",)

    def _feed(self, key: tuple[Any, ...], data: bytes) -> tuple[Any, ...] | None:
        """``key`` advanced by the bytes ``data`` (a token's leftover past the trigger, or a token of
        fixed text); None if the call's grammar rejects them."""
        while data and key is not None:
            if key[0] == "fixed":
                _, part, style, offset, live = key
                texts = self._texts(part, style)
                live = tuple(i for i in live if texts[i][offset : offset + len(data)] == data[: len(texts[i]) - offset])
                if not live:
                    return None
                size = min(len(data), *(len(texts[i]) - offset for i in live))  # up to the first end (then one is live)
                key, data = self._fixed(part, style, offset + size, live), data[size:]
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
        # a marker (a special token, no bytes of its own) stands for its text: at an opening, and
        # where fixed text repeats it before a further call
        piece = self.markers.get(token, self.compiler.token_bytes[token])
        if kind == "undecided":
            following = self._decide(key[1] + piece)
            return self.TEXT if following[0] == "text" else self._id(following)
        if not bool(self.mask(state)[token]) or token in self.compiler.stop_token_ids:
            return None
        if kind == "arguments":
            grammar = self.arguments[key[1].tool]
            following = grammar.advance(key[2], token)
            return None if following is None else self._id(self._enter_arguments(key[1], following))
        if kind == "choice":
            part = next(part for part, firsts in self._choices(key[1]) if token in firsts)
            following = self._feed(self._fixed(part, key[1]), piece)
        else:  # "fixed"
            following = self._feed(key, piece)
        return None if following is None else self._id(following)

    def next_state(self, state: int, token: int) -> int:
        following = self.advance(state, token)
        if following is None:
            raise ValueError(f"token {token} was committed where the tool-call grammar rejects it")
        return following

    def mask(self, state: int) -> torch.Tensor:
        """[V] bool: the tokens allowed at ``state`` (all while undecided or text); at fixed text, the
        first canonical token of each alternative still open."""
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
            if kind == "choice":
                firsts = set().union(*(firsts for _, firsts in self._choices(key[1])))
            else:
                firsts = {self.compiler.encode(rest)[0] for rest in self._rests(key)}
            mask = self._stops.clone() if kind == "choice" and not key[1].listed else torch.zeros_like(self._stops)
            mask[sorted(firsts)] = True
        with self._lock:
            self._masks[state] = mask
        return mask

    def forced(self, state: int) -> list[int]:
        """Canonical tokens of the text forced from ``state``: fixed text, then what the arguments'
        grammar forces after it. Where the alternatives of a call's key are open, the first (the
        family's key) is drafted; where a further call's tools are, the text their names share."""
        key = self._key(state)
        inner = self._inner(key)
        if inner is not None:
            return inner[0].forced(inner[1])
        if key[0] != "fixed":
            return []
        with self._lock:
            cached = self._forced.get(state)
        if cached is None:
            cached = self._forced_from_fixed(key)
            with self._lock:
                self._forced[state] = cached
        return cached

    def _forced_from_fixed(self, key: tuple[Any, ...]) -> list[int]:
        """``forced`` at fixed text: the first open alternative's canonical tokens and what the
        arguments' grammar forces after them; for a further call's open tools, their shared tokens."""
        _, part, style, _, live = key
        spellings = [self.compiler.encode(rest) for rest in self._rests(key)]
        if part == "next" and len(live) > 1:  # no tool likelier than another: up to where the names part
            shared = 0
            while all(len(spelling) > shared + 1 and spelling[shared] == spellings[0][shared] for spelling in spellings):
                shared += 1
            return spellings[0][:shared]
        after = self._inner(self._after(part, style, live[0]))
        return spellings[0] + after[0].forced(after[1]) if after is not None else spellings[0]

    def held(self, state: int) -> int | None:
        key = self._key(state)
        inner = self._inner(key) if key[0] != "fixed" else self._inner(self._after(key[1], key[2], key[4][0]))
        return inner[0].held(inner[1]) if inner is not None else None
