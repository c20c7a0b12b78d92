"""What a JSON schema's grammar will cost, known before it is built; and a cache bounded in bytes.

outlines_core turns a schema into one regular expression by pasting each part's regex into its
parent's, so a few bytes of schema can stand for an enormous regex: an array's item regex appears
twice (``\\[((item)(,(item)){0,})?\\]``), so 22 nested arrays (1.3 KB of schema) make a regex of
hundreds of millions of characters; an object none of whose properties are required repeats its
n-th property n times; ``{"type": "array", "depth": 8}`` alone is tens of millions. Building such a
regex and then measuring it costs the seconds and the memory the limit is there to prevent, so
``regex_size_bound`` computes an upper bound of its length from the schema, following the compiler's
own rules, in time linear in the schema's size; ``schema_regex`` refuses a schema whose bound is over
``Limits.max_grammar_chars`` before any regex is built.

The bound mirrors outlines_core's ``json_schema/parsing.rs`` (the first of ``properties``, ``allOf``,
``anyOf``, ``oneOf``, ``prefixItems``, ``enum``, ``const``, ``$ref``, ``type`` decides how a schema
is read; ``$ref`` is followed at most ``MAX_REF_DEPTH`` deep) with generous constants; tests check
it against the real compiler on many schemas (it must never be below the real length).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, TypeVar

__all__ = ["regex_size_bound", "ByteBoundedCache", "MAX_REF_DEPTH", "KEY_BYTES"]

MAX_REF_DEPTH = 4  # outlines_core follows a reference chain 3 deep (one more to be safe), then drops it
# Measured on outlines_core 0.2 with compact whitespace (the constants are rounded up):
SCALARS = {"null": 4, "boolean": 12, "integer": 48, "number": 96, "string": 80}  # with digit and length bounds
SCALAR = max(SCALARS.values())
FORMAT = 512  # a string ``format``: 58 (date) to 448 (email)
NODE = 16  # the brackets and groups a node adds around its parts (an array: 18, and its item bounds)
# A value of any type (an array without ``items``, an object without ``properties``) nests other
# values ``depth`` levels deep (default 2): 6,380 characters for an array, 6,428 for an object at
# depth 2, times a little over 4 for each level more (104K at 4, 416K at 5, 1.7M at 6).
ANY_VALUE = 6600
ANY_VALUE_GROWTH = 4.1
DEFAULT_ANY_DEPTH = 2
KEY_BYTES = 64  # what a cache key that is not a string costs (a tuple of small ints, say)

Value = TypeVar("Value")


def _literal(value: Any) -> int:
    """A bound of a JSON literal's length as a regex (every character escaped at worst)."""
    try:
        return 2 * len(json.dumps(value, ensure_ascii=False)) + 2
    except (TypeError, ValueError):
        return NODE


def _digits(node: dict[str, Any], *keys: str) -> int:
    return sum(len(str(node[key])) + 1 for key in keys if isinstance(node.get(key), int))


def _any_value(node: dict[str, Any], cap: int) -> int:
    depth = node.get("depth", DEFAULT_ANY_DEPTH)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        depth = DEFAULT_ANY_DEPTH
    levels = max(depth - DEFAULT_ANY_DEPTH, 0)
    size = float(ANY_VALUE)
    for _ in range(levels):  # stop multiplying once past the cap: the answer is "too big" already
        size *= ANY_VALUE_GROWTH
        if size > cap:
            return cap + 1
    return int(size)


