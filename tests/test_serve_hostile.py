"""``agentspec serve`` under attack (issue 50, Deliver 1, 3 and 5): one real server process on
loopback, with two API keys (two tenants) and the prefix cache on.

- a table of hostile requests, each answered with its typed 4xx (and the server serving on);
- tenants: one key's prompt is not a cache hit for another key (``cached_prompt_tokens``), unless a
  server started with ``--share-caches`` (its own process, for that test) is told to share;
- a flood of hostile requests beside one well-formed request, whose output must equal the same
  request's on the quiet server, while the server's resident memory and event-loop stall (measured
  inside the server: ``agentspec_event_loop_lag_max_seconds`` on ``/metrics``) stay within bounds.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid

import pytest

from tests.processes import ServerProcess, agentspec_serve

httpx = pytest.importorskip("httpx")
pytest.importorskip("agentspec.serve", reason="the serve extra is not installed: pip install 'agentspec-llm[serve]'")

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
START_TIMEOUT_S = 600  # loading and calibrating on a busy 2-core machine has taken 2.5 minutes
GRAMMAR_TIMEOUT_S = 0.5  # array_schema(11) takes ~2.5 s to index on a quiet 2-core Zen 4: 5x margin
CHAT = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server_process():
    """Two keys (two tenants), the prefix cache on, a grammar time limit a slow schema reaches."""
    process = agentspec_serve(
        "--api-key", KEY_A, "--api-key", KEY_B, "--prefix-cache-mb", "64", "--grammar-timeout-s", str(GRAMMAR_TIMEOUT_S),
        "--limit-concurrency", "64", start_timeout_s=START_TIMEOUT_S,
    )  # fmt: skip
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def server(server_process: ServerProcess) -> str:
    assert server_process.url is not None
    return server_process.url.removesuffix("/v1")


def client_for(server: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.fixture(scope="module")
async def http(server: str):
    async with client_for(server, KEY_A) as http:
        yield http


@pytest.fixture(scope="module")
async def model(http) -> str:
    return (await http.get("/v1/models")).json()["data"][0]["id"]


def array_schema(depth: int, leaf: dict | None = None) -> dict:
    schema: dict = leaf or {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def deep_any_of(depth: int) -> dict:
    """Alternatives within alternatives, each an array of the next: a few hundred bytes, a regex that
    doubles with each level."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "null"}, {"type": "array", "items": schema}]}
    return schema


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": "", "parameters": parameters or {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def slow_schema() -> dict:
    """A schema within max_grammar_chars whose index takes seconds (75K regex characters); unique,
    so no earlier build of it is cached."""
    return array_schema(11, {"type": "integer", "enum": [int(uuid.uuid4().int % 10**9)]})


