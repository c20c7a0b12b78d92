"""Grammar compilation bounded by construction (issue 50, finding 1), without a model.

A schema's regex is bounded from the schema before outlines_core builds it
(``structured/budget.regex_size_bound``); these tests check the bound against the real compiler (it
must never be below the regex it bounds, on a table of shapes and on random schemas), that a schema
past the limit is refused without building anything big, that the joined tool-call regex of a model
family is bounded the same way, that the caches keep only what succeeded within a byte budget, and
that a chat template that loops is stopped at its time limit.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentspec
from agentspec.deadline import call_with_deadline
from agentspec.errors import LimitExceededError
from agentspec.params import parse_params
from agentspec.structured.budget import ByteBoundedCache, regex_size_bound
from agentspec.structured.formats import FORMATS, call_regex
from agentspec.structured.grammar import MAX_REGEX_CHARS, schema_regex
from agentspec.structured.tools import ToolSpec
from agentspec.types import SpecConfig

build_regex_from_schema = pytest.importorskip("outlines_core.json_schema").build_regex_from_schema


def compiled_length(schema: dict) -> int | None:
    """The length of outlines_core's regex for ``schema``; None where it refuses the schema."""
    try:
        return len(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""))
    except Exception:
        return None


def array_schema(depth: int, leaf: dict | None = None) -> dict:
    schema: dict = leaf or {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def optional_objects(depth: int, width: int) -> dict:
    """Objects none of whose properties are required, nested: the n-th property is repeated n times."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"p{i}": schema for i in range(width)}}
    return schema


SHAPES = [
    pytest.param(array_schema(11), id="nested-arrays"),
    pytest.param({}, id="any-value"),
    pytest.param({"type": "object"}, id="any-object"),
    pytest.param({"type": "array", "depth": 4}, id="any-array-depth-4"),
    pytest.param(optional_objects(3, 4), id="optional-objects"),
    pytest.param({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}, id="required"),
    pytest.param({"anyOf": [{"type": "string"}, {"type": "null"}, {"enum": ["x", 'y"z', 3, None]}]}, id="anyOf-enum"),
    pytest.param({"oneOf": [{"type": "number"}, {"type": "boolean"}], "allOf": [{"type": "string"}]}, id="allOf-first"),
    pytest.param({"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}, id="recursive-ref"),
    pytest.param({"type": ["string", "integer", "array", "object", "null"]}, id="type-list"),
    pytest.param({"type": "string", "format": "email"}, id="format-email"),
    pytest.param({"type": "string", "pattern": "^[a-z]{2,8}(-[0-9]+)?$"}, id="pattern"),
    pytest.param({"type": "object", "additionalProperties": {"type": "array", "items": {"type": "number"}}}, id="additionalProperties"),
    pytest.param({"type": "array", "items": {"type": "string", "maxLength": 10**9}, "minItems": 3, "maxItems": 10**9}, id="big-bounds"),
    pytest.param({"prefixItems": [{"type": "integer"}, {"const": "\u00e9\u0000\U0001f600"}]}, id="prefixItems-unicode-const"),
]


@pytest.mark.parametrize("schema", SHAPES)
def test_the_bound_is_never_below_the_compilers_regex(schema):
    real = compiled_length(schema)
    assert real is not None, "each shape compiles"
    bound = regex_size_bound(schema, cap=10**12)
    assert real <= bound <= 4 * real + 1024, (real, bound)  # an upper bound, and not so loose it refuses ordinary schemas


LEAVES = st.sampled_from(
    [{"type": t} for t in ("string", "integer", "number", "boolean", "null")]
    + [{"type": "string", "maxLength": 5}, {"enum": ["a", "b\\", 1]}, {"const": "x"}, {"type": "string", "format": "date"}, {}]
)


def schemas() -> st.SearchStrategy[dict]:
    def extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        props = st.dictionaries(st.sampled_from(["a", "b", "c", "d", "é", 'q"']), children, min_size=1, max_size=4)
        return st.one_of(
            st.builds(lambda item: {"type": "array", "items": item}, children),
            st.builds(lambda p: {"type": "object", "properties": p}, props),
            st.builds(lambda p: {"type": "object", "properties": p, "required": sorted(p)[:1]}, props),
            st.builds(lambda options: {"anyOf": options}, st.lists(children, min_size=1, max_size=3)),
            st.builds(lambda options: {"oneOf": options}, st.lists(children, min_size=1, max_size=3)),
            st.builds(lambda extra: {"type": "object", "additionalProperties": extra}, children),
        )

    return st.recursive(LEAVES, extend, max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas())
def test_the_bound_holds_on_random_schemas(schema):
    """Fuzz: the bound is never below the real regex (bounded in time: 150 schemas of at most 12
    leaves, a few seconds)."""
    real = compiled_length(schema)
    if real is not None:
        assert regex_size_bound(schema, cap=10**12) >= real


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param(array_schema(22), id="arrays-22"),  # 1.3 KB of schema; its regex: 155 million characters
        pytest.param(array_schema(30), id="arrays-30"),  # its regex would not fit in memory
        pytest.param({"type": "array", "depth": 12}, id="any-array-depth-12"),
        pytest.param(optional_objects(3, 10), id="optional-objects"),
        pytest.param({"anyOf": [array_schema(8)] * 2000}, id="wide-anyOf"),
        pytest.param({"enum": ["x" * 1000] * 1000}, id="huge-enum"),
    ],
)
def test_a_schema_past_the_limit_is_refused_before_its_regex_is_built(schema):
    """Before: the regex was built, then measured (155 million characters for 22 nested arrays, and
    kept in a cache); now nothing bigger than the schema is allocated."""
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceededError, match=r"max_grammar_chars.*--max-grammar-chars") as refused:
            schema_regex(schema)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.code == "grammar_too_large" and refused.value.limit == "max_grammar_chars"
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB allocated to refuse it"


def test_the_limit_is_a_setting():
    schema = array_schema(6)  # 2,350 characters
    assert schema_regex(schema, max_chars=MAX_REGEX_CHARS)
    with pytest.raises(LimitExceededError):
        schema_regex(schema, max_chars=1_000)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(LimitExceededError, match=r"tools\[0\]"):
        parse_params({"tools": [tool]}, default_spec=SpecConfig(), max_grammar_chars=1_000)
    assert agentspec.Limits().max_grammar_chars == MAX_REGEX_CHARS


def test_many_tools_joined_are_bounded_as_they_are_joined():
    """Before: each tool's regex was checked, their join in a model family's call syntax not at all."""
    hermes = next(fmt for fmt in FORMATS if fmt.family == "hermes")
    tools = [ToolSpec(f"tool_{i}", "", array_schema(9)) for i in range(60)]  # 19K characters each, 1.1M joined
    with pytest.raises(LimitExceededError, match="60 tools"):
        call_regex(hermes, tools)
    assert len(call_regex(hermes, tools[:5])) < MAX_REGEX_CHARS


def test_byte_bounded_cache_keeps_the_newest_within_its_budget():
    cache: ByteBoundedCache[str] = ByteBoundedCache(1000, len)
    for i in range(50):
        cache.put(f"k{i}", "v" * 97)  # 100 bytes with the key... 100 or 101
    assert cache.bytes <= 1000 and len(cache) >= 9
    assert cache.get("k49") is not None and cache.get("k0") is None
    assert cache.put("huge", "v" * 5000) == "v" * 5000 and cache.get("huge") is None  # bigger than the budget: not kept
    first = cache.put("same", "a")
    assert cache.put("same", "b") is first  # the entry already there wins


LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def test_a_looping_chat_template_is_stopped_at_its_time_limit():
    """A template is a program: sandboxed jinja bounds ``range`` but not loops within loops. The
    render is refused at the limit, and the thread that ran it stops (it does not burn a core on)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment().from_string(LOOPING_TEMPLATE)
    before = {t.ident for t in threading.enumerate()}
    started = time.perf_counter()
    with pytest.raises(LimitExceededError, match="template_timeout_s"):
        call_with_deadline(
            template.render,
            0.3,
            lambda: LimitExceededError("over Limits.template_timeout_s", limit="template_timeout_s", code="template_timeout"),
        )
    assert time.perf_counter() - started < 30  # generous: the machine is shared; the loop alone runs for hours
    for _ in range(100):
        left = [t for t in threading.enumerate() if t.ident not in before]
        if not left:
            break
        time.sleep(0.05)
    assert not left, "the render's thread kept running after its time limit"


def test_call_with_deadline_returns_and_raises_what_the_call_does():
    assert call_with_deadline(lambda: 42, 5, lambda: AssertionError("no timeout")) == 42
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, 5, lambda: AssertionError("no timeout"))


