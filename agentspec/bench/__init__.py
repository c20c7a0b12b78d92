"""``agentspec bench``: agentspec against its peers, in one process, on the same model and prompts.

Modules (imports run one way: ``cli`` → ``single``, ``load``, ``plot``; ``plot`` → the row types of
``single`` and ``load``; ``single``, ``load`` → ``systems``, ``workloads``):

- ``workloads``  the agent-style requests (also ``agentspec demo``'s) and ``--prompts`` JSONL files
- ``systems``    the systems compared (peers, agentspec with some or all draft sources) and where each runs
- ``single``     one stream at a time: ``run_bench`` rows, their table, the n-gram oracle bound, the suffix gain
- ``load``       ``--concurrency``: throughput, TTFT and TPOT with n requests in flight; second-turn TTFT
- ``plot``       the PNG charts of either kind of rows (needs matplotlib)
- ``cli``        ``main(args)``, what ``agentspec bench`` runs
"""

from __future__ import annotations

from .workloads import WORKLOADS, Workload, load_workloads, workload
from .systems import PEERS, SUFFIX_PAIRS, SYSTEMS, applicable_sources, applies, parse_system
from .single import BenchRow, format_table, ngram_oracle_speedup, run_bench, suffix_gain
from .load import LoadRow, format_load_table, run_concurrency, second_turn_ttft
from .plot import write_bench_plot, write_load_plot
from .cli import main

__all__ = [
    # workloads
    "WORKLOADS",
    "Workload",
    "load_workloads",
    "workload",
    # systems
    "PEERS",
    "SYSTEMS",
    "SUFFIX_PAIRS",
    "parse_system",
    "applicable_sources",
    "applies",
    # single stream
    "BenchRow",
    "run_bench",
    "format_table",
    "ngram_oracle_speedup",
    "suffix_gain",
    # under load
    "LoadRow",
    "run_concurrency",
    "second_turn_ttft",
    "format_load_table",
    # charts
    "write_bench_plot",
    "write_load_plot",
    # the command
    "main",
]