# (name, the request's fields beyond model and messages, or a whole body; status; code or None; a word of the message)
HOSTILE = [
    ("nested-array-schema", {"response_format": json_schema(array_schema(22))}, 400, "grammar_too_large", "--max-grammar-chars"),
    ("nested-array-tool", {"tools": [tool("f", array_schema(25))], "tool_choice": "required"}, 400, "grammar_too_large", "tools[0]"),
    ("huge-enum", {"response_format": json_schema({"enum": [f"value-{i}" for i in range(100_000)]})}, 400, "json_too_many_values", "--max-json-values"),
    ("long-enum", {"response_format": json_schema({"enum": [f"{i:06d}-" + "v" * 60 for i in range(4_000)]})}, 400, "grammar_too_large", "max_grammar_chars"),
    ("deep-anyOf", {"response_format": json_schema(deep_any_of(14))}, 400, "grammar_too_large", "max_grammar_chars"),
    ("any-depth", {"response_format": json_schema({"type": "array", "depth": 40})}, 400, "grammar_too_large", "max_grammar_chars"),
    ("many-tools", {"tools": [tool(f"tool_{i}") for i in range(1000)]}, 400, "context_length_exceeded", "context window"),
    ("long-stop", {"stop": ["x" * 100_000]}, 400, None, "`stop`"),
    ("many-stops", {"stop": [f"s{i}" for i in range(1000)]}, 400, None, "`stop`"),
    ("giant-logit-bias", {"logit_bias": {str(i): 100 for i in range(100_000)}}, 400, "json_too_many_values", "max_json_values"),
    ("logit-bias", {"logit_bias": {str(i): 100 for i in range(1_000)}}, 400, "unsupported_feature", "logit_bias"),
    ("megabyte-system-prompt", {"messages": [{"role": "system", "content": "lorem ipsum " * 90_000}, *QUESTION]}, 400, "context_length_exceeded", "context window"),
    ("megabyte-tool-description", {"tools": [{"type": "function", "function": {"name": "f", "description": "lorem ipsum " * 90_000}}]}, 400, "context_length_exceeded", "context window"),
    ("lone-surrogate", '{"model": MODEL, "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None, "surrogate"),
    ("bad-cache-salt", {"cache_salt": {"tenant": "other"}}, 400, None, "cache_salt"),
    ("slow-grammar", lambda: {"response_format": json_schema(slow_schema())}, 400, "grammar_timeout", "--grammar-timeout-s"),
]


def hostile_body(model: str, fields) -> dict | str:
    if callable(fields):
        fields = fields()
    if isinstance(fields, str):
        return fields.replace("MODEL", json.dumps(model))
    return {"model": model, "messages": QUESTION, "max_tokens": 4, **fields}


async def post(http, body: dict | str) -> httpx.Response:
    if isinstance(body, str):
        return await http.post(CHAT, content=body.encode(), headers={"content-type": "application/json"})
    return await http.post(CHAT, json=body)


def check_refusal(reply: httpx.Response, status: int, code: str | None, word: str) -> None:
    assert reply.status_code == status, reply.text[:500]
    error = reply.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    assert word in error["message"], error["message"]
    assert "Traceback" not in error["message"] and "outlines" not in error["message"].lower()


@pytest.mark.parametrize("fields, status, code, word", [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE])
async def test_hostile_request_gets_its_typed_4xx(http, model, fields, status, code, word):
    """Before (run against cc9160e): the nested-array schema built a regex of 155,189,230 characters
    on the event loop, then refused it with no code; the 25-deep array tool got the server killed
    for memory (16.7 GB resident); the lone surrogate was a TypeError in the tokenizer (HTTP 500); a
    100,000-character stop string was accepted (re-scanned at every step on the engine thread)."""
    check_refusal(await post(http, hostile_body(model, fields)), status, code, word)
    assert (await post(http, {"model": model, "messages": QUESTION, "max_tokens": 2})).status_code == 200


async def test_unicode_edge_cases_that_are_text_are_served(http, model):
    """Valid Unicode is text, however odd: NUL, bidi overrides, line separators, a combining-mark
    pile, astral characters (escaped as a surrogate pair)."""
    content = "a\u0000b \u202egnp.exe\u202c \u2028\u2029 " + "e" + "\u0301" * 300 + ' \\ud83d\\ude00 \U0001f600'
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}, ensure_ascii=False)
    reply = await post(http, body.replace("\\\\ud83d\\\\ude00", "\\ud83d\\ude00"))
    assert reply.status_code == 200, reply.text[:300]


@pytest.fixture(params=["own-caches", "shared-caches"])
def tenants(request) -> tuple[str, bool]:
    """(a server with keys A and B, whether it shares caches between them): the module's server, or
    one started with ``--share-caches`` for this test alone (stopped before the flood runs)."""
    if request.param == "own-caches":
        return request.getfixturevalue("server"), False
    process = agentspec_serve(
        "--api-key", KEY_A, "--api-key", KEY_B, "--share-caches", "--prefix-cache-mb", "64", start_timeout_s=START_TIMEOUT_S,
    )  # fmt: skip
    request.addfinalizer(process.stop)
    url = process.wait_ready()
    assert any("2 API keys (tenants, caches shared)" in line for line in process.lines)
    return url.removesuffix("/v1"), True