def test_index_built_in_a_child_process_is_killed_at_its_time_limit(loaded):
    """``Limits.grammar_processes``: outlines_core cannot be interrupted on a thread (a build past its
    limit went on using a core and memory); in a child process it is killed at the limit."""
    from agentspec.structured.grammar import GrammarCompiler
    from agentspec.structured.isolated import ProcessIndexBuilder

    timeout = lambda: LimitExceededError("over Limits.grammar_timeout_s", limit="grammar_timeout_s", code="grammar_timeout")  # noqa: E731
    compiler = GrammarCompiler(loaded.token_bytes, loaded.tokenizer, loaded.stop_token_ids, loaded.device)
    isolated_build = ProcessIndexBuilder(compiler.vocabulary, processes=1, timeout_s=60, on_timeout=timeout)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 5}}, "required": ["n", "s"]}
    isolated = compiler.compile(schema, build_index=isolated_build)
    here = GrammarCompiler(loaded.token_bytes, loaded.tokenizer, loaded.stop_token_ids, loaded.device).compile(schema)
    state, other = isolated.initial_state, here.initial_state
    for token in loaded.tokenizer.encode('{"n":12,"s":"ab"}', add_special_tokens=False):
        assert bool(isolated.mask(state)[token]) and bool(here.mask(other)[token])
        state, other = isolated.next_state(state, token), here.next_state(other, token)
    assert isolated.is_complete(state) and here.is_complete(other)
    with pytest.raises(agentspec.InvalidRequestError, match="cannot be compiled into a grammar"):
        compiler.compile({}, regex="a{2,1}", build_index=isolated_build)  # the compiler refuses it in the child: its refusal, in agentspec's words

    quick = ProcessIndexBuilder(compiler.vocabulary, processes=1, timeout_s=0.3, on_timeout=timeout)
    kept = len(compiler.cache)  # the grammar above, its masks and forced texts
    started = time.perf_counter()
    with pytest.raises(LimitExceededError, match="grammar_timeout_s"):
        compiler.compile(array_schema(11), build_index=quick)  # seconds to build
    assert time.perf_counter() - started < 20  # generous: the machine is shared
    assert len(compiler.cache) == kept  # the refused build kept nothing
    import multiprocessing

    assert not [child for child in multiprocessing.active_children() if child.name == "agentspec-grammar"]


