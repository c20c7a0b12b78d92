"""Bad input, parameter by parameter: everything `test_bad_input.py` does not cover yet.

Every case is rejected by ``client.stream(...)`` itself (at call time, before the stream is iterated
and before any engine work) with an ``InvalidRequestError`` whose message names the parameter.
"""

from __future__ import annotations

import pytest

import agentspec

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def rejected_at_call_time(client, messages, params, needle, error=agentspec.InvalidRequestError):
    """``client.stream`` raises at once, naming the cause; nothing reached the engine."""
    requests, active = client.metrics().requests, client._runtime.running
    with pytest.raises(error, match=needle):
        client.stream(messages, **params)  # not iterated: validation must not wait for the first event
    assert client.metrics().requests == requests
    assert client._runtime.running == active


# -- messages ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "messages, needle",
    [
        pytest.param({"role": "user", "content": "hi"}, "`messages`", id="a-single-dict"),
        pytest.param([{"content": "hi"}], r"messages\[0\].*role", id="role-missing"),
        pytest.param([{"role": 1, "content": "hi"}], r"messages\[0\].*role", id="role-not-a-string"),
        pytest.param([{"role": "user", "content": ["hi"]}], r"messages\[0\].*text content parts", id="part-not-a-dict"),
        pytest.param([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"messages\[0\].*text content parts", id="part-text-not-a-string"),
        pytest.param([{"role": "user", "content": {"type": "text", "text": "x"}}], r"messages\[0\].*`content`", id="content-a-dict"),
        pytest.param([*USER, {"role": "assistant", "tool_calls": "x"}], r"messages\[1\].*`tool_calls`", id="tool-calls-not-a-list"),
        pytest.param([*USER, {"role": "assistant", "tool_calls": [{"function": {}}]}], r"messages\[1\].*tool call needs", id="tool-call-without-name"),
        pytest.param([*USER, {"role": "assistant", "tool_calls": ["f()"]}], r"messages\[1\].*tool call needs", id="tool-call-a-string"),
        pytest.param([*USER, {"role": "assistant", "tool_calls": []}], r"messages\[1\].*content", id="empty-tool-calls-no-content"),
        pytest.param([{"role": "tool", "content": "sunny", "tool_call_id": "c1"}], "at least one 'user'", id="only-a-tool-message"),
        pytest.param(
            [*USER, {"role": "tool", "content": "sunny"}],
            r"messages\[1\].*tool_call_id",
            id="tool-message-without-tool-call-id",
        ),
        pytest.param(
            [*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
            r"messages\[1\].*arguments",
            id="tool-call-arguments-a-number",
        ),
    ],
)
async def test_bad_message_shapes(client, messages, needle):
    rejected_at_call_time(client, messages, {}, needle)


# -- sampling parameters: wrong types and ranges not in test_bad_input.py ----------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 1e3}, "max_tokens"),
        ({"max_tokens": [5]}, "max_tokens"),
        ({"temperature": True}, "temperature"),
        ({"temperature": INF}, "temperature"),
        ({"temperature": [0.5]}, "temperature"),
        ({"temperature": -INF}, "temperature"),
        ({"top_p": "0.9"}, "top_p"),
        ({"top_p": NAN}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": NAN}, "min_p"),
        ({"min_p": "low"}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": INF}, "repetition_penalty"),
        ({"repetition_penalty": "1.1"}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": [1]}, "seed"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"parallel_tool_calls": 0}, "parallel_tool_calls"),
        ({"tag": ""}, "tag"),
        ({"tag": "x" * 65}, "tag"),
        ({"tag": "a/b"}, "tag"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": NAN}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"timeout": [1]}, "timeout"),
    ],
    ids=repr,
)
async def test_bad_sampling_parameters(client, params, needle):
    rejected_at_call_time(client, USER, params, needle)


# -- stop ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "stop",
    [5, "", b"x", {"a"}, {"a": "b"}, ["a", None], ["a", ""], [["a"]], (s for s in ["a"]), [f"s{i}" for i in range(17)]],
    ids=["int", "empty-string", "bytes", "set", "dict", "none-item", "empty-item", "nested-list", "generator", "17-distinct"],
)
async def test_bad_stop(client, stop):
    rejected_at_call_time(client, USER, {"stop": stop}, "`stop`")


# -- tools and tool_choice --------------------------------------------------------------------------

@pytest.mark.parametrize(
    "params, needle",
    [
        pytest.param({"tools": TOOL, "tool_choice": "required"}, "`tools`", id="tools-a-dict"),
        pytest.param({"tools": ["get_weather"], "tool_choice": "required"}, "`tools`", id="tools-item-a-string"),
        pytest.param({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, r"tools\[0\]", id="not-a-function-tool"),
        pytest.param({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, r"tools\[0\]", id="empty-name"),
        pytest.param({"tools": [{"type": "function", "function": {"name": 5}}], "tool_choice": "required"}, r"tools\[0\]", id="name-not-a-string"),
        pytest.param({"tools": [{"type": "function", "function": "get_weather"}], "tool_choice": "required"}, r"tools\[0\]", id="function-a-string"),
        pytest.param({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tool_choice": "required"},
                     r"tools\[0\]\.function\.parameters", id="parameters-not-an-object"),
        pytest.param({"tools": [TOOL, TOOL], "tool_choice": "required"}, "unique", id="duplicate-names"),
        pytest.param({"tools": [TOOL], "tool_choice": 5}, "`tool_choice`", id="choice-an-int"),
        pytest.param({"tools": [TOOL], "tool_choice": ["required"]}, "`tool_choice`", id="choice-a-list"),
        pytest.param({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice names 'nope'", id="choice-unknown-name"),
        pytest.param({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", id="choice-without-function"),
        pytest.param({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "needs `tools`", id="named-choice-without-tools"),
        pytest.param({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", id="forced-call-and-response-format"),
        pytest.param(
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": "get_weather"}},
            "tool_choice",
            id="choice-function-a-string",
        ),
        pytest.param(
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": None}},
            "tool_choice",
            id="choice-function-none",
        ),
        pytest.param(
            {"tools": [{"type": "function", "function": {"name": 'say "hi"'}}], "tool_choice": "required"},
            r"tools\[0\].*name",
            id="name-with-a-quote",
        ),
    ],
)
async def test_bad_tools(client, params, needle):
    rejected_at_call_time(client, USER, params, needle)


# -- response_format and schemas ----------------------------------------------------------------------

class NotAModel:
    pass


@pytest.mark.parametrize(
    "response_format, needle",
    [
        pytest.param("json", "`response_format`", id="a-string"),
        pytest.param({}, "`response_format`", id="no-type"),
        pytest.param({"type": "xml"}, "`response_format`", id="unknown-type"),
        pytest.param({"type": "json_schema"}, r"`response_format\.json_schema\.schema`", id="no-json-schema"),
        pytest.param({"type": "json_schema", "json_schema": {"name": "x"}}, r"`response_format\.json_schema\.schema`", id="no-schema"),
        pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, r"`response_format\.json_schema\.schema`", id="schema-a-string"),
        pytest.param({"type": "json_schema", "json_schema": "x"}, r"`response_format\.json_schema\.schema`", id="json-schema-a-string"),
        pytest.param(NotAModel, "`response_format`", id="a-plain-class"),
        pytest.param(agentspec.Usage(), "`response_format`", id="a-model-instance"),
        pytest.param([{"type": "json_object"}], "`response_format`", id="a-list"),
    ],
)
async def test_bad_response_format(client, response_format, needle):
    rejected_at_call_time(client, USER, {"response_format": response_format}, needle)


def json_schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


@pytest.mark.parametrize(
    "schema, needle",
    [
        pytest.param({"not": {"type": "string"}}, "not", id="not"),
        pytest.param({"type": "string", "format": "hostname"}, "hostname", id="format-hostname"),
        pytest.param({"type": "banana"}, "banana", id="unknown-type"),
        pytest.param({"$ref": "#/definitions/nope"}, "definitions", id="dangling-ref"),
        pytest.param({"type": "object", "default": object()}, "JSON-serialisable", id="not-serialisable"),
        pytest.param(
            {"type": "integer", "multipleOf": 3},
            "multipleOf",
            id="multipleOf-ignored",
        ),
    ],
)
async def test_unsupported_schema_keywords(client, schema, needle):
    rejected_at_call_time(client, USER, {"response_format": json_schema(schema)}, needle)


async def test_unsupported_schema_in_a_tool_names_the_tool(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"h": {"type": "string", "format": "hostname"}}}}}
    rejected_at_call_time(client, USER, {"tools": [tool], "tool_choice": "required"}, r"tools\[0\]")


# -- unknown keyword arguments and `speculative` ------------------------------------------------------

@pytest.mark.parametrize(
    "name",
    ["max_completion_tokens", "n", "stream", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user", "stop_sequences", "Temperature"],
)
async def test_unknown_keyword_arguments(client, name):
    rejected_at_call_time(client, USER, {name: 1}, f"Unknown parameter.*'{name}'")


async def test_unknown_keyword_arguments_are_all_named(client):
    rejected_at_call_time(client, USER, {"foo": 1, "bar": 2, "max_tokens": 3}, "'bar', 'foo'")


async def test_generate_rejects_like_stream(client):
    with pytest.raises(agentspec.InvalidRequestError, match="top_k"):
        await client.generate(USER, top_k="many")


@pytest.mark.parametrize("speculative", [1, 0, "false", {"enabled": False}, [True], agentspec.SpecConfig], ids=repr)
async def test_bad_speculative(client, speculative):
    rejected_at_call_time(client, USER, {"speculative": speculative}, "`speculative`")


# -- SpecConfig and the Client constructor -------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"max_draft_tokens": 33}, "max_draft_tokens"),
        ({"max_draft_tokens": 2.5}, "max_draft_tokens"),
        ({"max_draft_tokens": "many"}, "max_draft_tokens"),
        ({"ngram_min": 0}, "ngram_min"),
        ({"ngram_max": 17}, "ngram_max"),
        ({"enabled": "maybe"}, "enabled"),
        ({"adaptive": None}, "adaptive"),
        ({"K": 4}, "K"),
        ({"sources": ("ngrams",)}, "sources"),
        ({"sources": ()}, "sources"),
        ({"sources": ("ngram", "ngram")}, "twice"),
    ],
    ids=repr,
)
def test_bad_spec_config_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        agentspec.SpecConfig(**kwargs)


def test_spec_config_errors_are_in_the_agentspec_tree():
    with pytest.raises(agentspec.InvalidRequestError, match="max_draft_tokens"):
        agentspec.SpecConfig(max_draft_tokens=-1)


def test_spec_config_is_frozen():
    spec = agentspec.SpecConfig()
    with pytest.raises(ValueError, match="frozen"):
        spec.max_draft_tokens = 3


@pytest.mark.parametrize("spec", [None, True, 4, "fast"], ids=repr)
def test_client_rejects_a_bad_spec(spec):
    with pytest.raises(agentspec.InvalidRequestError, match="`spec`"):
        agentspec.Client(spec=spec)


@pytest.mark.parametrize("draft", [5, "", "early-exit:", "early-exit:four", "early-exit:-2", ["early-exit:4"]], ids=repr)
def test_client_rejects_a_malformed_draft(draft):
    with pytest.raises(agentspec.InvalidRequestError, match="draft"):
        agentspec.Client(draft=draft)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        pytest.param({"model": 123}, "model", id="model-an-int"),
        pytest.param({"device": "banana"}, "device", id="device-unknown"),
        pytest.param({"dtype": "float64"}, "dtype", id="dtype-unknown"),
        pytest.param({"dtype": 5}, "dtype", id="dtype-an-int"),
    ],
)
def test_client_constructor_validates_eagerly(kwargs, needle):
    with pytest.raises(agentspec.InvalidRequestError, match=needle):
        agentspec.Client(**kwargs)
