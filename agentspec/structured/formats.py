"""Tool-call syntax of model families: a description per family, read from the chat template.

A model trained on tool calls writes them in its family's syntax, which its chat template shows:
Qwen2.5/Qwen3 and Hermes wrap each call in ``<tool_call>`` tags, Llama 3.1/3.2 name the arguments
``parameters``, Mistral writes one list after ``[TOOL_CALLS]``. A ``ToolFormat`` is that syntax as
data: one call with ``NAME``/``ARGS`` placeholders, and the fixed text before, between and after the
calls. ``detect_format`` finds it from the template's text. From it come:

- ``call_regex``: one call of any allowed tool, the family's fixed text verbatim around compact JSON
  arguments (canonical forcing: the fixed text is drafted, and only the arguments are free);
- ``CallListGrammar``: the calls of a reply with the opening, separator and closing as token
  sequences (a family's markers may be special tokens, which no regex over text can write);
- ``CallTranscriber``: the verified call text rewritten as agentspec's canonical call lines, so the
  client's ``ToolCallParser`` yields the same events whatever the family.

A template that shows no family syntax keeps agentspec's own tool section and bare JSON calls
(``tools.with_tool_prompt``, ``tools.call_schema``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .grammar import MAX_REGEX_CHARS, Grammar, States, grammar_too_large, schema_regex
from .tools import ARGUMENTS_MARK, NAME_PREFIX, ToolSpec

__all__ = ["ToolFormat", "FORMATS", "detect_format", "call_regex", "call_grammar", "template_tools", "template_id", "CallListGrammar", "CallTranscriber"]

NAME, ARGS = "NAME", "ARGS"  # the placeholders of ``ToolFormat.call``
REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes the tool calls of a reply, spelled as its chat template renders them.

    family: a label (logs, tests);
    markers: texts that all appear in the family's chat templates (detection);
    call: one call, ``NAME`` and ``ARGS`` standing for the tool's name and its arguments object;
    opening / closing: text before the first call and after the last;
    separator: text between two calls; None where the family makes one call per reply;
    id_length: the template's call ids must have exactly this many letters and digits (Mistral).
    """

    family: str
    markers: tuple[str, ...]
    call: str
    opening: str = ""
    separator: str | None = "\n"
    closing: str = ""
    id_length: int | None = None

    @property
    def parts(self) -> tuple[str, str, str]:
        """The call's fixed text: (before the name, between name and arguments, after the arguments)."""
        before, rest = self.call.split(NAME)
        middle, after = rest.split(ARGS)
        return before, middle, after


# In detection order: the first whose markers all appear in the template wins. Spellings are the
# templates' own: Qwen2.5's (Hermes' tags), Llama 3.1's JSON tool calling, Mistral v0.3's list after
# "[TOOL_CALLS] [" (and "[TOOL_CALLS][" for a template that writes no space there).
FORMATS = (
    ToolFormat("hermes", ("<tool_call>",), '<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>'),
    ToolFormat("mistral", ("[TOOL_CALLS] [",), '{"name": "NAME", "arguments": ARGS}', "[TOOL_CALLS] [", ", ", "]", 9),
    ToolFormat("mistral", ("[TOOL_CALLS]",), '{"name": "NAME", "arguments": ARGS}', "[TOOL_CALLS][", ", ", "]", 9),
    ToolFormat("llama3", ('"parameters": ', "<|start_header_id|>"), '{"name": "NAME", "parameters": ARGS}', separator=None),
)


def detect_format(template: str) -> ToolFormat | None:
    """The family syntax a chat template's text shows, or None (agentspec's own section then)."""
    return next((fmt for fmt in FORMATS if all(marker in template for marker in fmt.markers)), None)


def _literal(text: str) -> str:
    """``text`` as a regex matching exactly it (outlines_core's dialect: meta characters escaped,
    control characters as ``\\x{..}``)."""
    return "".join(
        "\\" + char if char in REGEX_META else char if char.isprintable() else f"\\x{{{ord(char):x}}}" for char in text
    )


