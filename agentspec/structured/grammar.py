"""Structured output: JSON-schema grammars on outlines_core's token-level index, with canonical forcing.

Measured facts that shape this module (DESIGN §3):
- Grammars rarely force a single *token*, but often force *text* (``{"name":"``). Where the grammar
  forces text, the mask admits only the first token of that text's canonical tokenization (the
  tokenizer's own ``encode``): **canonical forcing**. Plain and speculative decoding use the same
  mask, so output never depends on speculation, and the forced tokens are drafts that always verify.
- The forced text's last token is left free (a short look-back) unless nothing free follows it, so a
  forced token never swallows the start of free text (a closing quote merged with what follows).
  It is still the likeliest next token, so drafts propose it (``held``) and verification decides.
- Compact JSON (no free whitespace): whitespace is where small models loop.
- The vocabulary is built from token *bytes*, without special tokens.

A ``Grammar`` is immutable and shared; a request's grammar position is just an ``int`` state, so
rolling back a rejected draft is keeping the state of the committed tokens.
"""

from __future__ import annotations

import itertools
import json
import pickle
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..errors import InvalidRequestError, LimitExceededError, UnsupportedFeatureError
from .budget import ByteBoundedCache, regex_size_bound

__all__ = [
    "Grammar",
    "GrammarCompiler",
    "RepeatedGrammar",
    "States",
    "check_enforceable",
    "grammar_too_large",
    "schema_from_response_format",
    "schema_regex",
]

MAX_FORCED_BYTES = 256  # longest forced text followed ahead of the model
MAX_REGEX_CHARS = 200_000  # default Limits.max_grammar_chars: bigger schemas take too long and too much memory to index
DEFAULT_GRAMMAR_CACHE_BYTES = 256 * 2**20  # Limits.grammar_cache_mb: built grammars kept per tokenizer
MAX_CACHED_REGEX_BYTES = 16 * 2**20  # schema → regex texts kept (tokenizer-independent; least recently used dropped)
WHITESPACE = ""  # compact JSON: no optional whitespace anywhere


# Keywords outlines_core's regex builder ignores although an output could break them (measured by
# building each schema with and without the keyword: the same regex). Annotations and keywords that
# only admit *more* (additionalProperties, patternProperties) are fine: generation adds nothing extra.
UNENFORCED_KEYWORDS = frozenset(
    {
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "uniqueItems", "contains", "minContains", "maxContains",
        "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "propertyNames",
        "if", "then", "else",
    }
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "prefixItems", "anyOf", "oneOf", "allOf")


def check_enforceable(schema: Any, path: str = "") -> None:
    """Raise UnsupportedFeatureError naming the first keyword the grammar would silently ignore."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_enforceable(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for keyword in schema:
        if keyword in UNENFORCED_KEYWORDS:
            raise UnsupportedFeatureError(
                f"The JSON schema uses `{keyword}` at {path or '/'}, which the grammar cannot enforce (outlines_core "
                "ignores it), so an output could break the schema; remove it and check the value after generation."
            )
    for keyword, value in schema.items():
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_enforceable(sub, f"{path}/{keyword}/{name}")
        elif keyword in _SUBSCHEMAS:
            check_enforceable(value, f"{path}/{keyword}")


_REGEXES: ByteBoundedCache[str] = ByteBoundedCache(MAX_CACHED_REGEX_BYTES, len)  # by the schema's JSON text; successes only


def _regex(key: str) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    regex = _REGEXES.get(key)
    if regex is None:
        regex = _REGEXES.put(key, build_regex_from_schema(key, whitespace_pattern=WHITESPACE))
    return regex


def grammar_too_large(what: str, limit: int) -> LimitExceededError:
    """The refusal of a grammar whose regular expression would be longer than ``limit`` characters."""
    return LimitExceededError(
        f"{what} would compile to a grammar of over {limit} regex characters (Limits.max_grammar_chars; agentspec "
        "serve --max-grammar-chars); bound it (fewer nested arrays or objects, required properties, fewer or "
        "shorter alternatives) or split the request.",
        limit="max_grammar_chars",
        code="grammar_too_large",
    )


# What outlines_core's schema errors say, in agentspec's words: (its wording, ours). Each keeps only
# the part of the schema the caller sent (a type, a reference, a format); anything else is summed up
# in one sentence, since the compiler's own text names its internals and its issue tracker.
_COMPILER_PROBLEMS = (
    (re.compile(r"Unsupported type: (.{1,80})$", re.DOTALL), "the type {0!r} is not supported"),
    (re.compile(r"Invalid reference path: (.{1,200})$", re.DOTALL), "the reference {0!r} does not resolve within the schema"),
    (re.compile(r"Format (.{1,80}) is not supported", re.DOTALL), "the string format {0!r} is not supported"),
    (re.compile(r"Unsupported JSON Schema structure (.{1,200}?) \n", re.DOTALL), "this part cannot be enforced: {0}"),
)


def _schema_problem(compiler_text: str) -> str:
    """The compiler's complaint about a schema, as agentspec words it (see ``_COMPILER_PROBLEMS``)."""
    for pattern, ours in _COMPILER_PROBLEMS:
        found = pattern.search(compiler_text)
        if found:
            return ours.format(found.group(1).strip())
    return "it uses a keyword or structure the grammar compiler does not support"