async def test_tenants_share_cached_prompts_only_when_the_server_is_told(tenants, model):
    """Before: one key, one prefix cache: ``cached_tokens`` told a caller that another had sent the
    same prompt. Now each key is a tenant: its own prompt is a hit, another tenant's identical prompt
    reuses nothing but the chat template's own opening (which every prompt starts with) — unless the
    server is started with ``--share-caches``, where B's request reuses A's prompt."""
    server, shared = tenants

    def body(text: str) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}

    async def cached(key: str, text: str) -> int:
        async with client_for(server, key) as http:
            reply = await http.post(CHAT, json=body(text))
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def fresh() -> str:
        return f"Say hello to {uuid.uuid4().hex}."

    secret = f"My account number is {uuid.uuid4().hex}. " * 4 + "Repeat it."  # far past the cache's 16-token minimum
    await cached(KEY_B, fresh())  # B's template opening is cached for B
    opening = await cached(KEY_B, fresh())  # what any new prompt of B's reuses: the template's opening
    first = await cached(KEY_A, secret)
    again = await cached(KEY_A, secret)
    assert again > first + 30  # the same tenant's prompt is reused
    if shared:
        assert await cached(KEY_B, secret) > opening + 30  # one tenant: A's prompt is reused for B
    else:
        assert await cached(KEY_B, secret) <= opening  # another tenant's identical prompt: nothing of A's
        assert await cached(KEY_B, secret) > opening + 30  # and B's own copy is reused by B
    async with client_for(server, "not-a-key") as stranger:
        assert (await stranger.post(CHAT, json=body(secret))).status_code == 401


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+) kB", status.read()).group(1)) / 1024


def loop_lag(text: str) -> tuple[float, dict[str, int]]:
    worst = float(re.search(r"^agentspec_event_loop_lag_max_seconds (\S+)$", text, re.MULTILINE).group(1))
    over = {bound: int(n) for bound, n in re.findall(r'^agentspec_event_loop_stalls_total\{over="([^"]+)"\} (\d+)$', text, re.MULTILINE)}
    return worst, over


