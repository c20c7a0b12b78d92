"""``agentspec bench --base-url URL``: the same agentspec requests in this process and on a server.

Each workload runs on the embedded client and through ``Client(base_url=URL)``, interleaved, and the
rows compare tokens per second as the caller sees them: what HTTP, SSE and the server cost. Both
sides draft from grammar and n-grams only: a server's suffix cache would replay the bench's
repeated requests, and it cannot be cleared from here (start ``agentspec serve --prefix-cache-mb 0``
so its prompts are prefilled like the embedded ones, whose caches are cleared before each run).
With ``--concurrency`` the load rows (``load.py``) run on the server's client.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..client import Client
from ..types import SpecConfig
from .workloads import Workload

__all__ = ["RemoteRow", "run_remote_bench", "format_remote_table", "REMOTE_SOURCES"]

REMOTE_SOURCES = ("grammar", "ngram")  # what both sides can draft from without replaying earlier repeats


@dataclass
class RemoteRow:
    workload: str
    tokens: int
    embedded_tokens_per_s: float
    remote_tokens_per_s: float
    ratio: float  # remote over embedded
    same_text: bool
    server_cached_prompt_tokens: int | None  # the server's prefix-cache hits (agentspec serve reports them)


async def run_remote_bench(
    local: Client,
    remote: Client,
    workloads: Sequence[Workload],
    *,
    max_tokens: int | None = None,
    repeats: int = 3,
    on_row: Callable[[RemoteRow], None] = lambda row: None,
) -> list[RemoteRow]:
    spec = SpecConfig(sources=REMOTE_SOURCES)
    rows: list[RemoteRow] = []
    for work in (w for w in workloads if not w.is_loop):  # a loop's turns depend on its tool results: not a wire test
        limit = max_tokens or work.max_tokens
        timings: dict[str, list[float]] = {"embedded": [], "remote": []}
        texts: dict[str, str] = {}
        cached: int | None = 0
        for client in (local, remote):  # warm-up, both sides
            await client.generate(work.messages, max_tokens=min(limit, 8), speculative=spec, **work.params)
        for _ in range(repeats):
            for side, client in (("embedded", local), ("remote", remote)):
                if client is local:
                    await local.clear_caches()
                started = time.perf_counter()
                done = await client.generate(work.messages, max_tokens=limit, speculative=spec, **work.params)
                timings[side].append(time.perf_counter() - started)
                texts[side] = done.text + "".join(f"{c.name}{c.arguments}" for c in done.tool_calls)
                if side == "remote":
                    hits = done.stats.cached_prompt_tokens
                    cached = None if hits is None or cached is None else cached + hits
                else:
                    tokens = done.usage.completion_tokens or 0
        embedded, far = (tokens / statistics.median(timings[side]) for side in ("embedded", "remote"))
        row = RemoteRow(work.name, tokens, round(embedded, 2), round(far, 2), round(far / embedded, 3), texts["embedded"] == texts["remote"], cached)
        rows.append(row)
        on_row(row)
    return rows


def format_remote_table(rows: list[RemoteRow]) -> str:
    header = f"{'workload':<16} {'tokens':>6} {'embedded tok/s':>14} {'remote tok/s':>12} {'remote/embedded':>15} {'same text':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.workload:<16} {r.tokens:>6} {r.embedded_tokens_per_s:>14.1f} {r.remote_tokens_per_s:>12.1f} {r.ratio:>14.2f}× {str(r.same_text):>9}"
        )
    return "\n".join(lines)
