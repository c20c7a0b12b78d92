"""``agentspec bench``: agentspec against its peers, in one process, on the same model and prompts.

Systems (all greedy, same stop tokens, same max_tokens):
- ``hf_plain``          transformers ``generate(do_sample=False)``
- ``hf_prompt_lookup``  transformers ``generate(prompt_lookup_num_tokens=10)`` (n-gram assisted)
- ``outlines``          outlines' own constrained generation (``outlines.Generator`` over the same
                        transformers model, the same JSON schema, compact whitespace)
- ``agentspec_plain``   agentspec with ``speculative=False`` (the same loop with K = 0)
- ``agentspec[S+...]``  agentspec drafting from the named sources only (``SpecConfig.sources``):
                        each source on its own, where the workload gives it something to draft
- ``agentspec``         agentspec with speculation, every source

A system runs where it can do the task: transformers ``generate`` has no grammar, so not on the
constrained workloads (tool call, extraction, agent loop); outlines only on those (one request each);
``agentspec[grammar]`` only under a grammar, ``agentspec[suffix]`` only on the agent loop (every
other timed request starts with the suffix cache cleared), ``agentspec[model]`` only with a draft
model; a subset of sources only where it leaves out one that applies (else it is ``agentspec``).

Each row: {workload, system, tokens, seconds, tokens_per_s, target_forwards, identical_to_plain,
spread, acceptance, tokens_per_pass, accepted_by_source} (``seconds`` is the median of the repeats,
``spread`` their (max − min) / median),
where ``identical_to_plain`` compares the output with the first system run (``hf_plain`` by default;
``agentspec_plain`` under the same grammar for the constrained workloads; outlines by text, as it
returns text). Speed is always a ratio against a baseline measured in the same process, never an
absolute claim.
"""

from __future__ import annotations

import importlib.util
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
from .metrics import sum_stats
from .params import parse_params
from .tools import with_tool_prompt
from .loadbench import clear_caches, format_load_table, run_concurrency, second_turn_ttft
from .types import DRAFT_SOURCES, Completion, SpecConfig, SpecStats
from .workloads import WORKLOADS, Workload, load_workloads, workload

__all__ = ["BenchRow", "SYSTEMS", "applies", "parse_system", "run_bench", "ngram_oracle_speedup", "format_table", "main"]

PEERS = ("hf_plain", "hf_prompt_lookup", "outlines", "agentspec_plain")
# each source alone; what the suffix cache adds on the agent loop, to n-grams alone and to grammar +
# n-grams (``suffix_gain``); all
SUFFIX_PAIRS = (("agentspec[ngram+suffix]", "agentspec[ngram]"), ("agentspec", "agentspec[grammar+ngram]"))
SYSTEMS = (
    *PEERS,
    *(f"agentspec[{source}]" for source in DRAFT_SOURCES),
    "agentspec[ngram+suffix]",
    "agentspec[grammar+ngram]",
    "agentspec",
)


def parse_system(system: str) -> tuple[str, ...] | None:
    """The draft sources of an agentspec system (``"agentspec[grammar+ngram]"``), None for a peer.

    Raises ValueError for a name that is neither.
    """
    if system == "agentspec":
        return DRAFT_SOURCES
    if system in PEERS:
        return None
    if system.startswith("agentspec[") and system.endswith("]"):
        sources = tuple(system[len("agentspec[") : -1].split("+"))
        if sources and set(sources) <= set(DRAFT_SOURCES) and len(set(sources)) == len(sources):
            return sources
    raise ValueError(
        f"unknown system {system!r}; choose from {', '.join(PEERS)}, agentspec, or agentspec[S+...] with S in "
        f"{', '.join(DRAFT_SOURCES)}"
    )


def applicable_sources(work: Workload, client: Client) -> tuple[str, ...]:
    """The draft sources that have something to draft on this workload."""
    return tuple(
        source for source in DRAFT_SOURCES
        if source == "ngram"
        or (source == "grammar" and work.constrained)
        or (source == "suffix" and work.is_loop)
        or (source == "model" and client.draft is not None)
    )