def call_regex(fmt: ToolFormat, tools: Sequence[ToolSpec], *, max_chars: int = MAX_REGEX_CHARS) -> str:
    """One call of any of ``tools`` in the family's syntax, the arguments in compact JSON. The
    alternatives are counted as they are made: past ``max_chars`` (``Limits.max_grammar_chars``) in
    all, the tools are refused before the joined regex is built."""
    before, middle, after = fmt.parts
    options: list[str] = []
    length = 2
    for tool in tools:
        arguments = schema_regex(tool.parameters, strict=False, max_chars=max_chars)
        options.append(f"{_literal(before)}{_literal(tool.name)}{_literal(middle)}({arguments}){_literal(after)}")
        length += len(options[-1]) + 3
        if length > max_chars:
            raise grammar_too_large(f"The {len(tools)} tools' call syntax", max_chars)
    return options[0] if len(options) == 1 else "(" + "|".join(f"({option})" for option in options) + ")"


def call_grammar(
    compiler: Any,
    fmt: ToolFormat,
    tools: Sequence[ToolSpec],
    schema: dict[str, Any],
    *,
    parallel: bool,
    max_chars: int = MAX_REGEX_CHARS,
    build_index: Any = None,
) -> "CallListGrammar":
    """The grammar of a reply's calls of ``tools`` in ``fmt`` (``schema``: their ``call_schema``, kept
    as the grammar's label; compiling takes milliseconds to seconds: call it off the event loop)."""
    item = compiler.compile(schema, regex=call_regex(fmt, tools, max_chars=max_chars), build_index=build_index)
    separator = compiler.encode(fmt.separator.encode()) if parallel and fmt.separator else None
    return CallListGrammar(item, opening=compiler.encode(fmt.opening.encode()), separator=separator, closing=compiler.encode(fmt.closing.encode()))


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as a chat template's ``tools`` takes them (OpenAI's function tools)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}} for t in tools]


def template_id(fmt: ToolFormat, call_id: str) -> str:
    """A call id as the family's template accepts it: Mistral's must be 9 letters and digits, so
    other ids map to 9 hex digits of their hash (a call and its result still match)."""
    n = fmt.id_length
    if n is None or (len(call_id) == n and call_id.isascii() and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:n]


