"""``agentspec bench``: agentspec against its peers, in one process, on the same model and prompts.

Systems (all greedy, same stop tokens, same max_tokens):
- ``hf_plain``          transformers ``generate(do_sample=False)``
- ``hf_prompt_lookup``  transformers ``generate(prompt_lookup_num_tokens=10)`` (n-gram assisted)
- ``agentspec_plain``   agentspec with ``speculative=False`` (the same loop with K = 0)
- ``agentspec``         agentspec with speculation

Each row: {workload, system, tokens, seconds, tokens_per_s, target_forwards, identical_to_plain,
spread, acceptance, tokens_per_pass, accepted_by_source} (``seconds`` is the median of the repeats,
``spread`` their (max − min) / median),
where ``identical_to_plain`` compares token ids with the first system run (``hf_plain`` by default;
``agentspec_plain`` under the same grammar for the constrained workloads, tool call and extraction,
which transformers' ``generate`` cannot run). Speed is always a ratio against a
baseline measured in the same process, never an absolute claim.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .budget import CostModel
from .client import Client
from .drafting import NgramIndex
from .loadbench import clear_caches, format_load_table, run_concurrency, second_turn_ttft
from .types import SpecConfig, SpecStats
from .workloads import WORKLOADS, Workload, load_workloads, workload

__all__ = ["BenchRow", "SYSTEMS", "run_bench", "ngram_oracle_speedup", "format_table", "main"]

SYSTEMS = ("hf_plain", "hf_prompt_lookup", "agentspec_plain", "agentspec")


@dataclass
class BenchRow:
    workload: str
    system: str
    tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int
    identical_to_plain: bool
    spread: float = 0.0  # (slowest − fastest) / median over the repeats
    acceptance: float = 0.0  # agentspec systems: accepted / drafted tokens
    tokens_per_pass: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)


class _ForwardCounter:
    """Counts target forward passes of a transformers model (for the HF systems)."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        self._hook = model.register_forward_hook(self._on_forward)

    def _on_forward(self, *_: Any) -> None:
        self.count += 1

    def close(self) -> None:
        self._hook.remove()


def _hf_generate(client: Client, prompt_ids: list[int], max_tokens: int, **extra: Any) -> tuple[list[int], int]:
    loaded = client.loaded
    stop = sorted(loaded.stop_token_ids)
    counter = _ForwardCounter(loaded.model)
    try:
        with torch.inference_mode():
            output = loaded.model.generate(
                torch.tensor([prompt_ids], device=loaded.device),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=loaded.device),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[0],
                **extra,
            )
    finally:
        counter.close()
    return output[0, len(prompt_ids) :].tolist(), counter.count


async def _run_system(client: Client, system: str, work: Workload, max_tokens: int) -> tuple[list[int], int, int, SpecStats | None]:
    """Returns (output ids without the stop token, tokens generated, target forward passes, stats)."""
    if system in ("hf_plain", "hf_prompt_lookup"):
        prompt_ids = client.loaded.chat.encode(work.messages)
        extra = {"prompt_lookup_num_tokens": 10} if system == "hf_prompt_lookup" else {}
        # on the engine's thread, like agentspec itself, so both run under the same threading conditions
        ids, forwards = await client.run_on_worker(lambda: _hf_generate(client, prompt_ids, max_tokens, **extra))
        stops = client.loaded.stop_token_ids
        end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        return ids[:end], min(end + 1, len(ids)), forwards, None
    # Each timed request drafts from its own prompt and output only and prefills its whole prompt: the
    # bench repeats identical requests, which the suffix cache would replay verbatim and the prefix
    # cache would not prefill (real, but not what these rows measure; see --concurrency for reuse).
    await clear_caches(client)
    completion = await client.generate(work.messages, max_tokens=max_tokens, speculative=system == "agentspec", **work.params)
    return completion.token_ids, completion.usage.completion_tokens, completion.stats.target_forward_passes, completion.stats


async def run_bench(
    client: Client,
    workloads: Iterable[Workload] = WORKLOADS,
    systems: Iterable[str] = SYSTEMS,
    *,
    max_tokens: int | None = None,
    repeats: int = 1,
    on_row: Callable[[BenchRow], None] = lambda row: None,
) -> list[BenchRow]:
    """Time every system on every workload (median of ``repeats`` after one warm-up run)."""
    rows: list[BenchRow] = []
    systems = tuple(systems)
    for work in workloads:
        limit = max_tokens or work.max_tokens
        reference: list[int] | None = None
        for system in systems:
            if work.constrained and system.startswith("hf_"):
                continue  # transformers' generate has no grammar: not the same task
            await _run_system(client, system, work, min(limit, 8))  # warm-up
            timings, ids, tokens, forwards, stats = [], [], 0, 0, None
            for _ in range(repeats):
                started = time.perf_counter()
                ids, tokens, forwards, stats = await _run_system(client, system, work, limit)
                timings.append(time.perf_counter() - started)
            if reference is None:
                reference = ids  # the first system (hf_plain by default) is the reference output
            seconds = statistics.median(timings)
            row = BenchRow(
                workload=work.name,
                system=system,
                tokens=tokens,
                seconds=round(seconds, 4),
                tokens_per_s=round(tokens / seconds, 2),
                target_forwards=forwards,
                identical_to_plain=ids == reference,
                spread=round((max(timings) - min(timings)) / seconds, 3),
                acceptance=round(stats.acceptance_rate, 3) if stats else 0.0,
                tokens_per_pass=round(tokens / forwards, 2) if forwards else 0.0,
                accepted_by_source=dict(stats.accepted_by_source) if stats else {},
            )
            rows.append(row)
            on_row(row)
    return rows


