"""Client-level aggregation of per-request ``SpecStats`` and its Prometheus exposition text."""

from __future__ import annotations

import threading

from .types import SpecStats

__all__ = ["MetricsAggregator"]

_COUNTERS = (
    "requests",
    "drafted_tokens",
    "accepted_tokens",
    "output_tokens",
    "target_forward_passes",
    "rollbacks",
    "fallback_steps",
    "draft_ms",
    "verify_ms",
)


class MetricsAggregator:
    """Sums request statistics (thread-safe: the worker adds, any thread reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = SpecStats()
        self._ttft_sum = 0.0
        self._tpot_sum = 0.0
        self._timed_requests = 0  # requests that produced a first token (the TTFT/TPOT means' base)

    def add(self, stats: SpecStats) -> None:
        with self._lock:
            total = self._total
            for name in _COUNTERS:
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            for source, count in stats.accepted_by_source.items():
                total.accepted_by_source[source] = total.accepted_by_source.get(source, 0) + count
            if stats.output_tokens:
                self._ttft_sum += stats.ttft_ms
                self._tpot_sum += stats.tpot_ms
                self._timed_requests += 1

    def snapshot(self) -> SpecStats:
        """Sums of the counters; rates recomputed from them; ttft/tpot as means over requests that
        produced at least one token."""
        with self._lock:
            total = self._total.model_copy(deep=True)
            ttft_sum, tpot_sum = self._ttft_sum, self._tpot_sum
        total.derive()
        total.ttft_ms = ttft_sum / timed if (timed := self._timed_requests) else 0.0
        total.tpot_ms = tpot_sum / timed if timed else 0.0
        return total

    def prometheus_text(self, prefix: str = "agentspec") -> str:
        """Prometheus text exposition format (version 0.0.4) of the aggregate."""
        stats = self.snapshot()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float, labels: str = "") -> None:
            full = f"{prefix}_{name}"
            if not any(line.startswith(f"# TYPE {full} ") for line in lines):
                lines.append(f"# HELP {full} {help_text}")
                lines.append(f"# TYPE {full} {kind}")
            lines.append(f"{full}{labels} {value:g}")

        metric("requests_total", "counter", "Finished requests.", stats.requests)
        metric("drafted_tokens_total", "counter", "Draft tokens verified by the target.", stats.drafted_tokens)
        metric("accepted_tokens_total", "counter", "Draft tokens accepted.", stats.accepted_tokens)
        for source, count in sorted(stats.accepted_by_source.items()):
            metric("accepted_tokens_by_source_total", "counter", "Accepted draft tokens by source.", count, f'{{source="{source}"}}')
        metric("output_tokens_total", "counter", "Generated tokens.", stats.output_tokens)
        metric("target_forward_passes_total", "counter", "Target model passes.", stats.target_forward_passes)
        metric("target_forward_passes_saved_total", "counter", "Output tokens minus target passes.", stats.target_forward_passes_saved)
        metric("rollbacks_total", "counter", "Steps that rejected part of a draft.", stats.rollbacks)
        metric("fallback_steps_total", "counter", "Steps decoded plainly although a draft existed.", stats.fallback_steps)
        metric("draft_seconds_total", "counter", "Time spent drafting.", stats.draft_ms / 1e3)
        metric("verify_seconds_total", "counter", "Time spent in target passes and verification.", stats.verify_ms / 1e3)
        metric("acceptance_rate", "gauge", "Accepted over drafted tokens.", stats.acceptance_rate)
        metric("ttft_seconds_mean", "gauge", "Mean time to first token.", stats.ttft_ms / 1e3)
        metric("tpot_seconds_mean", "gauge", "Mean time per output token after the first.", stats.tpot_ms / 1e3)
        return "\n".join(lines) + "\n"
