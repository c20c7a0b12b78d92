"""The docs cannot drift from the code: every ```python block of README.md and docs/*.md runs here,
docs/api.md names exactly ``agentspec.__all__``, and ``agentspec demo`` ends every answer on its own,
identical to plain decoding.

A page's blocks run in order in one namespace, like a session in ``python -m asyncio``: top-level
``await`` works, and ``client`` is the session's started client. ``agentspec.Client()`` in a block
lends that same client (its arguments are still checked by a real ``Client``), so a page costs no
model load and no second engine thread; ``asyncio.run(main())`` runs ``main()`` on the test's loop.
``Client(base_url=...)`` is real and talks to ``agentspec serve``'s app over the session client,
served here on a free port in place of the address the pages show; the framework integrations'
shared clients (``agentspec.bridge``) are such remote clients too, so no block starts a second
engine thread in this process (which would slow every later test of this worker). Blocks without
top-level ``await`` (synchronous framework calls) run on a thread, so the loop keeps serving. Blocks that cannot run here
(shell commands, server launches) are ```bash or ```text, which this test does not run.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import agentspec
from agentspec import bridge
from agentspec.demo import run_demo

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
DOCS_URL = "http://127.0.0.1:8000/v1"  # the address the pages show for `agentspec serve`
DOCS_KEY = "docs-test-key"
RealClient = agentspec.Client


def python_blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, match.start()) + 2, match.group(1)) for match in BLOCK.finditer(text)]


class _Lent:
    """What ``agentspec.Client(...)`` gives a docs block: the session client, started, never closed."""

    def __init__(self, client: agentspec.Client) -> None:
        self._client = client

    async def start(self) -> agentspec.Client:
        return self._client

    async def __aenter__(self) -> agentspec.Client:
        return self._client

    async def __aexit__(self, *exc_info: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


class _RemoteBridge(bridge.Backend):
    """The integrations' bridge during a docs page: every shared client is ``Client(base_url=...)``
    on the docs server, whatever model the framework object names."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    async def client(self, key: bridge.ClientKey) -> agentspec.Client:
        start = self._starts.get(key)
        if start is None:
            start = self._starts[key] = asyncio.ensure_future(RealClient(base_url=self.url, api_key=DOCS_KEY).start())
        return await asyncio.shield(start)


@pytest.fixture(scope="module")
async def docs_server(client: agentspec.Client):
    """``agentspec serve``'s application over the session client, on a free loopback port (None
    without the serve extra: then only the pages that talk to a server are skipped)."""
    try:
        import openai  # noqa: F401  (the pages' server examples use it)
        import uvicorn

        from agentspec.serve.app import create_app
    except ModuleNotFoundError:
        yield None
        return
    app = create_app(client, model_name=client.loaded.name, api_key=DOCS_KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    await task


def test_the_pages_have_python_to_run():
    assert {page.name for page in PAGES if python_blocks(page)} >= {"README.md", "how-it-works.md", "serving.md", "api.md"}


@pytest.mark.parametrize("page", [page for page in PAGES if python_blocks(page)], ids=lambda page: page.name)  # pages of prose and tables: nothing to run
async def test_python_blocks_run(page: Path, client: agentspec.Client, docs_server: str | None, monkeypatch) -> None:
    blocks = python_blocks(page)
    if docs_server is None and any(DOCS_URL in code for _, code in blocks):
        pytest.skip(f"{page.name} talks to agentspec serve: pip install 'agentspec-llm[serve]'")

    def lend(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("base_url") is not None:
            return RealClient(*args, **kwargs)
        RealClient(*args, **kwargs)  # the arguments a reader would pass must be valid
        return _Lent(client)

    programs: list[Any] = []
    monkeypatch.setattr(agentspec, "Client", lend)
    monkeypatch.setattr(asyncio, "run", programs.append)  # a block's asyncio.run(main()): run below, on this loop
    frameworks = _RemoteBridge(docs_server) if docs_server is not None else None
    if frameworks is not None:
        monkeypatch.setattr(bridge, "_backend", frameworks)
    namespace: dict[str, Any] = {"__name__": "__docs__", "KEY": DOCS_KEY}
    try:
        for line, code in blocks:
            if docs_server is not None:
                code = code.replace(DOCS_URL, docs_server)
            namespace["client"] = client
            compiled = compile(code, f"{page.name}:{line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            if compiled.co_flags & inspect.CO_COROUTINE:
                await eval(compiled, namespace)  # noqa: S307 - the repository's own documentation
            else:
                await asyncio.to_thread(eval, compiled, namespace)
            while programs:
                await programs.pop(0)
    finally:
        if frameworks is not None:
            await asyncio.to_thread(frameworks.close)


def test_api_reference_names_exactly_the_public_surface() -> None:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^### `(\w+)`\n(.*?)(?=^#{2,3} |\Z)", text, re.S | re.M))
    assert set(sections) == set(agentspec.__all__)
    for name, body in sections.items():
        fields = getattr(getattr(agentspec, name), "model_fields", {})
        missing = [field for field in fields if f"`{field}`" not in body and f"`{field}=" not in body]
        assert not missing, f"docs/api.md, {name}: fields not described: {missing}"


def test_no_page_links_to_a_missing_file() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


async def test_the_demo_answers_end_on_their_own_and_equal_plain_decoding(client: agentspec.Client, capsys) -> None:
    assert await run_demo(client)
    out = capsys.readouterr().out
    assert out.count("identical to plain decoding") == 3
    assert "(length)" not in out  # every answer ended on its own, not at max_tokens
    assert "→ ToolCall send_email" in out and "→ Contact(name='Maria Garcia'" in out