def applies(system: str, work: Workload, client: Client) -> bool:
    """Whether ``system`` runs on ``work`` (see the module docstring)."""
    if system.startswith("hf_"):
        return not work.constrained
    if system == "outlines":
        return work.constrained and not work.is_loop
    sources = parse_system(system)
    if sources is None or system == "agentspec":
        return True
    useful = set(applicable_sources(work, client))
    return set(sources) < useful  # a proper subset: otherwise the same run as ``agentspec``


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


def _outlines_generate(client: Client, work: Workload, max_tokens: int) -> tuple[str, int]:
    """outlines' own constrained generation over the client's transformers model: (text, forwards).

    The prompt is the text agentspec renders for the request (tool section included) and the schema
    the one agentspec compiles, with compact whitespace as agentspec's grammar.
    """
    try:
        import outlines
        from outlines.types import JsonSchema
    except ImportError:
        raise SystemExit("the outlines peer needs the outlines package: pip install 'agentspec[bench]'") from None
    loaded = client.loaded
    params = parse_params(work.params, default_spec=client.spec)
    messages = with_tool_prompt(work.messages, list(params.tools)) if params.tools else work.messages
    key = (id(loaded.model), json.dumps(params.schema))
    generator = _OUTLINES.get(key)
    if generator is None:  # built once per schema: its index build is not what the rows time
        model = outlines.from_transformers(loaded.model, loaded.tokenizer)
        generator = _OUTLINES[key] = outlines.Generator(model, JsonSchema(params.schema, whitespace_pattern=""))
    counter = _ForwardCounter(loaded.model)
    try:
        text = generator(loaded.chat.render(messages), max_new_tokens=max_tokens, do_sample=False)
    finally:
        counter.close()
    return text, counter.count


_OUTLINES: dict[tuple[int, str], Any] = {}


@dataclass
class _Run:
    """One timed run of a system on a workload."""

    output: list[int] | str  # token ids; text for outlines, which returns text
    tokens: int  # generated, a final stop token included
    forwards: int  # target forward passes
    stats: SpecStats | None = None  # agentspec systems, summed over a loop's requests


def _collect(completions: list[Completion]) -> _Run:
    stats = sum_stats(c.stats for c in completions)
    ids = [t for completion in completions for t in completion.token_ids]
    return _Run(ids, sum(c.usage.completion_tokens for c in completions), stats.target_forward_passes, stats)


async def _agent_loop(client: Client, work: Workload, max_tokens: int, spec: SpecConfig | bool) -> list[Completion]:
    """Every task of an agent-loop workload: call the tool, return its result, take the reply."""
    completions = []
    for number, task in enumerate(work.tasks):
        messages = [*work.messages, {"role": "user", "content": task}]
        call = await client.generate(messages, max_tokens=max_tokens, speculative=spec, **work.params)
        completions.append(call)
        if not call.tool_calls:  # cut off by max_tokens: no result to reply to
            continue
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in call.tool_calls
        ]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ticket": f"INC-{4100 + number}", "status": "open"})}
                     for c in call.tool_calls]
        reply_params = {**work.params, "tool_choice": "none"}
        completions.append(await client.generate(messages, max_tokens=max_tokens, speculative=spec, **reply_params))
    return completions


async def _run_system(client: Client, system: str, work: Workload, max_tokens: int) -> _Run:
    if system in ("hf_plain", "hf_prompt_lookup"):
        prompt_ids = client.loaded.chat.encode(work.messages)
        extra = {"prompt_lookup_num_tokens": 10} if system == "hf_prompt_lookup" else {}
        # on the engine's thread, like agentspec itself, so both run under the same threading conditions
        ids, forwards = await client.run_on_worker(lambda: _hf_generate(client, prompt_ids, max_tokens, **extra))
        stops = client.loaded.stop_token_ids
        end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        return _Run(ids[:end], min(end + 1, len(ids)), forwards)
    if system == "outlines":
        text, forwards = await client.run_on_worker(lambda: _outlines_generate(client, work, max_tokens))
        return _Run(text, forwards, forwards)
    sources = parse_system(system)
    spec: SpecConfig | bool = False if sources is None else client.spec.model_copy(update={"sources": sources})
    # Each timed request (a loop: each loop) drafts from its own prompt and output only and prefills
    # its whole prompt: the bench repeats identical requests, which the suffix cache would replay
    # verbatim and the prefix cache would not prefill (real, but not what these rows measure; see
    # --concurrency for reuse). Inside an agent loop both caches work as they would for an agent.
    await clear_caches(client)
    if work.is_loop:
        return _collect(await _agent_loop(client, work, max_tokens, spec))
    return _collect([await client.generate(work.messages, max_tokens=max_tokens, speculative=spec, **work.params)])


