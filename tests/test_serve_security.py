"""``agentspec serve`` against hostile input (issue 50, the server side): one real server process on
loopback for the module, started with small limits so each can be reached in a few requests.

Each test sends what an attacker would (a body nested past the parser's stack, a foreign ``Host``, a
cross-site ``text/plain`` POST, idle sockets, a trickled body, thousands of tags, a client asking for
shadow re-decodes) and checks the typed refusal, and that the server keeps serving. Pure checks of
the same bounds (the depth counter, the tag bound, the shadow queue, error wording) run without a
server at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import agentspec
from agentspec.metrics import OTHER_TAG, MetricsAggregator
from agentspec.params import GenerationParams, json_depth, parse_params
from agentspec.types import SpecConfig, SpecStats
from tests.processes import ServerProcess, agentspec_serve

httpx = pytest.importorskip("httpx")
pytest.importorskip("agentspec.serve", reason="the serve extra is not installed: pip install 'agentspec-llm[serve]'")

API_KEY = "test-security-key"
START_TIMEOUT_S = 600  # loading and calibrating on a busy 2-core machine has taken 2.5 minutes
MAX_JSON_DEPTH = 32
MAX_TAGS = 2
LIMIT_CONCURRENCY = 6
MAX_HEADER_BYTES = 4096
KEEP_ALIVE_S = 2
BODY_TIMEOUT_S = 2
EXTRA_HOST = "api.example.test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server_process():
    process = agentspec_serve(
        "--api-key", API_KEY, "--prefix-cache-mb", "0",
        "--max-json-depth", str(MAX_JSON_DEPTH), "--max-tags", str(MAX_TAGS), "--allowed-host", EXTRA_HOST,
        "--limit-concurrency", str(LIMIT_CONCURRENCY), "--max-header-bytes", str(MAX_HEADER_BYTES),
        "--timeout-keep-alive", str(KEEP_ALIVE_S), "--body-timeout-s", str(BODY_TIMEOUT_S), start_timeout_s=START_TIMEOUT_S,
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture(scope="module")
def server(server_process: ServerProcess) -> str:
    """The server root, ``http://127.0.0.1:PORT``."""
    return server_process.wait_ready().removesuffix("/v1")


@pytest.fixture(scope="module")
async def http(server: str):
    async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
async def model(http) -> str:
    return (await http.get("/v1/models")).json()["data"][0]["id"]


def port_of(server: str) -> int:
    return int(server.rsplit(":", 1)[1])


async def chat(http, body: dict | str) -> httpx.Response:
    """POST a chat body: a dict, or JSON text already written (too deep for ``json.dumps`` to write)."""
    if isinstance(body, str):
        return await http.post(CHAT, content=body.encode(), headers={"content-type": "application/json"})
    return await http.post(CHAT, json=body)


def assert_error(reply: httpx.Response, status: int, code: str | None = None, *words: str) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    for word in words:
        assert word in error["message"], error["message"]
    return error


def nested(depth: int, leaf: object = 1) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def array_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


async def wait_idle(http, within_s: float = 30) -> None:
    started = time.perf_counter()
    while (await http.get("/health")).json()["pending_requests"]:
        assert time.perf_counter() - started < within_s, "the server still has requests in flight"
        await asyncio.sleep(0.02)


def metric(text: str, series: str) -> float | None:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


# -- 1. a request's shape: depth, fields, wording --------------------------------------------------


@pytest.mark.parametrize(
    "make_body",
    [
        lambda model: {"model": model, "messages": [{"role": "user", "content": nested(MAX_JSON_DEPTH)}]},
        lambda model: {"model": model, "messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": array_schema(600)}}},
        lambda model: {"model": model, "messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f", "parameters": array_schema(600)}}]},
        lambda model: json.dumps({"model": model, "messages": QUESTION, "metadata": 0})[:-2] + "[" * 100_000 + "]" * 100_000 + "}",
    ],
    ids=["messages", "response_format_schema", "tool_schema", "past_the_parsers_stack"],  # the last: RecursionError in json
)
async def test_deep_json_is_a_400_naming_the_limit(http, model, make_body):
    """Before: RecursionError inside a validator or the parser, HTTP 500."""
    reply = await chat(http, make_body(model))
    assert_error(reply, 400, "json_too_deep", "max_json_depth", "--max-json-depth", str(MAX_JSON_DEPTH))
    assert (await chat(http, {"model": model, "messages": QUESTION, "max_tokens": 2})).status_code == 200


