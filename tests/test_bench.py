"""`agentspec bench` rows are well-formed and every system agrees with plain decoding."""

from __future__ import annotations

from agentspec.bench import SYSTEMS, format_table, ngram_oracle_speedup, run_bench
from agentspec.budget import CostModel
from agentspec.types import SpecConfig
from agentspec.workloads import workload


async def test_bench_rows(client):
    rows = await run_bench(client, [workload("document_answer")], SYSTEMS, max_tokens=6)
    assert [r.system for r in rows] == list(SYSTEMS)
    for row in rows:
        assert row.workload == "document_answer"
        assert 1 <= row.tokens <= 6 and row.seconds > 0 and row.tokens_per_s > 0
        assert 1 <= row.target_forwards <= row.tokens + 1
        assert row.identical_to_plain, f"{row.system} disagrees with transformers plain decoding"
    table = format_table(rows)
    assert all(system in table for system in SYSTEMS)


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


async def test_constrained_workloads_run_only_on_agentspec(client):
    rows = await run_bench(client, [workload("tool_call"), workload("extraction")], SYSTEMS, max_tokens=12)
    assert [(r.workload, r.system) for r in rows] == [
        (name, system) for name in ("tool_call", "extraction") for system in ("agentspec_plain", "agentspec")
    ]
    assert all(r.identical_to_plain and r.tokens == 12 for r in rows)
    assert "tool_call" in format_table(rows)