def ngram_oracle_speedup(prompt_ids: list[int], output_ids: list[int], costs: CostModel, spec: SpecConfig) -> float:
    """Upper bound for the n-gram drafter on a known output: speedup over plain decoding if every
    step verified exactly the draft tokens that will be accepted (when that beats a plain step).

    It separates "the policy chooses badly" from "the text does not repeat enough to gain more".
    """
    index = NgramIndex(min_n=spec.ngram_min, max_n=spec.ngram_max)
    index.extend(prompt_ids)
    position, spent = 0, 0.0
    while position < len(output_ids):
        draft, _ = index.propose(spec.max_draft_tokens)
        matched = 0
        while matched < len(draft) and position + matched < len(output_ids) and draft[matched] == output_ids[position + matched]:
            matched += 1
        if matched and (matched + 1) / costs.effective_cost(matched + 1) > 1 / costs.effective_cost(1):
            step, spent = matched + 1, spent + costs.effective_cost(matched + 1)
        else:
            step, spent = 1, spent + costs.effective_cost(1)
        index.extend(output_ids[position : position + step])
        position += step
    return len(output_ids) * costs.effective_cost(1) / spent if spent else 1.0


def format_table(rows: list[BenchRow]) -> str:
    """Rows plus speedups against transformers plain, its prompt lookup, and agentspec plain."""
    baseline = {(r.workload, r.system): r.tokens_per_s for r in rows}

    def ratio(row: BenchRow, system: str) -> str:
        base = baseline.get((row.workload, system))
        return f"{row.tokens_per_s / base:.2f}" if base else "-"

    header = (
        f"{'workload':<16} {'system':<17} {'tokens':>6} {'tok/s':>7} {'spread':>6} {'passes':>6} {'tok/pass':>8} "
        f"{'accept':>6} {'×hf':>6} {'×lookup':>8} {'×plain':>7} {'identical':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.workload:<16} {r.system:<17} {r.tokens:>6} {r.tokens_per_s:>7.1f} {r.spread:>6.0%} {r.target_forwards:>6} "
            f"{r.tokens_per_pass:>8.2f} {r.acceptance:>6.0%} {ratio(r, 'hf_plain'):>6} {ratio(r, 'hf_prompt_lookup'):>8} {ratio(r, 'agentspec_plain'):>7} "
            f"{str(r.identical_to_plain):>9}"
        )
    return "\n".join(lines)


async def main(args: Any) -> int:
    names = [n for n in args.workloads.split(",") if n] if args.workloads else [w.name for w in WORKLOADS]
    try:
        selected = load_workloads(args.prompts) if args.prompts else [workload(name) for name in names]
    except (KeyError, ValueError, OSError) as exc:
        raise SystemExit(str(exc)) from None
    systems = args.systems.split(",") if args.systems else SYSTEMS
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    async with Client(args.model, device=args.device) as client:
        print(f"model {client.loaded.name} on {client.loaded.device} ({client.loaded.dtype}); workloads: "
              f"{', '.join(w.name for w in selected)}", flush=True)
        if args.concurrency:
            return await _load_main(client, args, selected)
        cells = sum(1 for w in selected for s in systems if not (w.constrained and s.startswith("hf_")))
        done = itertools.count(1)
        rows = await run_bench(
            client, selected, systems, max_tokens=args.max_tokens, repeats=args.repeats,
            on_row=lambda r: print(
                f"  [{next(done)}/{cells}] {r.workload:<16} {r.system:<17} {r.tokens_per_s:7.1f} tok/s", file=sys.stderr, flush=True
            ),
        )
        bounds = {}
        for work in (w for w in selected if not w.constrained):  # a perfect draft-length policy, same n-grams
            plain = await client.generate(work.messages, max_tokens=args.max_tokens or work.max_tokens, speculative=False)
            prompt_ids = client.loaded.chat.encode(work.messages)
            bounds[work.name] = ngram_oracle_speedup(prompt_ids, plain.token_ids, client._runtime.engine.costs, client.spec)
    print()
    print(format_table(rows))
    print("\nn-gram oracle bound (perfect draft lengths, same drafter) over plain: "
          + ", ".join(f"{name} {bound:.2f}×" for name, bound in bounds.items()))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"\nrows written to {args.json}")
    return 0


async def _load_main(client: Client, args: Any, selected: list[Workload]) -> int:
    """``--concurrency``: aggregate throughput, TTFT and TPOT per level; then second-turn TTFT."""
    try:
        levels = sorted({int(n) for n in args.concurrency.split(",")})
    except ValueError:
        raise SystemExit(f"--concurrency takes comma-separated integers, got {args.concurrency!r}") from None
    if not levels or levels[0] < 1 or levels[-1] > client.limits.max_batch:
        raise SystemExit(f"--concurrency levels must be between 1 and the client's max_batch ({client.limits.max_batch})")
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
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"\nrows written to {args.json}")
    return 0