FLOOD_REQUESTS = 1000  # hostile requests sent: the issue's target
FLOOD_CONCURRENCY = 8
MEMORY_BOUND_MB = 100  # the issue's target
# The issue's target: no wake-up of the server's loop watcher later than 0.1 s, but one. On a 2-core
# machine shared with other work the OS itself now and then leaves the loop without a core: measured
# (December 2026, 2-core Zen 4) once in four floods at load 7 and never at load 3 or below, where the
# server's own worst was 0.05 s. Before (dc246f7, the same machine): 2 to 28 such wake-ups a flood.
STALL_BOUND_S = 0.1
STALLS_ALLOWED = 1
HARD_STALL_BOUND_S = 0.25  # and none later than this


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's resident memory from /proc")
async def test_a_flood_of_hostile_requests_leaves_a_benign_one_unchanged(server, server_process, http, model):
    """Sends ``FLOOD_REQUESTS`` hostile requests, ``FLOOD_CONCURRENCY`` at a time, cycling through
    ``HOSTILE`` (except the megabyte prompt and the slow grammar, sent one in 20: they cost a core for
    a second or more each), while one well-formed request decodes 48 tokens beside them. Its text
    must equal the same request's on the quiet server; the server's resident memory must grow less
    than ``MEMORY_BOUND_MB``, at most ``STALLS_ALLOWED`` wake-ups of the server's loop watcher may
    come later than ``STALL_BOUND_S`` and none later than ``HARD_STALL_BOUND_S`` (both read from the
    server process itself)."""
    benign = {"model": model, "messages": [{"role": "user", "content": "Name three rivers of Europe."}], "max_tokens": 48, "cache_salt": "benign"}
    quiet = await post(http, benign)
    assert quiet.status_code == 200
    expected = quiet.json()["choices"][0]["message"]["content"]
    pid = server_process.proc.pid
    for _ in range(3):  # let the server settle after the quiet request
        await post(http, {"model": model, "messages": QUESTION, "max_tokens": 2})
    rss_before = resident_mb(pid)
    lag_before, over_before = loop_lag((await http.get("/metrics")).text)

    costly = {"megabyte-system-prompt", "slow-grammar", "many-tools"}
    cheap = [case for case in HOSTILE if case[0] not in costly]
    heavy = [case for case in HOSTILE if case[0] in costly]
    plan = [heavy[(i // 20) % len(heavy)] if i % 20 == 0 else cheap[i % len(cheap)] for i in range(FLOOD_REQUESTS)]
    statuses: dict[int, int] = {}
    bodies = {name: hostile_body(model, fields) for name, fields, *_ in HOSTILE if not callable(fields)}

    async def attacker(lane: int) -> None:
        async with client_for(server, KEY_B) as attack:
            for name, fields, status, code, word in plan[lane::FLOOD_CONCURRENCY]:
                reply = await post(attack, bodies.get(name) or hostile_body(model, fields))
                statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1

    started = time.perf_counter()
    flood = [asyncio.create_task(attacker(lane)) for lane in range(FLOOD_CONCURRENCY)]
    await asyncio.sleep(1.0)  # the flood is under way
    beside = await post(http, benign)
    await asyncio.gather(*flood)
    seconds = time.perf_counter() - started

    assert beside.status_code == 200, beside.text
    assert beside.json()["choices"][0]["message"]["content"] == expected
    assert set(statuses) <= {400}, statuses  # every hostile request got its typed refusal
    rss_growth = resident_mb(pid) - rss_before
    lag_after, over_after = loop_lag((await http.get("/metrics")).text)
    print(f"flood: {FLOOD_REQUESTS} requests in {seconds:.1f} s; resident +{rss_growth:.0f} MB; loop lag max {lag_after:.3f} s "
          f"(before {lag_before:.3f} s); wake-ups late by over 0.05 s: {over_after['0.05'] - over_before['0.05']}, "
          f"over 0.1 s: {over_after['0.1'] - over_before['0.1']}")
    assert rss_growth < MEMORY_BOUND_MB
    stalls = over_after[f"{STALL_BOUND_S:g}"] - over_before[f"{STALL_BOUND_S:g}"]
    assert stalls <= STALLS_ALLOWED, f"the event loop stalled past {STALL_BOUND_S} s {stalls} times"
    assert over_after[f"{HARD_STALL_BOUND_S:g}"] == over_before[f"{HARD_STALL_BOUND_S:g}"], f"the event loop stalled past {HARD_STALL_BOUND_S} s"


# -- fuzz: message lists, in this process (no server) -----------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import agentspec  # noqa: E402

EDGES = ["\ud800", "x\udfffy", "\x00", "\u202e", "<|im_start|>system\n", "e" + "\u0301" * 50, "\U0001f600"]
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(EDGES), st.lists(st.sampled_from(EDGES), max_size=4).map("".join))
CONTENT = st.one_of(TEXT, st.none(), st.integers(), st.lists(st.one_of(TEXT, st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXT, st.integers())})), max_size=3))
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", ""]), "content": CONTENT}),
    st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name", "tool_call_id"]), st.one_of(TEXT, st.lists(st.dictionaries(TEXT, TEXT, max_size=2), max_size=2)), max_size=4),
    TEXT,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(messages=st.one_of(st.lists(MESSAGE, max_size=5), TEXT, st.none()))
def test_fuzzed_messages_are_encoded_or_refused_with_a_typed_error(loaded, messages):
    """Random message lists (odd roles, missing fields, non-text contents, lone surrogates) through
    the chat template and tokenizer: a prompt, or ``InvalidRequestError``, never another exception
    (which a server answers with a 500). Bounded in time: 200 lists of at most 5 short messages."""
    try:
        ids = loaded.chat.encode(messages, max_chars=100_000)
    except agentspec.InvalidRequestError:
        return
    assert ids and all(isinstance(i, int) for i in ids)


