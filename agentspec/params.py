"""Request parameters: validated once, before any work starts, into an immutable ``GenerationParams``.

Everything a caller can get wrong raises :class:`~agentspec.errors.InvalidRequestError` naming the
parameter and the fix. Defaults are chosen for agent traffic: greedy decoding (``temperature=0``),
because agents want reproducible tool calls and greedy output is where speculation pays most.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequestError
from .structured.grammar import schema_from_response_format
from .structured.tools import ToolSpec, call_schema, parse_tools
from .types import Limits, SpecConfig

__all__ = ["GenerationParams", "parse_params", "PARAM_NAMES", "check_json_depth", "json_depth"]

MAX_STOP_STRINGS = 16
# Text that could still become a stop string is held back and re-checked at every step (on the engine
# thread every request shares), at a cost that grows with the stop's length: a stop string is a
# marker, not a document.
MAX_STOP_CHARS = 512
TAG = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # a traffic class; also a Prometheus label value
MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflow float32; 0 means greedy

PARAM_NAMES = frozenset(
    {
        "tools",
        "tool_choice",
        "response_format",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop",
        "seed",
        "speculative",
        "parallel_tool_calls",
        "tag",
        "timeout",
        "cache_salt",
    }
)
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """One request's decoding settings. ``max_tokens=None`` means: up to the context window."""

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    spec: SpecConfig = SpecConfig()
    schema: dict[str, Any] | None = None  # structured output: the JSON schema the text must follow
    response_model: Any = None  # the pydantic class when response_format was one (Completion.parsed)
    tools: tuple[ToolSpec, ...] = ()  # described to the model in the prompt
    tool_mode: str = "off"  # "off" | "auto" (text or calls) | "forced" (calls from the first token)
    parallel_tool_calls: bool = False  # a tool reply may hold several calls, one per line
    tag: str | None = None  # traffic class: metrics are also aggregated per tag
    timeout: float | None = None  # seconds from submission until RequestTimeoutError
    cache_salt: str | None = None  # requests share cached keys/values and earlier outputs only within one salt (a tenant)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _given(params: dict[str, Any], name: str, default: Any) -> Any:
    """The parameter's value; None (as OpenAI-shaped callers send for "not set") means the default."""
    value = params.get(name)
    return default if value is None else value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"`{name}` must be a finite number, got {value!r}.")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"`{name}` must be an integer, got {value!r}.")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError(f"`stop` must be a string or a list of strings, got {value!r}.")
    if any(s == "" for s in stops):
        raise InvalidRequestError("`stop` strings must not be empty; remove the empty string.")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"`stop` takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidRequestError(f"`stop` strings may be at most {MAX_STOP_CHARS} characters long, got one of {longest}; stop on a shorter marker.")
    return tuple(dict.fromkeys(stops))


def _spec(value: Any, default: SpecConfig) -> SpecConfig:
    if value is None or value is True:
        return default
    if value is False:
        return default.model_copy(update={"enabled": False})
    if isinstance(value, SpecConfig):
        return value
    raise InvalidRequestError(f"`speculative` must be a bool or an agentspec.SpecConfig, got {value!r}.")


def json_depth(value: Any, stop_past: int) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar: 0, ``[]``: 1, ``{"a": [1]}``: 2), counted
    without recursion, so a value nested deeper than Python's stack is measured rather than crashing
    the counter. Stops early once past ``stop_past``: the answer is then ``stop_past + 1``."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > stop_past:
            return stop_past + 1
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest


def check_json_depth(where: str, value: Any, limit: int) -> None:
    """Refuse ``value`` (messages, tools, a schema) when it nests deeper than ``Limits.max_json_depth``:
    schema translation, template rendering and validation all recurse, and a few kilobytes of
    brackets would otherwise overflow the stack (a ``RecursionError`` deep inside a library)."""
    if json_depth(value, limit) > limit:
        raise InvalidRequestError(
            f"`{where}` nests deeper than {limit} levels of lists and objects (Limits.max_json_depth; "
            "agentspec serve --max-json-depth); flatten it."
        )