async def test_body_at_the_depth_limit_is_served(http, model):
    body = {"model": model, "messages": QUESTION, "max_tokens": 2, "metadata": nested(MAX_JSON_DEPTH - 1)}  # the body itself is one level
    assert (await chat(http, body)).status_code == 200


@pytest.mark.parametrize(
    "speculative, field",
    [({"self": 1}, "'self'"), ({"max_draft_tokens": 99}, "`max_draft_tokens`=99"), ({"sources": ["grammar", "nope"]}, "'nope'")],
    ids=["self", "out_of_range", "unknown_source"],
)
async def test_bad_speculative_fields_are_a_400_naming_the_field(http, model, speculative, field):
    """Before: ``{"self": 1}`` was a TypeError and the connection dropped with no reply."""
    reply = await chat(http, {"model": model, "messages": QUESTION, "speculative": speculative})
    error = assert_error(reply, 400, None, "`speculative`", field)
    assert "pydantic" not in error["message"] and "\n" not in error["message"]


async def test_schema_compiler_errors_are_in_agentspecs_words(http, model):
    """Before: outlines_core's text (``... supported by Outlines``, ``please open an issue``)."""
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "moon-phase"}}}
    reply = await chat(http, {"model": model, "messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    error = assert_error(reply, 400, None, "'moon-phase'", "tools[0]")
    assert "outlines" not in error["message"].lower() and "issue" not in error["message"]


async def test_unparsable_body_error_quotes_no_parser_internals(http):
    reply = await http.post(CHAT, content=b'{"model": [1, 2', headers={"content-type": "application/json"})
    error = assert_error(reply, 400, None, "not valid JSON", "line 1")
    assert "Expecting" not in error["message"]  # the json module's wording


# -- 2. bounded state: tags, shadow checks ---------------------------------------------------------


async def test_metric_tags_are_bounded(http, model, server_process):
    """Before: every new tag made series of its own, forever."""
    tags = [f"security-tag-{i}" for i in range(MAX_TAGS + 3)]
    for tag in tags:
        reply = await chat(http, {"model": model, "messages": QUESTION, "max_tokens": 1, "tag": tag})
        assert reply.status_code == 200
    await wait_idle(http)
    text = (await http.get("/metrics")).text
    shown = set(re.findall(r'tag="([^"]+)"', text))
    assert shown == {*tags[:MAX_TAGS], OTHER_TAG}
    assert metric(text, f'agentspec_tag_requests_total{{tag="{OTHER_TAG}"}}') == 3
    said = [line for line in server_process.lines if "distinct request tags" in line]
    assert len(said) == 1 and "--max-tags" in said[0]


async def test_a_client_cannot_turn_on_shadow_checks(http, model):
    """Before: ``shadow_rate: 1.0`` queued a plain re-decode of each such request."""
    for _ in range(2):
        body = {"model": model, "messages": QUESTION, "max_tokens": 8, "speculative": {"shadow_rate": 1.0}}
        assert (await chat(http, body)).status_code == 200
    await wait_idle(http)
    await asyncio.sleep(1.5)  # a shadow check of 8 tokens runs in well under a second once idle
    assert metric((await http.get("/metrics")).text, "agentspec_shadow_checks_total") == 0


# -- 3. a server safe to expose: Host, Content-Type, connections, headers, body time ---------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.nip.io"])
async def test_foreign_host_is_403(server, host):
    """Before: served (DNS rebinding reaches a loopback server from a web page)."""
    async with httpx.AsyncClient(base_url=server) as anonymous:
        for path in ("/health", "/v1/models"):
            reply = await anonymous.get(path, headers={"host": host})
            assert_error(reply, 403, "host_not_allowed", "--allowed-host")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", EXTRA_HOST])
async def test_allowed_hosts_are_served(server, host):
    async with httpx.AsyncClient(base_url=server) as anonymous:
        reply = await anonymous.get("/health", headers={"host": f"{host}:{port_of(server)}"})
        assert reply.status_code == 200 and reply.json()["status"] == "ok"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None])