def test_tools_count_toward_the_length_checked_before_tokenizing(loaded):
    """Before: only the messages' text was counted, so a tool with a megabyte description was rendered
    and tokenized (2.8 s for 3.5 MB: 1.46 million tokens, turned into Python lists holding the GIL
    ~80 ms) before the context window refused it. Its text now counts, and it is refused unread."""
    from agentspec.structured.tools import ToolSpec

    tool = ToolSpec("f", "lorem ipsum " * 90_000, {"type": "object", "properties": {}})
    with pytest.raises(agentspec.ContextLengthError, match="messages and tools hold 1080"):
        loaded.chat.encode(QUESTION, [tool], max_chars=100_000)
    assert loaded.chat.encode(QUESTION, [ToolSpec("f", "lorem ipsum", {"type": "object"})], max_chars=100_000)


# -- tenants without a server: keys file, salts ------------------------------------------------------


def test_keys_file_and_tenant_salts(tmp_path):
    from agentspec.serve.app import salted, tenant_salt
    from agentspec.serve.run import read_keys

    keys = tmp_path / "keys"
    keys.write_text("# team a\nkey-a\n\n  key-b  \n# old: key-c\n", encoding="utf-8")
    assert read_keys(str(keys)) == ["key-a", "key-b"]
    (tmp_path / "empty").write_text("# none yet\n", encoding="utf-8")
    for path, words in ((tmp_path / "empty", "holds no key"), (tmp_path / "missing", "Cannot read")):
        with pytest.raises(agentspec.InvalidRequestError, match=words):
            read_keys(str(path))
    a, b = tenant_salt(b"key-a"), tenant_salt(b"key-b")
    assert a != b and "key-a" not in a  # the key is never kept with the caches
    assert salted(a, None) == a and salted(a, "x").startswith(a + "/")  # a request's own salt stays within its tenant
    assert salted(a, b) != b and salted(a, {"not": "a string"}) == {"not": "a string"}  # left for validation to refuse


@pytest.mark.parametrize("grammar_processes", [0, 1], ids=["threads", "child-process"])
async def test_an_embedded_clients_limits_refuse_slow_templates_and_grammars(loaded, grammar_processes):
    """The same limits hold without a server: ``Limits.template_timeout_s`` (here 50 ms; tokenizing
    500,000 characters takes over a second) and ``grammar_timeout_s``, on the client's grammar
    threads (``grammar_processes=0``, the embedded default: the build finishes unseen) or, opted in,
    in a child process that is killed at the limit, and whose grammars serve requests as a thread's do."""
    import multiprocessing

    from agentspec.errors import LimitExceededError

    limits = agentspec.Limits(template_timeout_s=0.05, grammar_timeout_s=GRAMMAR_TIMEOUT_S, grammar_processes=grammar_processes)
    async with agentspec.Client(limits=limits) as client:  # reuses the loaded weights
        with pytest.raises(LimitExceededError, match="template_timeout_s") as refused:
            client.stream([{"role": "user", "content": "word " * 100_000}])
        assert refused.value.code == "template_timeout"
        stream = client.stream(QUESTION, response_format=json_schema(slow_schema()), max_tokens=4)
        with pytest.raises(LimitExceededError, match="grammar_timeout_s") as refused:
            async with stream:
                pass
        assert refused.value.code == "grammar_timeout" and client.pending_requests == 0
        if grammar_processes:
            for _ in range(100):  # killed at the limit; joined by the grammar thread, which may report a moment later
                if not [child for child in multiprocessing.active_children() if child.name == "agentspec-grammar"]:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the grammar's child process outlived its time limit")
    if grammar_processes:  # a grammar built in a child process serves its request (a limit no build on a busy machine reaches)
        async with agentspec.Client(limits=agentspec.Limits(grammar_processes=grammar_processes)) as client:
            schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            done = await client.generate(QUESTION, response_format=json_schema(schema), max_tokens=16)
            assert done.finish_reason == "stop" and isinstance(json.loads(done.text)["n"], int)
