"""``agentspec bench --concurrency 1,2,4,8``: the runtime under load, and prefix reuse across turns.

For each level n, ``rounds`` × n requests (the open workloads, in turn) run with n in flight at
all times — a new one starts as soon as one finishes, as in a server — and all of them are timed
together: aggregate tokens/s (all output tokens over the wall time until the last one finishes),
mean TTFT and TPOT, with and without speculation. (With a single closed batch the slowest request
sets the wall time, which hides what the others gained.) The workloads' prompts come round again,
so the prefix and suffix caches are cleared before every request: each one prefills its whole
prompt and drafts from its own text only, as distinct traffic would. ``scaling`` is tokens/s over the same system's
tokens/s at the lowest level measured — what sharing passes buys. Caches that would replay earlier
repeats (prefix, suffix) are cleared before every timed round.

``second_turn_ttft`` measures what prefix reuse buys a conversation: the TTFT of its second turn
when the first turn's keys/values are kept, against the same request cold.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..client import Client
from ..types import Completion, SpecConfig
from .workloads import Workload

__all__ = ["LoadRow", "run_concurrency", "second_turn_ttft", "format_load_table"]


@dataclass
class LoadRow:
    concurrency: int
    system: str
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    tokens_per_pass: float
    scaling: float = 1.0  # tokens_per_s over the same system's at the lowest level


async def run_concurrency(
    client: Client,
    levels: Sequence[int],
    workloads: Sequence[Workload],
    *,
    max_tokens: int,
    repeats: int = 1,
    rounds: int = 3,
    systems: Sequence[str] = ("agentspec_plain", "agentspec"),
    speculation: SpecConfig | None = None,
    on_row: Callable[[LoadRow], None] = lambda row: None,
) -> list[LoadRow]:
    """``speculation``: the "agentspec" rows' settings (default: the client's). A client on a server
    (``base_url``) cannot clear the server's caches: give it sources without the suffix cache."""
    rows: list[LoadRow] = []
    clear = client.clear_caches if client.base_url is None else _nothing
    for system in systems:
        speculative: SpecConfig | bool = (speculation or True) if system == "agentspec" else False
        await client.generate(workloads[0].messages, max_tokens=8, speculative=speculative)  # warm-up
        base: float | None = None
        for n in levels:
            batch = [workloads[i % len(workloads)] for i in range(n * rounds)]
            in_flight = asyncio.Semaphore(n)

            async def one(w: Workload) -> Completion:
                async with in_flight:
                    await clear()  # the same prompts come round again: no replays, cold prefills
                    return await client.generate(w.messages, max_tokens=max_tokens, speculative=speculative, **w.params)

            timings, results = [], []
            for _ in range(repeats):
                await clear()
                started = time.perf_counter()
                results = await asyncio.gather(*(one(w) for w in batch))
                timings.append(time.perf_counter() - started)
            seconds = statistics.median(timings)
            tokens = sum(r.usage.completion_tokens or 0 for r in results)
            passes = [r.stats.target_forward_passes for r in results]  # None: a server that does not say
            row = LoadRow(
                concurrency=n,
                system=system,
                requests=len(batch),
                tokens=tokens,
                seconds=round(seconds, 4),
                tokens_per_s=round(tokens / seconds, 2),
                ttft_ms=round(_mean([r.stats.ttft_ms for r in results]), 1),
                tpot_ms=round(_mean([r.stats.tpot_ms for r in results]), 1),
                tokens_per_pass=round(tokens / sum(passes), 2) if None not in passes and sum(passes) else 0.0,
            )
            base = base or row.tokens_per_s
            row.scaling = round(row.tokens_per_s / base, 2)
            rows.append(row)
            on_row(row)
    return rows


def _mean(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else 0.0


async def _nothing() -> None:
    return None


async def second_turn_ttft(client: Client, work: Workload, *, repeats: int = 3) -> tuple[float, float]:
    """Median TTFT (ms) of a conversation's second turn: (cold, with the first turn's keys/values kept)."""
    first = await client.generate(work.messages, max_tokens=work.max_tokens)
    second = [*work.messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Thanks. Say it in one line."}]
    cold, warm = [], []
    for _ in range(repeats):
        await client.clear_caches()
        cold.append((await client.generate(second, max_tokens=1)).stats.ttft_ms)
        await client.clear_caches()
        await client.generate(work.messages, max_tokens=work.max_tokens)  # the first turn, as a conversation has it
        warm.append((await client.generate(second, max_tokens=1)).stats.ttft_ms)
    return statistics.median(cold), statistics.median(warm)


def format_load_table(rows: list[LoadRow]) -> str:
    header = f"{'concurrency':>11} {'system':<16} {'tokens':>6} {'tok/s':>7} {'scaling':>7} {'TTFT ms':>8} {'TPOT ms':>8} {'tok/pass':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.concurrency:>11} {r.system:<16} {r.tokens:>6} {r.tokens_per_s:>7.1f} {r.scaling:>7.2f} {r.ttft_ms:>8.0f} "
            f"{r.tpot_ms:>8.1f} {r.tokens_per_pass:>8.2f}"
        )
    return "\n".join(lines)
