"""Observability: client-level aggregates of per-request ``SpecStats`` (overall and per request
``tag``), their Prometheus exposition text, and one structured log line per request.

Logging: the ``agentspec.requests`` logger writes one INFO line per finished request, as
``key=value`` pairs, and passes the same fields as ``extra={"agentspec": {...}}`` for structured
handlers. A shadow check that disagrees with its plain decoding is logged at ERROR by
``agentspec.client`` with the request id.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Iterable

from .types import SpecStats

if TYPE_CHECKING:
    from .engine import Sequence

__all__ = ["MetricsAggregator", "log_request", "OTHER_TAG"]

request_log = logging.getLogger("agentspec.requests")
log = logging.getLogger("agentspec.metrics")

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
    "cached_prompt_tokens",
    "shadow_checks",
    "quality_diff_sampled",
)


class _Totals:
    """Summed counters of a set of requests, and the sums behind the TTFT/TPOT means."""

    def __init__(self) -> None:
        self.stats = SpecStats()
        self.ttft_sum: float | None = 0.0
        self.tpot_sum: float | None = 0.0
        self.timed = 0  # requests that produced a first token (the means' base)

    def add(self, stats: SpecStats) -> None:
        total = self.stats
        for name in _COUNTERS:
            mine, theirs = getattr(total, name), getattr(stats, name)
            setattr(total, name, None if mine is None or theirs is None else mine + theirs)  # unknown stays unknown
        for source, count in stats.accepted_by_source.items():
            total.accepted_by_source[source] = total.accepted_by_source.get(source, 0) + count
        if stats.output_tokens:
            self.ttft_sum = _plus(self.ttft_sum, stats.ttft_ms)
            self.tpot_sum = _plus(self.tpot_sum, stats.tpot_ms)
            self.timed += 1

    def snapshot(self) -> SpecStats:
        total = self.stats.model_copy(deep=True).derive()
        total.ttft_ms = None if self.ttft_sum is None else (self.ttft_sum / self.timed if self.timed else 0.0)
        total.tpot_ms = None if self.tpot_sum is None else (self.tpot_sum / self.timed if self.timed else 0.0)
        return total


def _plus(total: float | None, value: float | None) -> float | None:
    return None if total is None or value is None else total + value


def sum_stats(items: Iterable[SpecStats]) -> SpecStats:
    """The aggregate of these requests' statistics, as ``Client.metrics()`` reports a client's."""
    totals = _Totals()
    for stats in items:
        totals.add(stats)
    return totals.snapshot()


OTHER_TAG = "(other)"  # not a valid request tag, so it never mixes with one


class MetricsAggregator:
    """Sums request statistics, overall and per tag (thread-safe: the worker adds, any thread reads).

    Tags are chosen by callers, so their number is bounded: the first ``max_tags`` distinct tags get
    series of their own and every later one is counted under ``OTHER_TAG`` (said once in the log).
    Without the bound each new tag would keep memory forever and make ``/metrics`` slower to render.
    """

    def __init__(self, max_tags: int = 64) -> None:
        self._lock = threading.Lock()
        self._all = _Totals()
        self._tags: dict[str, _Totals] = {}
        self.max_tags = max_tags
        self._overflowed = False

    def add(self, stats: SpecStats, tag: str | None = None) -> None:
        with self._lock:
            for totals in self._targets(tag):
                totals.add(stats)

    def add_shadow(self, agreed: bool, tag: str | None = None) -> None:
        """Count one shadow check (a plain re-decode of a finished request, with its seed if sampled)."""
        check = SpecStats(shadow_checks=1, quality_diff_sampled=int(not agreed))
        self.add(check, tag)

    def _targets(self, tag: str | None) -> list[_Totals]:
        if tag is None:
            return [self._all]
        if tag not in self._tags and len(self._tags.keys() - {OTHER_TAG}) >= self.max_tags:
            if not self._overflowed:
                self._overflowed = True
                log.warning(
                    "more than %d distinct request tags: tag %r and later new tags are counted under tag=%r "
                    "(raise Limits.max_tags, agentspec serve --max-tags, to give them series of their own)",
                    self.max_tags, tag, OTHER_TAG,
                )
            tag = OTHER_TAG
        return [self._all, self._tags.setdefault(tag, _Totals())]

    def snapshot(self, tag: str | None = None) -> SpecStats:
        """Sums of the counters; rates recomputed from them; ttft/tpot as means over requests that
        produced at least one token. ``tag``: only the requests sent with that tag."""
        with self._lock:
            totals = self._all if tag is None else self._tags.get(tag)
            return totals.snapshot() if totals is not None else SpecStats()

    def tags(self) -> list[str]:
        with self._lock:
            return sorted(self._tags)

    def prometheus_text(self, prefix: str = "agentspec") -> str:
        """Prometheus text exposition format (version 0.0.4): the aggregate as unlabelled series,
        and the same metrics per traffic class as ``{prefix}_tag_*{tag="..."}`` series."""
        lines: list[str] = []
        _render(lines, prefix, self.snapshot(), "")
        for tag in self.tags():
            _render(lines, f"{prefix}_tag", self.snapshot(tag), f'tag="{tag}"')
        return "\n".join(lines) + "\n"


def _render(lines: list[str], prefix: str, stats: SpecStats, label: str) -> None:
    def metric(name: str, kind: str, help_text: str, value: float | None, extra: str = "") -> None:
        if value is None:  # not known (a remote server that does not report it): no series
            return
        full = f"{prefix}_{name}"
        if not any(line.startswith(f"# TYPE {full} ") for line in lines):
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
        labels = ",".join(part for part in (label, extra) if part)
        lines.append(f"{full}{{{labels}}} {value:g}" if labels else f"{full} {value:g}")

    metric("requests_total", "counter", "Finished requests.", stats.requests)
    metric("drafted_tokens_total", "counter", "Draft tokens verified by the target.", stats.drafted_tokens)
    metric("accepted_tokens_total", "counter", "Draft tokens accepted.", stats.accepted_tokens)
    for source, count in sorted(stats.accepted_by_source.items()):
        metric("accepted_tokens_by_source_total", "counter", "Accepted draft tokens by source.", count, f'source="{source}"')
    metric("output_tokens_total", "counter", "Generated tokens.", stats.output_tokens)
    metric("target_forward_passes_total", "counter", "Target model passes.", stats.target_forward_passes)
    metric("target_forward_passes_saved_total", "counter", "Output tokens minus target passes.", stats.target_forward_passes_saved)
    metric("rollbacks_total", "counter", "Steps that rejected part of a draft.", stats.rollbacks)
    metric("fallback_steps_total", "counter", "Steps decoded plainly although a draft existed.", stats.fallback_steps)
    metric("draft_seconds_total", "counter", "Time spent drafting.", _seconds(stats.draft_ms))
    metric("verify_seconds_total", "counter", "Time spent in target passes and verification.", _seconds(stats.verify_ms))
    metric("cached_prompt_tokens_total", "counter", "Prompt tokens reused from the prefix cache, not prefilled.", stats.cached_prompt_tokens)
    metric("shadow_checks_total", "counter", "Requests re-decoded plainly by shadow sampling.", stats.shadow_checks)
    metric("quality_diff_sampled_total", "counter", "Shadow checks that disagreed with plain decoding (bugs).", stats.quality_diff_sampled)
    metric("acceptance_rate", "gauge", "Accepted over drafted tokens.", stats.acceptance_rate)
    metric("ttft_seconds_mean", "gauge", "Mean time to first token.", _seconds(stats.ttft_ms))
    metric("tpot_seconds_mean", "gauge", "Mean time per output token after the first.", _seconds(stats.tpot_ms))


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def log_request(seq: Sequence) -> None:
    """One structured INFO line for a finished request (``agentspec.requests``)."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    stats = seq.stats
    fields: dict[str, Any] = {
        "request_id": seq.request_id,
        "tag": seq.params.tag or "-",
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "output_tokens": stats.output_tokens,
        "target_passes": stats.target_forward_passes,
        "acceptance": round(stats.acceptance_rate, 3),
        "accepted_by_source": ",".join(f"{k}:{v}" for k, v in sorted(stats.accepted_by_source.items())) or "-",
        "rollbacks": stats.rollbacks,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "ttft_ms": round(stats.ttft_ms, 1),
        "tpot_ms": round(stats.tpot_ms, 1),
        "speculative": seq.params.spec.enabled,
        "seed": "-" if seq.params.seed is None else seq.params.seed,  # sampled requests: always set
    }
    request_log.info(" ".join(f"{k}={v}" for k, v in fields.items()), extra={"agentspec": fields})