def schema_regex(schema: dict[str, Any], *, strict: bool = True, max_chars: int = MAX_REGEX_CHARS) -> str:
    """The schema's regular expression (cached; tokenizer-independent). Fast, and raises
    InvalidRequestError naming what is unsupported, so a request is rejected before any work starts.

    strict: reject keywords the grammar cannot enforce (``UNENFORCED_KEYWORDS``). Structured output is
    always strict; a tool's parameters only with ``"strict": true``, as OpenAI's function calling:
    otherwise such keywords (``lt``/``ge`` bounds of a pydantic field, say) reach the model in the tool
    description but are not enforced.

    max_chars: ``Limits.max_grammar_chars``. The regex's length is bounded from the schema first
    (``budget.regex_size_bound``): a schema over the limit is refused (``LimitExceededError``) without
    building its regex, which for nested arrays could take gigabytes.
    """
    try:
        key = json.dumps(schema)  # property order matters: it is the order fields are generated in
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"The JSON schema is not JSON-serialisable: {exc}.") from None
    if strict:
        check_enforceable(schema)
    try:
        bound = regex_size_bound(schema, cap=max_chars)
    except RecursionError:  # references chained through deep schemas: far past any limit
        bound = max_chars + 1
    if bound > max_chars:
        raise grammar_too_large("The JSON schema", max_chars)
    try:
        regex = _regex(key)
    except Exception as exc:  # outlines_core names the unsupported keyword or structure
        raise InvalidRequestError(
            f"Unsupported or invalid JSON schema: {_schema_problem(str(exc))}. Use the supported subset "
            "(type, properties, required, items, enum, const, anyOf, $ref within the schema, bounds on lengths)."
        ) from None
    if len(regex) > max_chars:  # the bound is checked against the compiler in tests; this never builds more
        raise grammar_too_large("The JSON schema", max_chars)
    return regex


def schema_from_response_format(response_format: Any) -> tuple[dict[str, Any], Any] | None:
    """OpenAI ``response_format`` → (JSON schema, pydantic model class or None); None for plain text."""
    if response_format is None:
        return None
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return response_format.model_json_schema(), response_format
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise InvalidRequestError(
            "`response_format` must be a pydantic model class, {'type': 'json_schema', 'json_schema': "
            "{'name': ..., 'schema': {...}}}, {'type': 'json_object'} or {'type': 'text'}."
        )
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("`response_format.json_schema.schema` must be a JSON schema object (a dict).")
        return schema, None
    raise InvalidRequestError(f"Unknown `response_format` type {kind!r}; use 'text', 'json_object' or 'json_schema'.")


