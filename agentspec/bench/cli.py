"""``agentspec bench``: agentspec against its peers, in one process, on the same model and prompts.

The command's entry point behind ``agentspec bench`` (the flags are parsed by ``agentspec.cli``):
``main`` prints the target pass's numbers (``passes.py``), runs the single-stream rows
(``single.py``) and prints their table, the n-gram oracle bound
and the suffix cache's gain; with ``--concurrency`` it runs the load rows (``load.py``) instead.
``--json`` writes the rows, ``--plot`` the chart (``plot.py``).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from ..client import Client
from .llamacpp import LLAMACPP_SYSTEMS
from .llamacpp import unavailable as llamacpp_unavailable
from ..types import SpecConfig
from .load import format_load_table, run_concurrency, second_turn_ttft
from .passes import pass_report, until_calibrated
from .plot import write_bench_plot, write_load_plot
from .remote import REMOTE_SOURCES, format_remote_table, run_remote_bench
from .single import format_table, ngram_oracle_speedup, run_bench, suffix_gain
from .systems import SYSTEMS, applies, parse_system
from .workloads import WORKLOADS, Workload, load_workloads, workload

__all__ = ["main", "progress_bar"]


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``[#######.............]  7/20``: one per finished cell (a line each, so logs keep them)."""
    filled = round(width * done / total) if total else width
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total}"


def _describe(client: Client) -> str:
    """``SmolLM2-135M-Instruct on cpu (torch.float32, gguf-q16 weights, avx2 kernels)``: the model line
    and the charts' title."""
    weights = client.engine.weights
    kernels = f", {weights.isa} kernels" if weights.isa else ""
    return f"{client.loaded.name} on {client.loaded.device} ({client.loaded.dtype}, {weights.name} weights{kernels})"


def _save(args: Any, rows: list[Any], write_plot: Callable[..., Path], title: str) -> None:
    """``--json``: the rows (dataclasses) as a JSON list; ``--plot``: their chart, drawn by ``write_plot``."""
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"\nrows written to {args.json}")
    if args.plot:
        print(f"chart written to {write_plot(rows, args.plot, title=title)}")


async def main(args: Any) -> int:
    names = [n for n in args.workloads.split(",") if n] if args.workloads else [w.name for w in WORKLOADS]
    try:
        selected = load_workloads(args.prompts) if args.prompts else [workload(name) for name in names]
        systems = args.systems.split(",") if args.systems else SYSTEMS
        for system in systems:
            parse_system(system)
    except (KeyError, ValueError, OSError) as exc:
        raise SystemExit(str(exc)) from None
    async with Client(args.model, device=args.device, draft=args.draft, weights=args.weights) as client:
        print(f"model {_describe(client)}; workloads: {', '.join(w.name for w in selected)}", flush=True)
        await until_calibrated(client)
        report = await client.run_on_worker(lambda: pass_report(client))
        print("\n".join(report.lines()), flush=True)
        if args.base_url:
            return await _remote_main(client, args, selected)
        if args.concurrency:
            return await _load_main(client, args, selected)
        if args.temperature and any(not s.startswith("agentspec") for s in systems):
            print(f"--temperature {args.temperature}: sampled rows are agentspec's only (the peers run greedy)", file=sys.stderr)
        if "outlines" in systems and importlib.util.find_spec("outlines") is None:
            print("outlines is not installed (pip install 'agentspec-llm[bench]'): no outlines rows", file=sys.stderr)
            systems = [s for s in systems if s != "outlines"]
        if any(s in LLAMACPP_SYSTEMS for s in systems) and (reason := llamacpp_unavailable(client)) is not None:
            print(f"no llama.cpp rows: {reason}", file=sys.stderr)
            systems = [s for s in systems if s not in LLAMACPP_SYSTEMS]
        cells = sum(1 for w in selected for s in systems if applies(s, w, client) and (s.startswith("agentspec") or not args.temperature))
        done = itertools.count(1)
        rows = await run_bench(
            client, selected, systems, max_tokens=args.max_tokens, repeats=args.repeats, temperature=args.temperature,
            on_row=lambda r: print(
                f"  {progress_bar(next(done), cells)} {r.workload:<16} {r.system:<24} {r.tokens_per_s:7.1f} tok/s",
                file=sys.stderr, flush=True,
            ),
        )
        bounds = {}
        for work in (w for w in selected if not w.constrained):  # a perfect draft-length policy, same n-grams
            plain = await client.generate(work.messages, max_tokens=args.max_tokens or work.max_tokens, speculative=False)
            prompt_ids = client.loaded.chat.encode(work.messages)
            bounds[work.name] = ngram_oracle_speedup(prompt_ids, plain.token_ids, client.engine.costs, client.spec)
        title = _describe(client)
    print()
    print(format_table(rows))
    if bounds:
        print("\nn-gram oracle bound (perfect draft lengths, same drafter) over plain: "
              + ", ".join(f"{name} {bound:.2f}×" for name, bound in bounds.items()))
    for name, with_suffix, without in suffix_gain(rows):
        print(f"{name}: suffix cache {with_suffix.tokens_per_pass / without.tokens_per_pass:.2f}× tokens per target pass: "
              f"{with_suffix.system} {with_suffix.tokens_per_pass:.2f}, {without.system} {without.tokens_per_pass:.2f}")
    _save(args, rows, write_bench_plot, title)
    return 0


