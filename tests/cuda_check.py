"""The CUDA path, checked on a GPU machine: ``python -m tests.cuda_check [MODEL] [--out DIR]``.

Not a pytest module (CI has no GPU). It runs the same engine code as on CPU with device="cuda":
1. equivalence: every prompt decoded plainly alone, speculatively alone, and both ways in one batch,
   in bf16 (the CUDA default) and fp32, on the pass "auto" picks and on the static pass (key/value
   pool, one attention call per layer, CUDA graphs); token ids compared, first difference reported;
2. the static pass against the fused one: pass times by rows × positions (target: one position of
   one sequence ≤ 3 ms), graphs captured (one per shape: repeating a shape captures nothing more),
   capture failures;
3. single-stream speed against transformers' generate (plain and prompt lookup), same process;
4. aggregate throughput, TTFT and TPOT at several concurrency levels, and second-turn TTFT;
5. every model family of ``passes/arch.py`` (tests/test_families.py's tiny random models, every
   switch on) on the static pass in bf16 and fp32: checked against the model's own forward at start,
   greedy speculative == plain, graphs captured.
Results are printed and written to ``DIR/cuda_check.json`` after each part (a timeout keeps what ran).
It also runs on CPU (``--device cpu``) with small settings, to check the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

import agentspec
from agentspec.bench import WORKLOADS, run_bench, run_concurrency, second_turn_ttft, workload
from agentspec.engine import Engine, Sequence
from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.passes.packed import PackedRow
from agentspec.passes.weights import fastest_pass_ms, select_weights
from agentspec.model import load_model
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def decode_alone(engine: Engine, ids: list[int], spec: bool, max_tokens: int) -> list[int]:
    seq = Sequence(list(ids), GenerationParams(max_tokens=max_tokens, spec=SpecConfig(enabled=spec)), max_new_tokens=max_tokens)
    engine.start(seq)
    while seq.finish_reason is None:
        engine.step(seq)
    engine.release(seq)
    return seq.output_ids


def equivalence(model: str | None, device: str, dtype: str, max_tokens: int, weights: str = "auto") -> dict:
    loaded = load_model(model, device=device, dtype=dtype)
    engine = Engine(loaded, weights=weights)
    engine.calibrate()
    prompts = [loaded.chat.encode(w.messages) for w in WORKLOADS if not w.constrained]

    def alone(ids: list[int], spec: bool) -> list[int]:
        return decode_alone(engine, ids, spec, max_tokens)

    def batched(spec: bool) -> list[list[int]]:
        seqs = [Sequence(list(ids), GenerationParams(max_tokens=max_tokens, spec=SpecConfig(enabled=spec)), max_new_tokens=max_tokens) for ids in prompts]
        for seq in seqs:
            engine.start(seq)
        active = list(seqs)
        while active:
            for seq, result in zip(list(active), engine.step_many(active)):
                if isinstance(result, Exception):
                    raise result
                if result.finish_reason is not None:
                    active.remove(seq)
                    engine.release(seq)
        return [seq.output_ids for seq in seqs]

    plain = [alone(ids, False) for ids in prompts]
    spec = [alone(ids, True) for ids in prompts]
    batch_plain, batch_spec = batched(False), batched(True)
    return {
        "dtype": str(loaded.dtype),
        "prompts": len(prompts),
        "tokens": [len(p) for p in plain],
        "speculative_vs_plain": [first_difference(p, s) for p, s in zip(plain, spec)],
        "batched_plain_vs_plain": [first_difference(p, b) for p, b in zip(plain, batch_plain)],
        "batched_speculative_vs_plain": [first_difference(p, b) for p, b in zip(plain, batch_spec)],
        "pass_ms_by_positions": {p: round(engine.costs.cost(p), 2) for p in (1, 2, 4, 8, 17, 32, 64)},
        "target_pass": {"chosen": engine.weights.name, "reason": engine.weights.reason},  # the candidates, timed there
        "graphs_captured": getattr(engine.forward, "captured", None),
        "graph_failures": getattr(engine.forward, "graph_failures", None),
    }


def static_pass(model: str | None, device: str, dtype: str, shapes: list[tuple[int, int]], context: int = 200) -> dict:
    """The static pass against the fused one, by (sequences, positions each) over ``context`` tokens."""
    loaded = load_model(model, device=device, dtype=dtype)
    layout = KVLayout.of(loaded.model)
    passes = {name: select_weights(loaded.model, layout, name).forward for name in ("fused", "static")}
    timings: dict[str, float] = {}
    for name, forward in passes.items():
        for sequences, positions in shapes:
            blocks = [KVBlock(layout) for _ in range(sequences)]
            forward([PackedRow(b, list(range(100, 100 + context)), 1) for b in blocks])
            rows = [PackedRow(b, [100] * positions, positions) for b in blocks]
            timings[f"{name} {sequences}x{positions}"] = round(fastest_pass_ms(forward, rows, 10), 3)
    static = passes["static"]
    captured = static.captured
    block = KVBlock(layout)
    static([PackedRow(block, list(range(100, 100 + context)), 1)])
    for _ in range(20):  # one shape again and again: replayed, never captured anew
        static([PackedRow(block, [100], 1)])
    return {
        "dtype": str(loaded.dtype),
        "pass_ms": timings,
        "captured": static.captured,
        "captured_by_20_more_plain_steps": static.captured - captured,  # 0: the shape was captured in the timings
        "graph_failures": static.graph_failures,
        "pool_sequences": static.pool.sequences,
        "pool_capacity": static.pool.capacity,
    }


def families(device: str, dtype: str, max_tokens: int) -> dict:
    """Each family of ``passes/arch.py`` as a tiny random model (tests/test_families.py) on the static
    pass: the engine's start-up check against the model's own forward, then greedy speculative ==
    plain; an error is reported per family, not raised."""
    from agentspec.passes.arch import FAMILIES

    from .test_families import family_model

    default = load_model(None, device="cpu", dtype="float32")  # the tokenizer and chat format the tiny models share
    torch_dtype = getattr(torch, dtype)
    prompts = ["one two three one two three one two three one two", "The cat sat. The cat sat. The cat"]
    report: dict = {}
    for name in FAMILIES:
        # bf16 keeps 8 bits: smaller weights keep the logits' magnitude, so its rounding, within the start-up check's 0.1
        model = family_model(name, default.vocab_size, noise=0.3 if dtype == "float32" else 0.05).to(device=device, dtype=torch_dtype)
        tiny = default.with_model(model, name=f"tiny-{name}", device=torch.device(device), dtype=torch_dtype, context_window=512)
        try:
            engine = Engine(tiny, weights="static")
            engine.calibrate(repeats=1)
            ids = [tiny.chat.encode([{"role": "user", "content": prompt}]) for prompt in prompts]
            differences = [first_difference(decode_alone(engine, i, False, max_tokens), decode_alone(engine, i, True, max_tokens)) for i in ids]
            report[name] = {"speculative_vs_plain": differences, "captured": engine.forward.captured, "graph_failures": engine.forward.graph_failures}
        except Exception as exc:  # one family's failure is a finding, not the end of the run
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return report


async def speed(model: str | None, device: str, max_tokens: int | None, repeats: int, levels: list[int], report: dict, save) -> None:
    limits = agentspec.Limits(max_batch=max(levels))
    async with agentspec.Client(model, device=device, limits=limits) as client:
        names = ["document_answer", "summary", "code_edit", "open_chat", "tool_call", "extraction"]
        rows = await run_bench(client, [workload(n) for n in names], ("hf_plain", "hf_prompt_lookup", "agentspec_plain", "agentspec"),
                               max_tokens=max_tokens, repeats=repeats)
        report["single_stream"] = [asdict(r) for r in rows]
        save()
        open_workloads = [w for w in WORKLOADS if not w.constrained]
        load = await run_concurrency(client, levels, open_workloads, max_tokens=max_tokens or 64, repeats=repeats)
        report["concurrency"] = [asdict(r) for r in load]
        save()
        cold, warm = await second_turn_ttft(client, open_workloads[0], repeats=3)
        report["second_turn_ttft_ms"] = {"cold": round(cold, 1), "warm": round(warm, 1)}
        save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=".")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--levels", default="1,8,32")
    args = parser.parse_args()
    out = Path(args.out) / "cuda_check.json"
    report: dict = {"torch": torch.__version__, "device": args.device}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)

    def save() -> None:
        out.write_text(json.dumps(report, indent=1))
        print(json.dumps(report)[-3000:], flush=True)

    started = time.perf_counter()
    cuda = args.device.startswith("cuda")
    for dtype in ("bfloat16", "float32") if cuda else ("float32",):
        report[f"equivalence_{dtype}"] = equivalence(args.model, args.device, dtype, max_tokens=args.max_tokens or 48)
        save()
    report["equivalence_static"] = equivalence(args.model, args.device, "auto", max_tokens=args.max_tokens or 48, weights="static")
    save()
    shapes = [(1, 1), (1, 8), (8, 1), (8, 8), (32, 1), (32, 8)] if cuda else [(1, 1), (1, 8), (4, 1)]
    report["static_pass"] = static_pass(args.model, args.device, "auto", shapes)
    save()
    for dtype in ("bfloat16", "float32") if cuda else ("float32",):
        report[f"families_{dtype}"] = families(args.device, dtype, max_tokens=24)
        save()
    levels = [int(n) for n in args.levels.split(",")]
    asyncio.run(speed(args.model, args.device, args.max_tokens, args.repeats, levels, report, save))
    report["seconds"] = round(time.perf_counter() - started, 1)
    save()


if __name__ == "__main__":
    main()
