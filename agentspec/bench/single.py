"""One request stream at a time: every system on every workload it applies to, timed in one process.

``run_bench`` runs the systems of ``systems.py`` on the same model and prompts (transformers
``generate`` and outlines through the client's own model, on its worker thread) and returns a row per
(workload, system) it applies to.

Each row: {workload, system, tokens, seconds, tokens_per_s, target_forwards, identical_to_plain,
spread, acceptance, tokens_per_pass, accepted_by_source} (``seconds`` is the median of the repeats,
``spread`` their (max − min) / median),
where ``identical_to_plain`` compares the output with the first system run (``hf_plain`` by default;
``agentspec_plain`` under the same grammar for the constrained workloads, when sampling, on reduced
precision — another model's logits than transformers' — or without ``hf_plain`` in the run;
outlines by text, as it returns text). Speed is always a ratio against a baseline measured in the same process, never an
absolute claim.

``ngram_oracle_speedup`` bounds what the n-gram drafter could gain on a known output;
``suffix_gain`` pairs the rows that show what the suffix cache adds on an agent loop.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from ..client import Client
from ..drafting import NgramIndex
from ..drafting.base import common_prefix
from ..passes.weights import REDUCED
from ..metrics import sum_stats
from ..params import parse_params
from ..structured.tools import with_tool_prompt
from ..types import Completion, SpecConfig, SpecStats
from .llamacpp import LLAMACPP_SYSTEMS, llamacpp_generate
from .systems import SUFFIX_PAIRS, SYSTEMS, applies, parse_system
from .workloads import WORKLOADS, Workload

if TYPE_CHECKING:
    from ..engine.lengths import CostModel

__all__ = ["BENCH_SEED", "BenchRow", "run_bench", "format_table", "ngram_oracle_speedup", "suffix_gain"]

BENCH_SEED = 1234  # --temperature: every sampled request's seed, so plain and speculative runs compare


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
    temperature: float = 0.0  # > 0: agentspec rows sampled with seed BENCH_SEED


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
        raise SystemExit("the outlines peer needs the outlines package: pip install 'agentspec-llm[bench]'") from None
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


async def _agent_loop(client: Client, work: Workload, max_tokens: int, spec: SpecConfig | bool, params: dict[str, Any] | None = None) -> list[Completion]:
    """Every task of an agent-loop workload: call the tool, return its result, take the reply
    (``params``: the requests' parameters, by default the workload's)."""
    params = work.params if params is None else params
    completions = []
    for number, task in enumerate(work.tasks):
        messages = [*work.messages, {"role": "user", "content": task}]
        call = await client.generate(messages, max_tokens=max_tokens, speculative=spec, **params)
        completions.append(call)
        if not call.tool_calls:  # cut off by max_tokens: no result to reply to
            continue
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in call.tool_calls
        ]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ticket": f"INC-{4100 + number}", "status": "open"})}
                     for c in call.tool_calls]
        reply_params = {**params, "tool_choice": "none"}
        completions.append(await client.generate(messages, max_tokens=max_tokens, speculative=spec, **reply_params))
    return completions


async def _run_system(client: Client, system: str, work: Workload, max_tokens: int, temperature: float = 0.0) -> _Run:
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
    if system in LLAMACPP_SYSTEMS:  # its passes are not reported: 0, shown as unknown
        text, tokens = await client.run_on_worker(lambda: llamacpp_generate(client, system, work, max_tokens))
        return _Run(text, tokens, 0)
    sources = parse_system(system)
    spec: SpecConfig | bool = False if sources is None else client.spec.model_copy(update={"sources": sources})
    # Each timed request (a loop: each loop) drafts from its own prompt and output only and prefills
    # its whole prompt: the bench repeats identical requests, which the suffix cache would replay
    # verbatim and the prefix cache would not prefill (real, but not what these rows measure; see
    # --concurrency for reuse). Inside an agent loop both caches work as they would for an agent.
    await client.clear_caches()
    params = {**work.params, "temperature": temperature, "seed": BENCH_SEED} if temperature else work.params
    if work.is_loop:
        return _collect(await _agent_loop(client, work, max_tokens, spec, params))
    return _collect([await client.generate(work.messages, max_tokens=max_tokens, speculative=spec, **params)])


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
    temperature: float = 0.0,
    on_row: Callable[[BenchRow], None] = lambda row: None,
) -> list[BenchRow]:
    """Time every system on every workload it applies to (median of ``repeats`` after one warm-up run).

    With ``temperature`` > 0 the agentspec rows sample (seed ``BENCH_SEED``), the reference is
    agentspec plain, and identical means token for token with it; the greedy-only peers do not run."""
    rows: list[BenchRow] = []
    systems = tuple(systems)
    for system in systems:
        parse_system(system)  # an unknown name fails before anything runs
    for work in workloads:
        limit = max_tokens or work.max_tokens
        chosen = [system for system in systems if applies(system, work, client) and (system.startswith("agentspec") or not temperature)]
        # the reference output: transformers plain, or agentspec plain under the same grammar, sampling,
        # reduced precision (whose plain decoding is another model's), or when transformers does not run
        same_model = client.engine.weights.name not in REDUCED and "hf_plain" in chosen
        first = "hf_plain" if same_model and not (work.constrained or temperature) else "agentspec_plain"
        chosen.sort(key=lambda system: system != first)
        reference: _Run | None = None
        for system in chosen:
            await _run_system(client, system, work, min(limit, 8), temperature)  # warm-up
            timings, run = [], None
            for _ in range(repeats):
                started = time.perf_counter()
                run = await _run_system(client, system, work, limit, temperature)
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
                temperature=temperature,
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
        matched = common_prefix(draft, output_ids[position : position + len(draft)])
        if matched and (matched + 1) / costs.effective_cost(matched + 1) > 1 / costs.effective_cost(1):
            step, spent = matched + 1, spent + costs.effective_cost(matched + 1)
        else:
            step, spent = 1, spent + costs.effective_cost(1)
        index.extend(output_ids[position : position + step])
        position += step
    return len(output_ids) * costs.effective_cost(1) / spent if spent else 1.0


def format_table(rows: list[BenchRow]) -> str:
    """Rows plus speedups against transformers plain, its prompt lookup, outlines, llama.cpp (plain, or
    its grammar under a schema) and agentspec plain."""
    baseline = {(r.workload, r.system): r.tokens_per_s for r in rows}

    def ratio(row: BenchRow, system: str) -> str:
        base = baseline.get((row.workload, system))
        return f"{row.tokens_per_s / base:.2f}" if base else "-"

    width = max([17, *(len(r.system) for r in rows)])
    header = (
        f"{'workload':<16} {'system':<{width}} {'tokens':>6} {'tok/s':>7} {'spread':>6} {'passes':>6} {'tok/pass':>8} "
        f"{'accept':>6} {'×hf':>6} {'×lookup':>8} {'×outlines':>9} {'×llama':>7} {'×plain':>7} {'identical':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.workload:<16} {r.system:<{width}} {r.tokens:>6} {r.tokens_per_s:>7.1f} {r.spread:>6.0%} {r.target_forwards:>6} "
            f"{r.tokens_per_pass:>8.2f} {r.acceptance:>6.0%} {ratio(r, 'hf_plain'):>6} {ratio(r, 'hf_prompt_lookup'):>8} "
            f"{ratio(r, 'outlines'):>9} {ratio(r, 'llamacpp'):>7} {ratio(r, 'agentspec_plain'):>7} {str(r.identical_to_plain):>9}"
        )
    return "\n".join(lines)


def suffix_gain(rows: list[BenchRow]) -> list[tuple[str, BenchRow, BenchRow]]:
    """Per loop workload, what the suffix cache adds: ``(workload, with, without)`` for each pair of
    ``SUFFIX_PAIRS`` that ran (tokens per target pass is the measure)."""
    by_key = {(r.workload, r.system): r for r in rows}
    gains = []
    for name in dict.fromkeys(r.workload for r in rows):
        baselines: set[str] = set()
        for with_suffix, without in SUFFIX_PAIRS:
            a, b = by_key.get((name, with_suffix)), by_key.get((name, without))
            if a is not None and b is not None and "suffix" in a.accepted_by_source and without not in baselines:
                baselines.add(without)
                gains.append((name, a, b))
    return gains