async def _remote_main(local: Client, args: Any, selected: list[Workload]) -> int:
    """``--base-url``: the embedded client against the same requests on the server; with
    ``--concurrency``, the load rows on the server."""
    async with Client(base_url=args.base_url, api_key=args.api_key) as remote:
        print(f"server {args.base_url} ({remote.backend.name}), model {remote.backend.model}", flush=True)
        if args.concurrency:
            levels = _levels(args.concurrency, limit=256)
            open_workloads = [w for w in selected if not w.constrained] or selected
            load_rows = await run_concurrency(
                remote, levels, open_workloads, max_tokens=args.max_tokens or 64, repeats=args.repeats, speculation=SpecConfig(sources=REMOTE_SOURCES),
                on_row=lambda r: print(f"  {r.system:<16} x{r.concurrency:<3} {r.tokens_per_s:7.1f} tok/s", file=sys.stderr, flush=True),
            )
            print()
            print(format_load_table(load_rows))
            _save(args, load_rows, write_load_plot, f"{remote.backend.model} on {args.base_url}")
            return 0
        rows = await run_remote_bench(
            local, remote, selected, max_tokens=args.max_tokens, repeats=args.repeats,
            on_row=lambda r: print(f"  {r.workload:<16} embedded {r.embedded_tokens_per_s:7.1f}  remote {r.remote_tokens_per_s:7.1f} tok/s", file=sys.stderr, flush=True),
        )
    print()
    print(format_remote_table(rows))
    if any(r.server_cached_prompt_tokens for r in rows):
        print("the server reused cached prompts (start it with --prefix-cache-mb 0 for rows comparable with the embedded client's)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"\nrows written to {args.json}")
    return 0


def _levels(text: str, *, limit: int) -> list[int]:
    try:
        levels = sorted({int(n) for n in text.split(",")})
    except ValueError:
        raise SystemExit(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if not levels or levels[0] < 1 or levels[-1] > limit:
        raise SystemExit(f"--concurrency levels must be between 1 and the client's max_batch ({limit})")
    return levels


async def _load_main(client: Client, args: Any, selected: list[Workload]) -> int:
    """``--concurrency``: aggregate throughput, TTFT and TPOT per level; then second-turn TTFT."""
    levels = _levels(args.concurrency, limit=client.limits.max_batch)
    open_workloads = [w for w in selected if not w.constrained] or selected
    rows = await run_concurrency(
        client, levels, open_workloads, max_tokens=args.max_tokens or 64, repeats=args.repeats,
        on_row=lambda r: print(f"  {r.system:<16} x{r.concurrency:<3} {r.tokens_per_s:7.1f} tok/s", file=sys.stderr, flush=True),
    )
    cold, warm = await second_turn_ttft(client, open_workloads[0], repeats=max(args.repeats, 3))
    print()
    print(format_load_table(rows))
    print(f"\nsecond turn of a conversation ({open_workloads[0].name}): TTFT {warm:.0f} ms with prefix reuse, "
          f"{cold:.0f} ms cold ({warm / cold:.0%})")
    _save(args, rows, write_load_plot, _describe(client))
    return 0