def _same_output(run: _Run, reference: _Run, client: Client) -> bool:
    if isinstance(run.output, str) == isinstance(reference.output, str):
        return run.output == reference.output
    ids = reference.output if isinstance(run.output, str) else run.output
    text = run.output if isinstance(run.output, str) else reference.output
    return client.loaded.tokenizer.decode(ids) == text


async def run_bench(
    client: Client,
    workloads: Iterable[Workload] = WORKLOADS,
    systems: Iterable[str] = SYSTEMS,
    *,
    max_tokens: int | None = None,
    repeats: int = 1,
    on_row: Callable[[BenchRow], None] = lambda row: None,
) -> list[BenchRow]:
    """Time every system on every workload it applies to (median of ``repeats`` after one warm-up run)."""
    rows: list[BenchRow] = []
    systems = tuple(systems)
    for system in systems:
        parse_system(system)  # an unknown name fails before anything runs
    for work in workloads:
        limit = max_tokens or work.max_tokens
        chosen = [system for system in systems if applies(system, work, client)]
        # the reference output: transformers plain, or agentspec plain under the same grammar
        first = "agentspec_plain" if work.constrained else "hf_plain"
        chosen.sort(key=lambda system: system != first)
        reference: _Run | None = None
        for system in chosen:
            await _run_system(client, system, work, min(limit, 8))  # warm-up
            timings, run = [], None
            for _ in range(repeats):
                started = time.perf_counter()
                run = await _run_system(client, system, work, limit)
                timings.append(time.perf_counter() - started)
            assert run is not None
            reference = reference or run
            seconds = statistics.median(timings)
            stats = run.stats
            row = BenchRow(
                workload=work.name,
                system=system,
                tokens=run.tokens,
                seconds=round(seconds, 4),
                tokens_per_s=round(run.tokens / seconds, 2),
                target_forwards=run.forwards,
                identical_to_plain=_same_output(run, reference, client),
                spread=round((max(timings) - min(timings)) / seconds, 3),
                acceptance=round(stats.acceptance_rate, 3) if stats else 0.0,
                tokens_per_pass=round(run.tokens / run.forwards, 2) if run.forwards else 0.0,
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


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``[#######.............]  7/20``: one per finished cell (a line each, so logs keep them)."""
    filled = round(width * done / total) if total else width
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total}"


def format_table(rows: list[BenchRow]) -> str:
    """Rows plus speedups against transformers plain, its prompt lookup, outlines and agentspec plain."""
    baseline = {(r.workload, r.system): r.tokens_per_s for r in rows}

    def ratio(row: BenchRow, system: str) -> str:
        base = baseline.get((row.workload, system))
        return f"{row.tokens_per_s / base:.2f}" if base else "-"

    width = max([17, *(len(r.system) for r in rows)])
    header = (
        f"{'workload':<16} {'system':<{width}} {'tokens':>6} {'tok/s':>7} {'spread':>6} {'passes':>6} {'tok/pass':>8} "
        f"{'accept':>6} {'×hf':>6} {'×lookup':>8} {'×outlines':>9} {'×plain':>7} {'identical':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.workload:<16} {r.system:<{width}} {r.tokens:>6} {r.tokens_per_s:>7.1f} {r.spread:>6.0%} {r.target_forwards:>6} "
            f"{r.tokens_per_pass:>8.2f} {r.acceptance:>6.0%} {ratio(r, 'hf_plain'):>6} {ratio(r, 'hf_prompt_lookup'):>8} "
            f"{ratio(r, 'outlines'):>9} {ratio(r, 'agentspec_plain'):>7} {str(r.identical_to_plain):>9}"
        )
    return "\n".join(lines)


def suffix_gain(rows: list[BenchRow]) -> list[tuple[str, BenchRow, BenchRow]]:
    """Per loop workload, what the suffix cache adds: ``(workload, with, without)`` for each pair of
    ``SUFFIX_PAIRS`` that ran (tokens per target pass is the measure)."""
    by_key = {(r.workload, r.system): r for r in rows}
    gains = []
    for name in dict.fromkeys(r.workload for r in rows):
        for with_suffix, without in SUFFIX_PAIRS:
            a, b = by_key.get((name, with_suffix)), by_key.get((name, without))
            if a is not None and b is not None and "suffix" in a.accepted_by_source:
                gains.append((name, a, b))
    return gains


async def main(args: Any) -> int:
    names = [n for n in args.workloads.split(",") if n] if args.workloads else [w.name for w in WORKLOADS]
    try:
        selected = load_workloads(args.prompts) if args.prompts else [workload(name) for name in names]
        systems = args.systems.split(",") if args.systems else SYSTEMS
        for system in systems:
            parse_system(system)
    except (KeyError, ValueError, OSError) as exc:
        raise SystemExit(str(exc)) from None
    async with Client(args.model, device=args.device, draft=args.draft) as client:
        print(f"model {client.loaded.name} on {client.loaded.device} ({client.loaded.dtype}); workloads: "
              f"{', '.join(w.name for w in selected)}", flush=True)
        if args.concurrency:
            return await _load_main(client, args, selected)
        if "outlines" in systems and importlib.util.find_spec("outlines") is None:
            print("outlines is not installed (pip install 'agentspec[bench]'): no outlines rows", file=sys.stderr)
            systems = [s for s in systems if s != "outlines"]
        cells = sum(1 for w in selected for s in systems if applies(s, w, client))
        done = itertools.count(1)
        rows = await run_bench(
            client, selected, systems, max_tokens=args.max_tokens, repeats=args.repeats,
            on_row=lambda r: print(
                f"  {progress_bar(next(done), cells)} {r.workload:<16} {r.system:<24} {r.tokens_per_s:7.1f} tok/s",
                file=sys.stderr, flush=True,
            ),
        )
        bounds = {}
        for work in (w for w in selected if not w.constrained):  # a perfect draft-length policy, same n-grams
            plain = await client.generate(work.messages, max_tokens=args.max_tokens or work.max_tokens, speculative=False)
            prompt_ids = client.loaded.chat.encode(work.messages)
            bounds[work.name] = ngram_oracle_speedup(prompt_ids, plain.token_ids, client._runtime.engine.costs, client.spec)
        title = f"{client.loaded.name} on {client.loaded.device} ({client.loaded.dtype})"
    print()
    print(format_table(rows))
    if bounds:
        print("\nn-gram oracle bound (perfect draft lengths, same drafter) over plain: "
              + ", ".join(f"{name} {bound:.2f}×" for name, bound in bounds.items()))
    for name, with_suffix, without in suffix_gain(rows):
        print(f"{name}: suffix cache {with_suffix.tokens_per_pass / without.tokens_per_pass:.2f}× tokens per target pass: "
              f"{with_suffix.system} {with_suffix.tokens_per_pass:.2f}, {without.system} {without.tokens_per_pass:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"\nrows written to {args.json}")
    if args.plot:
        from .plot import write_bench_plot

        print(f"chart written to {write_bench_plot(rows, args.plot, title=title)}")
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
    if args.plot:
        from .plot import write_load_plot

        title = f"{client.loaded.name} on {client.loaded.device} ({client.loaded.dtype})"
        print(f"chart written to {write_load_plot(rows, args.plot, title=title)}")
    return 0