class CallListGrammar:
    """The tool calls of a reply: ``opening``, a call of ``item``, then ``separator`` and another call
    (only where ``separator`` is given) or ``closing``.

    The fixed parts are token sequences (the tokenizer's canonical encoding, special tokens
    included) forced one token at a time; ``item`` is the grammar of one call. Where a call is
    complete the model chooses between the separator's first token and the closing's (an end token
    where the closing is empty). States are ints interned from (part, position) and ("item", item
    state) (``States``).
    """

    def __init__(self, item: Grammar, *, opening: Sequence[int], separator: Sequence[int] | None, closing: Sequence[int]) -> None:
        self.item = item
        self.compiler = compiler = item.compiler
        self.parts = {"opening": tuple(opening), "separator": tuple(separator or ()), "closing": tuple(closing)}
        self.parallel = bool(separator)
        self._states = States()
        self._one_hot: dict[int, torch.Tensor] = {}  # a fixed part's token → its mask
        self._stop_mask = self._tokens_mask(compiler.stop_token_ids)
        ends = [self.parts["closing"][0]] if closing else list(compiler.stop_token_ids)
        self._choice_mask = self._tokens_mask([*self.parts["separator"][:1], *ends])
        self.initial_state = self._enter("opening")

    def _tokens_mask(self, tokens: Any) -> torch.Tensor:
        mask = torch.zeros(self.compiler.vocab_size, dtype=torch.bool)
        mask[list(tokens)] = True
        return mask.to(self.compiler.device)

    def _enter(self, part: str, position: int = 0) -> int:
        """The state at ``position`` of a fixed part; past its end, the state after it."""
        if position < len(self.parts[part]):
            return self._states.id((part, position))
        return self._states.id(("done",)) if part == "closing" else self._states.id(("item", self.item.initial_state))

    def _ended(self, key: tuple[Any, ...]) -> bool:
        """Whether ``key`` is an item state where the call is complete."""
        return key[0] == "item" and self.item.is_complete(key[1])

    def forced(self, state: int) -> list[int]:
        key = self._states.key(state)
        if key[0] in self.parts:
            rest = list(self.parts[key[0]][key[1] :])
            return rest if key[0] == "closing" else rest + self.item.forced(self.item.initial_state)
        if key[0] == "item":
            if not self._ended(key):
                return self.item.forced(key[1])
            return [] if self.parallel else list(self.parts["closing"])
        return []

    def held(self, state: int) -> int | None:
        key = self._states.key(state)
        if key[0] in ("opening", "separator"):
            return self.item.held(self.item.initial_state)
        return self.item.held(key[1]) if key[0] == "item" and not self._ended(key) else None

    def mask(self, state: int) -> torch.Tensor:
        key = self._states.key(state)
        if key[0] in self.parts:
            token = self.parts[key[0]][key[1]]
            if token not in self._one_hot:
                self._one_hot[token] = self._tokens_mask([token])
            return self._one_hot[token]
        if key[0] == "item":  # a complete call: the separator's or the closing's first token
            return self._choice_mask if self._ended(key) else self.item.mask(key[1])
        return self._stop_mask

    def unconstrained(self, state: int) -> bool:
        return False

    def advance(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None if the grammar rejects it here."""
        key = self._states.key(state)
        if key[0] in self.parts:
            return self._enter(key[0], key[1] + 1) if token == self.parts[key[0]][key[1]] else None
        if key[0] == "done":
            return None
        if not self._ended(key):
            following = self.item.advance(key[1], token)
            return None if following is None else self._states.id(("item", following))
        if self.parallel and token == self.parts["separator"][0]:
            return self._enter("separator", 1)
        if self.parts["closing"] and token == self.parts["closing"][0]:
            return self._enter("closing", 1)
        return None

    def next_state(self, state: int, token: int) -> int:
        following = self.advance(state, token)
        if following is None:
            raise ValueError(f"token {token} was committed where the tool-call grammar rejects it")
        return following

    def undecided(self, state: int) -> bool:
        return False

    def is_complete(self, state: int) -> bool:
        """After the closing; or after a call where no other may follow and nothing closes the list."""
        key = self._states.key(state)
        return key[0] == "done" or (self._ended(key) and not self.parallel and not self.parts["closing"])


class CallTranscriber:
    """Verified call text in, agentspec's canonical call text out: one compact
    ``{"name":"NAME","arguments":{...}}`` per line, what ``ToolCallParser`` reads.

    The text is a family's syntax, or any opening ``tool_choice="auto"`` accepts (a fence, a list, a
    marker, spaced or compact keys, a ``<function=NAME>`` tag; ``triggers``): the grammar wrote the
    arguments in compact JSON, so the rewrite only finds each call's name (after ``{"name":`` or in
    the tag) and the extent of its arguments (the next object); tags, fences, brackets and
    separators are dropped. Text is passed on as soon as it is known, so calls still stream, and a
    call ends (its newline) where its arguments do: what follows is fixed text.
    """

    START = re.compile(r'\{\s*"name"\s*:\s*"|<function=|<function name="')  # a JSON call, or Hermes 2 Pro's tag

    def __init__(self, fmt: ToolFormat | None = None) -> None:
        self._pending = ""
        self._state = "seek"  # seek → name → middle → arguments → seek
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> str:
        out: list[str] = []
        pending = self._pending + text
        while pending:
            if self._state == "seek":
                found = self.START.search(pending)
                if found is None:
                    start = max(pending.rfind("{"), pending.rfind("<"))
                    pending = pending[start:] if start >= 0 else ""  # a start may be split across pieces
                    break
                out.append(NAME_PREFIX)
                pending, self._state = pending[found.end() :], "name"
            elif self._state == "name":  # tool names never hold a quote or a '>'
                end = min((at for at in (pending.find('"'), pending.find(">")) if at >= 0), default=-1)
                out.append(pending if end < 0 else pending[:end])
                if end < 0:
                    pending = ""
                    break
                pending, self._state = pending[end + 1 :], "middle"
            elif self._state == "middle":  # the arguments key, whatever its name and spacing
                start = pending.find("{")
                if start < 0:
                    pending = ""
                    break
                out.append(ARGUMENTS_MARK)
                pending, self._state = pending[start:], "arguments"
            else:
                end = self._scan(pending)
                if end is None:
                    out.append(pending)
                    pending = ""
                    break
                out.append(pending[:end] + "}\n")  # the call is complete: the parser ends it at the newline
                pending, self._state = pending[end:], "seek"
        self._pending = pending
        return "".join(out)

    def _scan(self, text: str) -> int | None:
        """Follow the arguments' JSON through ``text``: the length up to their end, None if they go on."""
        for at, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return at + 1
        return None