async def test_post_without_json_content_type_is_415(http, model, content_type):
    """Before: a ``text/plain`` POST (which a browser sends cross-site without a preflight) was served."""
    body = json.dumps({"model": model, "messages": QUESTION, "max_tokens": 1}).encode()
    headers = {"content-type": content_type} if content_type else {}
    request = http.build_request("POST", CHAT, content=body, headers=headers)
    if content_type is None:
        request.headers.pop("content-type", None)
    assert_error(await http.send(request), 415, "unsupported_media_type", "application/json")
    reply = await http.post(CHAT, content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert reply.status_code == 200


def raw_request(path: str, *, extra: str = "", host: str = "127.0.0.1") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


async def test_idle_connections_past_the_limit_get_503(server):
    """Before: uvicorn ran without ``limit_concurrency``: every socket a caller opens is served."""
    port = port_of(server)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMIT_CONCURRENCY)]
    try:
        await asyncio.sleep(0.3)  # the server accepts them
        async with httpx.AsyncClient(base_url=server) as anonymous:
            assert (await anonymous.get("/health")).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    async with httpx.AsyncClient(base_url=server) as anonymous:
        for _ in range(50):  # the server notices the closed sockets
            if (await anonymous.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the server kept refusing after the idle sockets closed")


def exchange(port: int, data: bytes, *, wait_s: float) -> tuple[bytes, float]:
    """Send ``data`` on a new connection; what comes back until the server closes it (or ``wait_s``),
    and the seconds until it closed."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        received = b""
        try:
            while piece := sock.recv(65536):
                received += piece
        except TimeoutError:
            pass
    return received, time.perf_counter() - started


async def test_oversized_headers_are_refused(server):
    """A request head that grows past ``--max-header-bytes`` before it ends is refused, not buffered on."""
    port = port_of(server)
    unfinished = raw_request("/health").removesuffix(b"\r\n") + f"X-Pad: {'a' * 2 * MAX_HEADER_BYTES}".encode()
    reply, _ = await asyncio.to_thread(exchange, port, unfinished, wait_s=10)
    assert re.match(rb"HTTP/1.1 (400|431) ", reply), reply[:200]
    normal, _ = await asyncio.to_thread(exchange, port, raw_request("/health", extra="Connection: close\r\n"), wait_s=10)
    assert normal.startswith(b"HTTP/1.1 200 ")


async def test_idle_keep_alive_connection_is_closed(server):
    reply, seconds = await asyncio.to_thread(exchange, port_of(server), raw_request("/health"), wait_s=KEEP_ALIVE_S + 8)
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert seconds < KEEP_ALIVE_S + 3, f"an idle connection stayed open {seconds:.1f} s"


async def test_a_trickled_body_times_out_with_408(server):
    """Before: a caller that announced a body and sent none held its connection (and a task) forever."""
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": "
    ).encode()
    reply, seconds = await asyncio.to_thread(exchange, port_of(server), head, wait_s=BODY_TIMEOUT_S + 10)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b'"request_timeout"' in reply and seconds < BODY_TIMEOUT_S + 5


def test_network_bind_without_a_key_is_refused():
    """Before: a warning, then a keyless server open to the network. The refusal comes before the
    model loads, so it takes an import's time."""
    env = {k: v for k, v in os.environ.items() if k != "AGENTSPEC_API_KEY"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agentspec", "serve", "--host", "0.0.0.0", "--port", "0"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"agentspec serve started on 0.0.0.0 without a key: {exc.output}")
    assert done.returncode != 0
    assert "--allow-unauthenticated" in done.stderr and "--api-key" in done.stderr and "ready at" not in done.stdout


# -- without a server: the bounds themselves -------------------------------------------------------


def test_json_depth_counts_without_recursion():
    assert [json_depth(v, 64) for v in (1, [], {"a": [1]}, [[1, [2]], {"a": {"b": []}}])] == [0, 1, 2, 4]
    assert json_depth(nested(100_000), 64) == 65  # far past Python's stack; stops early


def json_values(value: object) -> int:
    """Values in a parsed JSON value, keys included."""
    if isinstance(value, dict):
        return 1 + sum(1 + json_values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(json_values(v) for v in value)
    return 1


@pytest.mark.parametrize("chunk_bytes", [1, 3, 64, None], ids=["1", "3", "64", "default"])
def test_json_text_shape_reads_depth_and_values_outside_strings(monkeypatch, chunk_bytes):
    """The scan agrees with the parsed value on brackets, commas and colons inside strings, escaped
    quotes after runs of backslashes and multi-byte characters, also where a chunk ends in the middle
    of any of them (chunks of 1 and 3 bytes)."""
    from agentspec.serve import app

    if chunk_bytes is not None:
        monkeypatch.setattr(app, "SCAN_CHUNK_BYTES", chunk_bytes)
    tricky = ['"', "\\", '\\"', "[{,:", "}]", 'a\\\\"b', "\u00e9\u20ac\U0001f600"]
    values = [1, "[[[{", {"a": ["]]]\\\"[[["]}, [[1, [2]], {"a": {"b": [3]}}], nested(200), {t: [t, {t: t}] for t in tricky}, tricky]
    for value in values:
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            assert app.json_text_shape(text.encode()) == (json_depth(value, 10_000), json_values(value)), text
    assert app.json_text_shape(b"[[], {}]") == (2, 5)  # an empty list or object counts one value more than it holds


def test_client_side_depth_limit_names_the_parameter():
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": array_schema(600)}}
    with pytest.raises(agentspec.InvalidRequestError, match=r"`response_format` nests deeper than 64 .*max_json_depth"):
        parse_params({"response_format": deep}, default_spec=SpecConfig())
    tool = {"type": "function", "function": {"name": "f", "parameters": array_schema(30)}}
    with pytest.raises(agentspec.InvalidRequestError, match="`tools` nests deeper than 16"):
        parse_params({"tools": [tool]}, default_spec=SpecConfig(), max_json_depth=16)
    shallow = {"type": "function", "function": {"name": "f", "parameters": array_schema(2)}}  # nested arrays compile to huge grammars (issue 50, finding 1)
    assert parse_params({"tools": [shallow]}, default_spec=SpecConfig(), max_json_depth=16).tools[0].name == "f"


def test_metrics_aggregator_bounds_its_tags(caplog):
    metrics = MetricsAggregator(max_tags=3)
    with caplog.at_level("WARNING", logger="agentspec.metrics"):
        for i in range(1000):
            metrics.add(SpecStats(requests=1, output_tokens=1), f"t{i}")
    assert metrics.tags() == sorted(["t0", "t1", "t2", OTHER_TAG])
    assert metrics.snapshot(OTHER_TAG).requests == 997 and metrics.snapshot().requests == 1000
    assert metrics.snapshot("t0").requests == 1
    assert len([r for r in caplog.records if "distinct request tags" in r.getMessage()]) == 1
    metrics.add(SpecStats(requests=1), "t1")  # a tag that has its series keeps it
    assert metrics.snapshot("t1").requests == 2


def test_shadow_queue_is_bounded():
    from agentspec.engine import Sequence
    from agentspec.runtime import MAX_QUEUED_SHADOWS, Runtime

    runtime = Runtime()  # not started: shadow() only queues
    for _ in range(10 * MAX_QUEUED_SHADOWS):
        runtime.shadow(Sequence([1, 2, 3], GenerationParams(), max_new_tokens=4), lambda seq: None)
    assert len(runtime._shadows) == MAX_QUEUED_SHADOWS


def test_limits_refuse_a_field_named_self_with_agentspecs_words():
    with pytest.raises(agentspec.InvalidRequestError, match=r"unknown field\(s\) 'self'.*max_json_depth"):
        agentspec.Limits(self=1)
    with pytest.raises(agentspec.InvalidRequestError) as refused:
        agentspec.Limits(max_tags=-1)
    assert "`max_tags`=-1" in str(refused.value) and "pydantic" not in str(refused.value)


def test_chat_template_errors_are_in_agentspecs_words():
    """A template's deliberate ``raise_exception`` message (its author's words to callers) is quoted;
    jinja's own errors and anything else failing inside the template stay in the log."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from agentspec.chat import ChatFormat

    class TemplateTokenizer:
        """The part of a tokenizer ChatFormat uses: a real sandboxed jinja template, with
        ``raise_exception`` as transformers defines it."""

        def __init__(self, chat_template: str) -> None:
            self.chat_template = chat_template

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment()
            env.globals["raise_exception"] = raise_exception
            return env.from_string(self.chat_template).render(messages=messages, tools=tools)

    deliberate = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversation must start with a system message') }}{% endif %}"
    with pytest.raises(agentspec.InvalidRequestError, match="'Conversation must start with a system message'"):
        ChatFormat(TemplateTokenizer(deliberate)).render([{"role": "user", "content": "hi"}])
    internal = "{{ messages[0]['content'].__class__.__mro__ }}{{ messages | map(attribute='x') | sum }}"  # jinja's SecurityError / a TypeError
    for template in (internal, "{{ messages[0].content + 1 }}"):
        with pytest.raises(agentspec.InvalidRequestError) as refused:
            ChatFormat(TemplateTokenizer(template)).render([{"role": "user", "content": "hi"}])
        message = str(refused.value)
        assert message.startswith("The model's chat template could not render these messages")
        cause = str(refused.value.__cause__)
        assert cause and cause not in message  # jinja's text, chained for the embedding program, not in the message