def _structure(params: dict[str, Any], max_grammar_chars: int) -> tuple[tuple[ToolSpec, ...], str, dict[str, Any] | None, Any]:
    """(tools, tool mode, the grammar's schema, the pydantic response model)."""
    tools, choice = params.get("tools"), params.get("tool_choice")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError(f"`tools` must be a list of OpenAI function tool dicts, got {type(tools).__name__}.")
    if choice is not None and not (choice in ("none", "auto", "required") or isinstance(choice, dict)):
        raise InvalidRequestError(
            f"`tool_choice` must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}."
        )
    specs, mode, forced_name = parse_tools(tools, choice, max_grammar_chars=max_grammar_chars)
    structured = schema_from_response_format(params.get("response_format"))
    if mode != "off":
        if structured is not None:
            raise InvalidRequestError(
                "Tool calls and `response_format` exclude each other; pass tool_choice='none' to answer with "
                "`response_format`, or drop `response_format`."
            )
        return tuple(specs), mode, call_schema(specs, forced_name), None
    schema, model = structured if structured is not None else (None, None)
    return tuple(specs), "off", schema, model


def parse_params(
    params: dict[str, Any],
    *,
    default_spec: SpecConfig,
    max_json_depth: int = Limits().max_json_depth,
    max_grammar_chars: int = Limits().max_grammar_chars,
) -> GenerationParams:
    """Validate keyword arguments of ``Client.stream``/``generate`` into ``GenerationParams`` (the
    ``Limits`` fields of the same names bound nesting and each tool's grammar)."""
    unknown = sorted(set(params) - PARAM_NAMES)
    if unknown:
        raise InvalidRequestError(
            f"Unknown parameter(s) {', '.join(map(repr, unknown))}; "
            f"valid parameters are: {', '.join(sorted(PARAM_NAMES))}."
        )
    for name in ("tools", "tool_choice", "response_format", "stop"):
        check_json_depth(name, params.get(name), max_json_depth)
    tools, tool_mode, schema, response_model = _structure(params, max_grammar_chars)
    # Off unless asked for (OpenAI's default is on): given the choice, SmolLM2-135M repeats the call it
    # just made ("weather in Zürich" twice) instead of ending its reply.
    parallel = _given(params, "parallel_tool_calls", False)
    if not isinstance(parallel, bool):
        raise InvalidRequestError(f"`parallel_tool_calls` must be a bool, got {parallel!r}.")

    max_tokens = params.get("max_tokens")
    if max_tokens is not None and _integer("max_tokens", max_tokens) < 1:
        raise InvalidRequestError(f"`max_tokens` must be at least 1, got {max_tokens}.")

    temperature = _number("temperature", _given(params, "temperature", 0.0))
    if temperature < 0:
        raise InvalidRequestError(f"`temperature` must be >= 0 (0 = greedy), got {temperature}.")
    if 0 < temperature < MIN_TEMPERATURE:
        raise InvalidRequestError(f"`temperature` {temperature} is too small to sample with; use 0 for greedy decoding.")
    top_p = _number("top_p", _given(params, "top_p", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError(f"`top_p` must be in (0, 1], got {top_p}; use 1 to disable it.")
    top_k = _integer("top_k", _given(params, "top_k", 0))
    if top_k < 0:
        raise InvalidRequestError(f"`top_k` must be >= 0 (0 disables it), got {top_k}.")
    min_p = _number("min_p", _given(params, "min_p", 0.0))
    if not 0.0 <= min_p < 1.0:
        raise InvalidRequestError(f"`min_p` must be in [0, 1), got {min_p}; use 0 to disable it.")
    penalty = _number("repetition_penalty", _given(params, "repetition_penalty", 1.0))
    if penalty <= 0:
        raise InvalidRequestError(f"`repetition_penalty` must be > 0 (1 disables it), got {penalty}.")
    seed = params.get("seed")
    if seed is not None and not 0 <= _integer("seed", seed) < 2**64:
        raise InvalidRequestError(f"`seed` must be in [0, 2**64), got {seed}.")

    tag = params.get("tag")
    if tag is not None and not (isinstance(tag, str) and TAG.fullmatch(tag)):
        raise InvalidRequestError(f"`tag` must be 1-64 characters of letters, digits, '_', '-', '.' or ':', got {tag!r}.")
    salt = params.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise InvalidRequestError(f"`cache_salt` must be a string of 1-{MAX_CACHE_SALT_CHARS} characters, got {type(salt).__name__}.")
    timeout = params.get("timeout")
    if timeout is not None and _number("timeout", timeout) <= 0:
        raise InvalidRequestError(f"`timeout` must be a positive number of seconds, got {timeout!r}.")

    return GenerationParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=penalty,
        stop=_stop(params.get("stop")),
        seed=seed,
        spec=_spec(params.get("speculative"), default_spec),
        schema=schema,
        response_model=response_model,
        tools=tools,
        tool_mode=tool_mode,
        parallel_tool_calls=parallel,
        tag=tag,
        timeout=float(timeout) if timeout is not None else None,
        cache_salt=salt,
    )