@dataclass(eq=False)
class Grammar:
    """A compiled schema over one vocabulary. Thread-safe: its masks and forced texts per state are
    kept in its compiler's cache (``GrammarCompiler.cache``), within the same byte budget as the
    grammars themselves."""

    schema: dict[str, Any]
    index: Any  # outlines_core.Index
    compiler: "GrammarCompiler" = field(repr=False)
    index_bytes: int = 0  # the index's size serialised: what keeping it costs, near enough
    regex: str | None = field(default=None, repr=False)  # its key in the compiler's cache
    serial: int = field(init=False, repr=False)  # names this grammar's per-state entries in the compiler's cache

    def __post_init__(self) -> None:
        self.serial = self.compiler.next_serial()

    @property
    def initial_state(self) -> int:
        return self.index.get_initial_state()

    def is_final(self, state: int) -> bool:
        return self.index.is_final_state(state)

    def is_complete(self, state: int) -> bool:
        """Final and nothing but an end token may follow: the output is finished."""
        stops = self.compiler.stop_token_ids
        return self.is_final(state) and all(t in stops for t in self.index.get_allowed_tokens(state))

    def advance(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None if the grammar rejects it there."""
        if not bool(self.mask(state)[token]) or token in self.compiler.stop_token_ids:
            return None
        return self.index.get_next_state(state, token)

    def next_state(self, state: int, token: int) -> int:
        """The state after a committed (already verified under ``mask``) token."""
        return self.index.get_next_state(state, token)

    def advance_bytes(self, state: int, data: bytes) -> int | None:
        """The state after the text ``data`` however it was tokenized (a token the model wrote
        before this grammar applied), or None if the grammar rejects it. No canonical forcing."""
        for byte in data:
            token = self.compiler.byte_token.get(byte)
            following = None if token is None else self.index.get_next_state(state, token)
            if following is None:
                return None
            state = following
        return state

    def undecided(self, state: int) -> bool:
        """Whether the output may still turn out to be free text (``AutoCallGrammar``): never here."""
        return False

    def unconstrained(self, state: int) -> bool:
        """True where every token is allowed (no mask needed)."""
        return False

    def forced(self, state: int) -> list[int]:
        """Canonical tokens of the text the grammar forces from ``state`` (look-back applied)."""
        return self._forced_and_held(state)[0]

    def held(self, state: int) -> int | None:
        """The canonical token the look-back left free after ``forced(state)``: the likeliest next
        token there, but the model may merge it with the free text that follows. None if none."""
        return self._forced_and_held(state)[1]

    def _forced_and_held(self, state: int) -> tuple[list[int], int | None]:
        key = ("forced", self.serial, state)
        cached = self.compiler.cache.get(key)
        return cached if cached is not None else self.compiler.cache.put(key, self._compute_forced(state))

    def mask(self, state: int) -> torch.Tensor:
        """[V] bool: tokens allowed at ``state`` under canonical forcing (stop tokens where final).
        Cached per state within the compiler's byte budget (a mask is a vocabulary's bytes: a long
        reply under a large grammar visits thousands of states); one dropped is computed again."""
        if self.regex is not None:
            self.compiler.cache.get(self.regex)  # a grammar in use stays more recent than its masks
        key = ("mask", self.serial, state)
        cached = self.compiler.cache.get(key)
        if cached is not None:
            return cached
        forced = self.forced(state)
        compiler = self.compiler
        mask = torch.zeros(compiler.vocab_size, dtype=torch.bool)
        if forced:
            mask[forced[0]] = True
        else:
            allowed = self.index.get_allowed_tokens(state)  # a list of up to the vocabulary's size
            mask[torch.from_numpy(np.fromiter(allowed, dtype=np.int64, count=len(allowed)))] = True
            mask[list(compiler.stop_token_ids)] = self.is_final(state)  # the index allows EOS where final; we allow every stop token
        return compiler.cache.put(key, mask.to(compiler.device))

    def _compute_forced(self, state: int) -> tuple[list[int], int | None]:
        compiler = self.compiler
        text = bytearray()
        current = state
        first_byte = compiler.first_byte
        while len(text) < MAX_FORCED_BYTES and not self.is_final(current):
            allowed = self.index.get_allowed_tokens(current)
            if not allowed or first_byte[allowed[0]] != first_byte[allowed[-1]]:
                break  # a free choice (the common case, told apart without converting thousands of ids)
            first_bytes = np.unique(first_byte[np.fromiter(allowed, dtype=np.int64, count=len(allowed))])
            byte = int(first_bytes[0]) if first_bytes.size == 1 else -1
            token = compiler.byte_token.get(byte)
            if token is None:  # a free choice here (or a byte with no single-byte token)
                break
            text.append(byte)
            current = self.index.get_next_state(current, token)
        if not text:
            return [], None
        tokens = compiler.encode(bytes(text))
        if not self.is_complete(current):  # look-back: the last forced token may merge with the free text after it
            return tokens[:-1], tokens[-1]
        return tokens, None


class States:
    """A composite grammar's states: its keys (tuples) interned as the ints a request keeps.
    Thread-safe; grows with the states a request reaches."""

    def __init__(self) -> None:
        self._keys: list[tuple[Any, ...]] = []
        self._ids: dict[tuple[Any, ...], int] = {}
        self._lock = threading.Lock()

    def id(self, key: tuple[Any, ...]) -> int:
        with self._lock:
            if key not in self._ids:
                self._ids[key] = len(self._keys)
                self._keys.append(key)
            return self._ids[key]

    def key(self, state: int) -> tuple[Any, ...]:
        return self._keys[state]


class RepeatedGrammar:
    """One or more values of ``item`` separated by newlines: parallel tool calls, one per line.

    Compact JSON never contains a raw newline, so the separator is unambiguous. Where a value is
    complete the model chooses between the newline token (another value) and an end token. The
    repetition lives here rather than in the regex: outlines_core's ``Index`` keeps, from a final
    state, only the tokens that lead to another final state, so ``(R)(\\n(R))*`` would never
    allow the newline.
    """

    def __init__(self, item: Grammar) -> None:
        self.item = item
        self.compiler = compiler = item.compiler
        separator = compiler.encode(b"\n")
        assert len(separator) == 1, "a newline is one token in byte-level BPE vocabularies"
        self.separator = separator[0]
        self._between = torch.zeros(compiler.vocab_size, dtype=torch.bool)
        self._between[[self.separator, *compiler.stop_token_ids]] = True
        self._between = self._between.to(compiler.device)

    @property
    def initial_state(self) -> int:
        return self.item.initial_state

    def forced(self, state: int) -> list[int]:
        return [] if self.item.is_complete(state) else self.item.forced(state)

    def held(self, state: int) -> int | None:
        return None if self.item.is_complete(state) else self.item.held(state)

    def mask(self, state: int) -> torch.Tensor:
        return self._between if self.item.is_complete(state) else self.item.mask(state)

    def unconstrained(self, state: int) -> bool:
        return False

    def advance(self, state: int, token: int) -> int | None:
        if self.item.is_complete(state):
            return self.item.initial_state if token == self.separator else None
        return self.item.advance(state, token)

    def next_state(self, state: int, token: int) -> int:
        if self.item.is_complete(state) and token == self.separator:
            return self.item.initial_state
        return self.item.next_state(state, token)

    def is_complete(self, state: int) -> bool:
        return False  # only an end token ends a reply that may hold another value

    def undecided(self, state: int) -> bool:
        return False


# What a cached per-state entry holds besides its data: a mask tensor's object and storage, a
# forced text's tuple and list (and each token id an int object of its own).
TENSOR_OVERHEAD_BYTES = 256
FORCED_ENTRY_BYTES, FORCED_TOKEN_BYTES = 160, 40


def _cached_bytes(value: Any) -> int:
    """What an entry of a compiler's cache holds: a grammar (its index as outlines_core serialises
    it, and its schema's JSON text), a mask ([V] bool), or a state's forced tokens and held token."""
    if isinstance(value, Grammar):
        return value.index_bytes + len(json.dumps(value.schema))
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() + TENSOR_OVERHEAD_BYTES
    forced, _ = value
    return FORCED_ENTRY_BYTES + FORCED_TOKEN_BYTES * (len(forced) + 1)


class GrammarCompiler:
    """Builds and caches grammars for one tokenizer (outlines_core ``Vocabulary`` from token bytes)."""

    def __init__(self, token_bytes: list[bytes], tokenizer: Any, stop_token_ids: frozenset[int], device: torch.device) -> None:
        from outlines_core import Vocabulary

        self.vocab_size = len(token_bytes)
        self.stop_token_ids = stop_token_ids
        self.device = device
        self.tokenizer = tokenizer
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(token_bytes):
            if piece:  # special tokens have no bytes: never allowed inside JSON
                by_bytes.setdefault(piece, []).append(token_id)
        self.vocabulary = Vocabulary(min(stop_token_ids), by_bytes)
        self.first_byte = np.array([piece[0] if piece else -1 for piece in token_bytes], dtype=np.int64)
        self.byte_token = {piece[0]: ids[0] for piece, ids in by_bytes.items() if len(piece) == 1}
        self.token_bytes = token_bytes
        self._special: dict[str, int | None] = {}
        self._lock = threading.Lock()
        # Grammars by regex, and their masks and forced texts by (kind, grammar serial, state), in one
        # budget; shared by every client of this model (the smallest Limits.grammar_cache_mb applies).
        self.cache: ByteBoundedCache[Any] = ByteBoundedCache(DEFAULT_GRAMMAR_CACHE_BYTES, _cached_bytes)
        self._serials = itertools.count()

    def special_token(self, text: str) -> int | None:
        """The id of the special token (no bytes of its own) spelled ``text``, or None if there is none."""
        with self._lock:
            if text not in self._special:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                self._special[text] = ids[0] if len(ids) == 1 and not self.token_bytes[ids[0]] else None
            return self._special[text]

    def next_serial(self) -> int:
        """A number no other grammar of this compiler has (its cache entries are named by it)."""
        with self._lock:
            return next(self._serials)

    def encode(self, text: bytes) -> list[int]:
        return list(self.tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False))

    def compile(self, schema: dict[str, Any], *, regex: str | None = None, build_index: Callable[[str], tuple[Any, int]] | None = None) -> Grammar:
        """The grammar of ``schema`` (cached by its regex). Building an index takes milliseconds for a
        small schema and seconds for a permissive one (``{"type": "object"}``): call it off the event
        loop. Raises InvalidRequestError naming what is unsupported. ``build_index``: regex → (an
        outlines_core ``Index``, its size serialised) (``isolated.ProcessIndexBuilder``: built in a
        child process, whose result arrives serialised); None builds it here and serialises it once
        to measure it (holding the GIL: ~0.1 s for the 26 MB index of ``{"type": "object"}``)."""
        from outlines_core import Index

        regex = regex if regex is not None else schema_regex(schema)
        cached = self.cache.get(regex)
        if cached is not None:
            return cached
        try:
            if build_index is not None:
                index, index_bytes = build_index(regex)
            else:
                index = Index(regex, self.vocabulary)
                index_bytes = len(pickle.dumps(index))
        except LimitExceededError:  # the builder's time limit
            raise
        except Exception:  # e.g. a pattern no sequence of tokens can match; its text names the compiler's internals
            raise InvalidRequestError(
                "The JSON schema cannot be compiled into a grammar for this model's vocabulary (e.g. a `pattern` "
                "that no sequence of tokens can match); simplify its patterns or formats."
            ) from None
        return self.cache.put(regex, Grammar(schema=schema, index=index, compiler=self, index_bytes=index_bytes, regex=regex))