def test_masks_are_kept_within_the_grammar_budget(loaded):
    """Before: a grammar kept a [V] bool mask and a forced text for every state it reached, outside
    ``Limits.grammar_cache_mb`` (the 1 KB constant below reaches ~500 states: 26 MB of masks for this
    49,152-token vocabulary, more for larger ones, kept as long as the grammar). Now they are entries
    of the compiler's cache, within its byte budget; a mask dropped is computed again when needed,
    and a grammar in use stays more recent than its masks."""
    import gc
    import weakref

    import torch

    from agentspec.structured.grammar import GrammarCompiler

    compiler = GrammarCompiler(loaded.token_bytes, loaded.tokenizer, loaded.stop_token_ids, loaded.device)
    compiler.cache.max_bytes = 4 * 2**20  # room for ~80 masks
    schema = {"const": " ".join(f"word{i}" for i in range(150))}
    grammar = compiler.compile(schema)
    start = grammar.initial_state
    first = weakref.ref(grammar.mask(start))
    expected = grammar.mask(start).clone()
    state, reached = start, 0
    while not grammar.is_complete(state):  # one token at a time, the one the grammar forces (or holds)
        token = (grammar.forced(state) or [grammar.held(state)])[0]
        assert bool(grammar.mask(state)[token])
        state, reached = grammar.next_state(state, token), reached + 1
    assert reached * compiler.vocab_size > 4 * compiler.cache.max_bytes  # the walk's masks would take the budget 4 times over
    assert compiler.cache.bytes <= compiler.cache.max_bytes
    gc.collect()
    assert first() is None  # the first mask was dropped from the cache and freed
    assert torch.equal(grammar.mask(start), expected)  # and is computed again the same
    assert compiler.compile(schema) is grammar  # the grammar itself was kept: no second build