def regex_size_bound(schema: Any, *, cap: int) -> int:
    """An upper bound of the length of the regex outlines_core builds for ``schema``, or ``cap + 1``
    as soon as the bound passes ``cap`` (the caller refuses then; nothing bigger is computed).

    Memoised per (node, reference depth), so a schema whose references fan out is measured in time
    proportional to its size times ``MAX_REF_DEPTH``, never in the size of the regex."""
    root = schema
    memo: dict[tuple[int, int], int] = {}

    def resolve(ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None  # the compiler refuses it (external references); its error says so
        node: Any = root
        for part in ref[1:].split("/"):
            if not part:
                continue
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def size(node: Any, ref_depth: int) -> int:
        key = (id(node), ref_depth)
        if key not in memo:
            memo[key] = min(measure(node, ref_depth), cap + 1)
        return memo[key]

    def total(parts: Any, ref_depth: int) -> int:
        if not isinstance(parts, list):
            return NODE
        found = NODE
        for part in parts:
            found += size(part, ref_depth) + 4  # "|" and a group; oneOf's "(?:...)"
            if found > cap:
                return cap + 1
        return found

    def measure(node: Any, ref_depth: int) -> int:
        if not isinstance(node, dict):
            return NODE  # the compiler refuses it
        if not node:
            return 2 * ANY_VALUE + 512  # any JSON value: the array's and object's, and the scalars
        if "properties" in node:
            return properties(node, ref_depth)
        for keyword in ("allOf", "anyOf", "oneOf", "prefixItems"):
            if keyword in node:
                return total(node[keyword], ref_depth)
        if "enum" in node:
            choices = node["enum"]
            return NODE + (sum(_literal(choice) + 1 for choice in choices) if isinstance(choices, list) else 0)
        if "const" in node:
            return NODE + _literal(node["const"])
        if "$ref" in node:
            target = resolve(node["$ref"])
            if ref_depth >= MAX_REF_DEPTH or target is None:
                return NODE
            return NODE + size(target, ref_depth + 1)
        kinds = node.get("type")
        if isinstance(kinds, list):
            return NODE + sum(typed(node, kind, ref_depth) + 6 for kind in kinds)
        return typed(node, kinds, ref_depth)

    def typed(node: dict[str, Any], kind: Any, ref_depth: int) -> int:
        if kind == "string":
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                return NODE + len(pattern)
            return FORMAT if "format" in node else SCALAR
        if kind == "array":
            items = node.get("items")
            if items is None:
                return _any_value(node, cap)
            return 20 + _digits(node, "minItems", "maxItems") + 2 * size(items, ref_depth)  # \\[((item)(,(item)){min,max})?\\]
        if kind == "object":
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                return 4 * NODE + 2 * (SCALAR + size(extra, ref_depth))
            return _any_value(node, cap)
        return SCALARS.get(kind, NODE) if isinstance(kind, str) else NODE

    def properties(node: dict[str, Any], ref_depth: int) -> int:
        props = node.get("properties")
        if not isinstance(props, dict):
            return NODE
        required = node.get("required")
        required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
        parts = [_literal(name) + 8 + size(value, ref_depth) for name, value in props.items()]  # ("name":value,)?
        if required & set(props):
            found = NODE + sum(parts)
        else:  # no property required: the n-th alternative repeats every property before it
            n = len(parts)
            found = NODE + sum((n - i) * part for i, part in enumerate(parts))
        return found

    return size(schema, 0)


class ByteBoundedCache(Generic[Value]):
    """A least-recently-used map bounded in bytes (each value's size given by ``size_of``, a string
    key's by its length, any other key's by ``KEY_BYTES``): what one caller can make the process keep
    is bounded however large each entry is. Keeps only what it is given: callers put successes only.
    A value bigger than the whole budget is not kept. Thread-safe."""

    def __init__(self, max_bytes: int, size_of: Callable[[Value], int]) -> None:
        self.max_bytes = max_bytes
        self.size_of = size_of
        self.bytes = 0
        self._entries: OrderedDict[Hashable, tuple[Value, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Value | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: Value) -> Value:
        """Keep ``value`` under ``key`` (an entry already there wins, so callers share one object)."""
        cost = self.size_of(value) + (len(key) if isinstance(key, str) else KEY_BYTES)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key][0]
            if cost > self.max_bytes:
                return value
            self._entries[key] = (value, cost)
            self.bytes += cost
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
            return value
