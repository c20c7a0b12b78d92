"""`agentspec bench` rows are well-formed and every system agrees with plain decoding."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from agentspec.bench import (
    SYSTEMS,
    BenchRow,
    format_table,
    load_workloads,
    ngram_oracle_speedup,
    parse_system,
    run_bench,
    suffix_gain,
    workload,
)
from agentspec.bench.llamacpp import LLAMACPP_SYSTEMS, unavailable
from agentspec.bench.passes import PassReport, pass_report, read_bandwidth, until_calibrated, weight_bytes
from agentspec.bench.single import _agent_loop
from agentspec.engine.lengths import CostModel
from agentspec.passes.weights import REDUCED
from agentspec.types import SpecConfig

# Installed or not, llama.cpp's rows are tested on their own (test_llamacpp_rows): its own kernels on
# the 4-bit file do not give transformers' tokens, which the rows below assert.
OWN_SYSTEMS = [s for s in SYSTEMS if s not in LLAMACPP_SYSTEMS]


@pytest.mark.parametrize("name", ["document_answer", "summary", "code_edit", "open_chat"])
async def test_bench_rows(client, name):
    rows = await run_bench(client, [workload(name)], OWN_SYSTEMS, max_tokens=6)
    # no grammar, no earlier outputs: n-grams and the shipped draft head are the sources, each alone then both
    systems = ["hf_plain", "hf_prompt_lookup", "agentspec_plain", "agentspec[ngram]", "agentspec[model]", "agentspec"]
    # the reference is transformers plain, unless agentspec runs reduced precision (another model's
    # logits, "gguf-q16" where "auto" picks it): then agentspec plain, first
    reduced = client.engine.weights.name in REDUCED
    if reduced:
        systems.remove("agentspec_plain")
        systems.insert(0, "agentspec_plain")
    assert [r.system for r in rows] == systems
    for row in rows:
        assert row.workload == name
        assert 1 <= row.tokens <= 6 and row.seconds > 0 and row.tokens_per_s > 0
        assert 1 <= row.target_forwards <= row.tokens + 1
        if row.system.startswith("agentspec") or not reduced:
            assert row.identical_to_plain, f"{row.system} disagrees with {systems[0]}"
    table = format_table(rows)
    assert all(row.system in table for row in rows)


def flat_costs(positions: int = 17) -> CostModel:
    costs = CostModel(positions)
    for p in range(1, positions + 1):
        costs.record(p, 10.0 + p)
    return costs


def test_oracle_bound():
    spec = SpecConfig()
    prompt = list(range(100, 140))
    copied = ngram_oracle_speedup(prompt, prompt[:32], flat_costs(), spec)
    fresh = ngram_oracle_speedup(prompt, list(range(500, 532)), flat_costs(), spec)
    assert fresh == 1.0  # nothing repeats: every step is a plain one
    assert copied > 3.0  # a verbatim copy: long drafts, all accepted


async def test_constrained_workloads_run_on_agentspec_and_outlines(client):
    rows = await run_bench(client, [workload("tool_call"), workload("extraction")], OWN_SYSTEMS, max_tokens=12)
    systems = ["agentspec_plain", "outlines", "agentspec[grammar]", "agentspec[ngram]", "agentspec[model]", "agentspec[grammar+ngram]", "agentspec"]
    assert [(r.workload, r.system) for r in rows] == [(name, system) for name in ("tool_call", "extraction") for system in systems]
    for row in rows:
        assert row.tokens == 12 and row.target_forwards >= 1
        if row.system == "outlines":  # its own decoding under the same schema: one token per pass, no canonical forcing
            assert row.target_forwards == 12 and row.acceptance == 0
        else:
            assert row.identical_to_plain, f"{row.workload} {row.system} disagrees with agentspec plain under the grammar"
            assert set(row.accepted_by_source) <= set(parse_system(row.system) or ())
    table = format_table(rows)
    assert "tool_call" in table and "×outlines" in table


async def test_agent_loop_rows(client):
    loop = dataclasses.replace(workload("agent_loop"), tasks=workload("agent_loop").tasks[:2])
    rows = await run_bench(client, [loop], SYSTEMS, max_tokens=8)
    assert [r.system for r in rows] == [
        "agentspec_plain", "agentspec[grammar]", "agentspec[ngram]", "agentspec[suffix]", "agentspec[model]", "agentspec[ngram+suffix]",
        "agentspec[grammar+ngram]", "agentspec[grammar+ngram+suffix]", "agentspec",
    ]  # transformers and outlines cannot run a tool-calling loop; the suffix cache is a source here, and the draft head
    for row in rows:
        assert row.identical_to_plain and row.tokens == 16  # two calls cut at 8 tokens: no tool result, no reply
    assert rows[-1].accepted_by_source.get("grammar", 0) > 0


async def test_agent_loop_calls_tools_and_replies_the_same_with_and_without_speculation(client):
    loop = dataclasses.replace(workload("agent_loop"), tasks=workload("agent_loop").tasks[5:])
    plain = await _agent_loop(client, loop, 96, False)
    fast = await _agent_loop(client, loop, 96, True)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert len(plain) == 2 and plain[0].finish_reason == "tool_calls" and plain[0].tool_calls[0].name == "create_ticket"
    assert plain[1].tool_calls == [] and plain[1].text  # the reply, after the tool's result


def test_suffix_gain_pairs_rows_that_ran():
    def row(system, passes, suffix=0):
        return BenchRow("agent_loop", system, 60, 1.0, 60.0, passes, True, tokens_per_pass=60 / passes,
                        accepted_by_source={"suffix": suffix} if suffix else {})

    rows = [row("agentspec[ngram]", 30), row("agentspec[ngram+suffix]", 20, suffix=9), row("agentspec", 12, suffix=5)]
    gains = suffix_gain(rows)  # agentspec[grammar+ngram] did not run: one pair
    assert [(name, a.system, b.system) for name, a, b in gains] == [("agent_loop", "agentspec[ngram+suffix]", "agentspec[ngram]")]
    assert suffix_gain(rows[:1] + [row("agentspec[ngram+suffix]", 20)]) == []  # the cache drafted nothing: no gain to show
    # with a draft head, "agentspec" holds the head too: the suffix cache's gain is measured without it
    headed = [row("agentspec[grammar+ngram]", 30), row("agentspec[grammar+ngram+suffix]", 20, suffix=9), row("agentspec", 12, suffix=5)]
    assert [(a.system, b.system) for _, a, b in suffix_gain(headed)] == [("agentspec[grammar+ngram+suffix]", "agentspec[grammar+ngram]")]


def test_system_names():
    assert parse_system("agentspec") == ("grammar", "ngram", "suffix", "model")
    assert parse_system("agentspec[suffix+ngram]") == ("suffix", "ngram") and parse_system("outlines") is None
    for bad in ("agentspec[]", "agentspec[ngrams]", "agentspec[ngram+ngram]", "vllm"):
        with pytest.raises(ValueError, match="unknown system"):
            parse_system(bad)


async def test_user_prompts_from_jsonl(client, tmp_path):
    path = tmp_path / "traffic.jsonl"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    lines = [
        {"name": "quote", "prompt": "Repeat exactly: one two three four.", "max_tokens": 6},
        {"messages": [{"role": "user", "content": "Where is the Louvre? Answer as JSON."}],
         "params": {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    works = load_workloads(str(path))
    assert [w.name for w in works] == ["quote", "line2"] and works[1].constrained and works[0].max_tokens == 6
    rows = await run_bench(client, works, ("agentspec_plain", "agentspec"), max_tokens=6, repeats=2)
    assert [(r.workload, r.system) for r in rows] == [(w, s) for w in ("quote", "line2") for s in ("agentspec_plain", "agentspec")]
    for row in rows:
        assert row.identical_to_plain and row.spread >= 0 and row.tokens_per_pass == round(row.tokens / row.target_forwards, 2)
    for row in rows:  # accepted tokens are counted by source exactly when some were accepted
        assert 0 <= row.acceptance <= 1 and (sum(row.accepted_by_source.values()) > 0) == (row.acceptance > 0)
    assert rows[0].acceptance == 0  # agentspec_plain drafts nothing


async def test_sampled_rows_are_token_identical_to_agentspec_plain(client):
    """``--temperature``: agentspec rows sample with one seed, so speculative output equals plain's
    token for token; the greedy-only peers do not run."""
    works = [workload("document_answer"), workload("tool_call")]
    rows = await run_bench(client, works, ("hf_plain", "agentspec_plain", "agentspec"), max_tokens=8, temperature=0.8)
    assert [(r.workload, r.system) for r in rows] == [(w.name, s) for w in works for s in ("agentspec_plain", "agentspec")]
    for row in rows:
        assert row.temperature == 0.8 and row.identical_to_plain, row


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"prompt": "hi"', "traffic.jsonl:1: not JSON"),
        ('{"name": "x"}', 'exactly one of "messages" or "prompt"'),
        ('{"prompt": "hi", "params": {"temprature": 1}}', "temprature"),
        ("", "no requests"),
    ],
)
def test_bad_prompt_files(tmp_path, content, needle):
    path = tmp_path / "traffic.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle):
        load_workloads(str(path))


async def test_concurrency_rows_and_second_turn_ttft(client):
    from agentspec.bench import format_load_table, run_concurrency, second_turn_ttft

    works = [workload("document_answer"), workload("open_chat")]
    rows = await run_concurrency(client, [1, 2], works, max_tokens=4, rounds=2)
    assert [(r.system, r.concurrency) for r in rows] == [(s, n) for s in ("agentspec_plain", "agentspec") for n in (1, 2)]
    for row in rows:
        assert row.requests == 2 * row.concurrency
        assert row.requests <= row.tokens <= 4 * row.requests
        assert row.tokens_per_s > 0 and row.ttft_ms > 0 and row.tokens_per_pass >= 1.0
    assert rows[0].scaling == 1.0 and rows[1].scaling == round(rows[1].tokens_per_s / rows[0].tokens_per_s, 2)
    assert "concurrency" in format_load_table(rows)
    cold, warm = await second_turn_ttft(client, workload("document_answer"), repeats=1)
    assert cold > 0 and warm > 0  # speed is the bench's to report; reuse itself: tests/test_batching.py


def test_bench_command_writes_table_json_and_chart(tmp_path, capsys):
    """`agentspec bench` end to end: a table on stdout, rows as JSON, the chart as a PNG."""
    from agentspec.cli import main

    rows_path, chart = tmp_path / "rows.json", tmp_path / "charts" / "bench.png"
    code = main(["bench", "--workloads", "extraction", "--max-tokens", "4", "--systems", "agentspec_plain,llamacpp,agentspec",
                 "--json", str(rows_path), "--plot", str(chart)])
    captured = capsys.readouterr()
    assert code == 0 and "extraction" in captured.out and "×outlines" in captured.out and "×llama" in captured.out
    assert "pass of 1 position " in captured.out and "of 8 positions" in captured.out and "this machine reads" in captured.out
    rows = json.loads(rows_path.read_text())
    llama = ["llamacpp"] if importlib.util.find_spec("llama_cpp") else []  # else the command says why (make bench installs it)
    assert [r["system"] for r in rows] == ["agentspec_plain", *llama, "agentspec"]
    assert all(r["tokens"] == 4 for r in rows if r["system"] != "llamacpp")
    assert llama or "no llama.cpp rows: llama-cpp-python is not installed" in captured.err
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_command_rejects_unknown_systems(capsys):
    from agentspec.cli import main

    with pytest.raises(SystemExit, match=r"unknown system 'agentspec\[ngrams\]'"):
        main(["bench", "--systems", "agentspec[ngrams]"])


def test_progress_bar():
    from agentspec.bench.cli import progress_bar

    assert progress_bar(0, 4, width=8) == "[........] 0/4"
    assert progress_bar(1, 4, width=8) == "[##......] 1/4"
    assert progress_bar(4, 4, width=8) == "[########] 4/4"
    assert progress_bar(3, 12, width=4) == "[#...]  3/12"


async def test_llamacpp_rows(client):
    """llama.cpp on the same GGUF: plain and prompt lookup without a grammar, its JSON-schema grammar
    under one, never on the agent loop. Not installed (`make test` does not build it; `make bench`
    does): no rows, and the command says why."""
    reason = unavailable(client)
    systems = ["agentspec_plain", *LLAMACPP_SYSTEMS]
    if reason is not None:  # the command prints it: test_bench_command_writes_table_json_and_chart
        assert "llama-cpp-python is not installed" in reason and "make bench" in reason
        rows = await run_bench(client, [workload("extraction")], systems, max_tokens=8)
        assert [r.system for r in rows] == ["agentspec_plain"]
        return
    rows = await run_bench(client, [workload("document_answer"), workload("extraction"), workload("agent_loop")], systems, max_tokens=8)
    ran = [(r.workload, r.system) for r in rows if r.system in LLAMACPP_SYSTEMS]
    assert ran == [("document_answer", "llamacpp"), ("document_answer", "llamacpp_prompt_lookup"), ("extraction", "llamacpp")]
    for row in (r for r in rows if r.system in LLAMACPP_SYSTEMS):
        assert 1 <= row.tokens <= 8 and row.tokens_per_s > 0 and row.target_forwards == 0  # passes: not reported
    from agentspec.bench.llamacpp import llamacpp_generate

    work = workload("extraction")  # the grammar holds: a complete object with the schema's keys
    text, tokens = await client.run_on_worker(lambda: llamacpp_generate(client, "llamacpp", work, 96))
    assert set(json.loads(text)) >= set(work.params["response_format"]["json_schema"]["schema"]["required"]), text


def test_the_pass_report_counts_the_weights_a_token_reads(engine):
    """``agentspec bench`` reports a token's weights as the kernels stream them — every decoder
    product's blocks and the LM head's: about the default model's file (the Q4_1 blocks in 4 bits
    with float16 scales and minimums, the float32 norms and embedding rows not counted) — and the
    bandwidth a one-position pass reaches against the machine's own reading; a pass whose weights
    are not all on the file's blocks is not counted."""
    from agentspec.passes.fused import FusedPass
    from agentspec.passes.weights import onednn_linear

    counted = weight_bytes(engine.forward)
    if engine.weights.isa is None:
        assert counted is None
    else:
        size = engine.loaded.gguf_file.stat().st_size
        assert 0.5 * size < counted < 1.25 * size, (counted, size)
    assert weight_bytes(FusedPass(engine.loaded.model, onednn_linear)) is None
    bandwidth = read_bandwidth()
    assert bandwidth > 1e8  # bytes/s: a machine reads more than 100 MB/s
    report = PassReport("gguf-q16", "by rule", "avx2", {1: 4.0, 8: 8.0}, 2**27, 4e10, 2)
    first, times, streamed = report.lines()
    assert first == "pass gguf-q16 on avx2 kernels: by rule" and "(2.00x)" in times
    assert "128 MiB: 1 position streams them at 33.6 GB/s, 84% of what this machine reads 40.0 GB/s" in streamed
    assert times == "pass of 1 position 4.00 ms, of 8 positions 8.00 ms (2.00x)"
    assert "passes and reading in turn, best of 5 each" in streamed


async def test_the_pass_report_times_the_passes_and_the_reading_in_turn(client):
    """``pass_report`` on the engine's thread: both pass shapes timed now (``Engine.time_pass``, which
    leaves the engine's cost model as it was), the reading beside them."""
    await until_calibrated(client)
    engine = client.engine
    before = {p: (engine.costs.measured(p), engine.costs.cost(p)) for p in (1, 8)}
    report = await client.run_on_worker(lambda: pass_report(client))
    assert set(report.ms) == {1, 8} and all(0 < ms < 10_000 for ms in report.ms.values()), report.ms
    assert report.read_bytes_per_s > 1e8 and report.threads >= 1
    assert len(report.lines()) == 3 and report.lines()[0].startswith(f"pass {engine.weights.name}")
    assert {p: (engine.costs.measured(p), engine.costs.cost(p)) for p in (1, 8)} == before


@pytest.mark.parametrize("arguments", [{"positions": 0}, {"positions": True}, {"positions": 1, "repeats": 0}, {"positions": 1, "context": 10**9}])
def test_timing_a_pass_refuses_bad_shapes(engine, arguments):
    with pytest.raises(ValueError):
        engine.time_pass(**arguments)
