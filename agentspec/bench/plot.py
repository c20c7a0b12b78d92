"""PNG figures for ``agentspec bench`` results (needs matplotlib: ``pip install 'agentspec-llm[bench]'``).

- ``write_bench_plot``: agentspec's speedup over each peer per workload, and where its output
  tokens come from (accepted draft tokens by source, the rest from the target model).
- ``write_load_plot``: TPOT and aggregate tokens/s against concurrency, per system.

Every speed shown is a ratio or a curve measured in the same process as its baseline.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..types import DRAFT_SOURCES  # stacked in this order; sources it does not name follow
from .systems import PEERS

if TYPE_CHECKING:
    from .load import LoadRow
    from .single import BenchRow

__all__ = ["write_bench_plot", "write_load_plot"]

TARGET = "target (not drafted)"
_SYSTEM = "agentspec"


def _matplotlib() -> Any:
    """The ``matplotlib`` module, or an ImportError that says how to install it."""
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401  (Figure: no pyplot, so no global backend is switched)
    except ImportError as exc:
        raise ImportError(
            "agentspec.bench.plot needs matplotlib: pip install matplotlib (or pip install 'agentspec-llm[bench]')"
        ) from exc
    return matplotlib


def _save(fig: Any, path: str | Path) -> Path:
    """Save ``fig`` as a PNG at ``path`` (creating parent folders) and return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    return out


def _suptitle(title: str, text: str) -> str:
    return f"{text}\n{title}" if title else text


def _grouped_bars(ax: Any, workloads: list[str], series: list[str], value: Callable[[str, str], float | None],
                  colors: dict[str, Any], label: str, fmt: str) -> None:
    """Bars of ``value(workload, series)`` grouped by workload, skipping the absent (None) ones."""
    width = 0.8 / len(series)
    present = [[s for s in series if value(name, s) is not None] for name in workloads]
    for one in series:  # series-major, so the legend follows ``series``
        xs, ys = [], []
        for x, (name, here) in enumerate(zip(workloads, present)):
            if one in here:
                xs.append(x + (here.index(one) - (len(here) - 1) / 2) * width)
                ys.append(value(name, one))
        if xs:
            bars = ax.bar(xs, ys, width * 0.92, color=colors[one], label=label.format(one))
            ax.bar_label(bars, [fmt.format(y) for y in ys], padding=2, fontsize=7)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _speedup_panel(ax: Any, workloads: list[str], by_key: dict[tuple[str, str], BenchRow], colors: dict[str, Any]) -> None:
    """Grouped bars: agentspec tokens/s over each peer's, per workload (peers absent there are skipped)."""

    def ratio(name: str, peer: str) -> float | None:
        base = by_key.get((name, peer))
        return by_key[(name, _SYSTEM)].tokens_per_s / base.tokens_per_s if base and base.tokens_per_s > 0 else None

    _grouped_bars(ax, workloads, list(PEERS), ratio, colors, "× {}", "{:.2f}×")
    ax.set_ylabel("speedup (tokens/s ratio)")
    ax.set_title("agentspec speedup over each peer (same model, prompts and process)", fontsize=10)


def _sources_panel(ax: Any, workloads: list[str], by_key: dict[tuple[str, str], BenchRow], colors: dict[str, Any]) -> None:
    """Stacked bars: share of agentspec's output tokens accepted from each draft source, and the rest."""
    rows = [by_key[(name, _SYSTEM)] for name in workloads]
    seen = {s for row in rows for s in row.accepted_by_source}
    sources = [s for s in DRAFT_SOURCES if s in seen] + sorted(seen - set(DRAFT_SOURCES))
    bottoms = [0.0] * len(rows)
    for part in [*sources, TARGET]:
        shares = []
        for row in rows:
            drafted = sum(row.accepted_by_source.values())
            count = max(row.tokens - drafted, 0) if part == TARGET else row.accepted_by_source.get(part, 0)
            shares.append(100.0 * count / row.tokens if row.tokens else 0.0)
        ax.bar(range(len(rows)), shares, 0.6, bottom=bottoms, color=colors[part], label=part)
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    for x, (row, top) in enumerate(zip(rows, bottoms)):
        ax.annotate(f"accept {row.acceptance:.0%}\n{row.tokens} tok", (x, top), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 25))
    ax.set_ylabel("% of output tokens")
    ax.set_title("Where agentspec's output tokens come from (accept = accepted / drafted)", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, reverse=True)


def _per_source_panel(ax: Any, workloads: list[str], by_key: dict[tuple[str, str], BenchRow], systems: list[str],
                      colors: dict[str, Any]) -> None:
    """Grouped bars: tokens per target pass of each single-source system next to agentspec_plain and agentspec."""

    def per_pass(name: str, system: str) -> float | None:
        row = by_key.get((name, system))
        return row.tokens_per_pass if row else None

    _grouped_bars(ax, workloads, systems, per_pass, colors, "{}", "{:.1f}")
    ax.set_ylabel("tokens per target pass")
    ax.set_title("Tokens per target forward pass, by the draft sources allowed", fontsize=10)


def _colors(mpl: Any, rows: list[BenchRow], single: list[str]) -> dict[str, Any]:
    """One colour per peer and draft source; a single-source system takes its source's colour."""
    extra = sorted({s for r in rows for s in r.accepted_by_source} - set(DRAFT_SOURCES))
    tab10 = mpl.colormaps["tab10"].colors
    palette = [*tab10[:7], *tab10[8:], *mpl.colormaps["Dark2"].colors]  # grey is kept for the target
    colors: dict[str, Any] = dict(zip([*PEERS, *DRAFT_SOURCES, _SYSTEM, *extra], palette * 2))
    colors[TARGET] = "0.82"
    colors.update({system: colors.get(system[len(_SYSTEM) + 1:-1], "0.5") for system in single})
    return colors


def write_bench_plot(rows: list[BenchRow], path: str | Path, *, title: str = "") -> Path:
    """Write the ``agentspec bench`` figure (speedups, token sources, per-source rows if any) to ``path``."""
    workloads = list(dict.fromkeys(r.workload for r in rows if r.system == _SYSTEM))
    if not workloads:
        raise ValueError(f"no '{_SYSTEM}' rows to plot: run agentspec bench with the '{_SYSTEM}' system")
    mpl = _matplotlib()
    by_key = {(r.workload, r.system): r for r in rows}
    single = list(dict.fromkeys(r.system for r in rows if r.system.startswith(f"{_SYSTEM}[")))
    per_source = ["agentspec_plain", *single, _SYSTEM] if single else []
    colors = _colors(mpl, rows, single)

    panels = 3 if per_source else 2
    fig = mpl.figure.Figure(figsize=(max(8.0, 1.4 * len(workloads) + 4.0), 3.6 * panels), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True)
    _speedup_panel(axes[0], workloads, by_key, colors)
    _sources_panel(axes[1], workloads, by_key, colors)
    if per_source:
        _per_source_panel(axes[2], workloads, by_key, per_source, colors)
    rotate = len(workloads) > 4
    axes[-1].set_xticks(range(len(workloads)), workloads, rotation=20 if rotate else 0, ha="right" if rotate else "center")
    fig.suptitle(_suptitle(title, "agentspec bench: speed ratios measured in the same process"), fontsize=12)
    return _save(fig, path)


def write_load_plot(rows: list[LoadRow], path: str | Path, *, title: str = "") -> Path:
    """Write TPOT and aggregate tokens/s against concurrency, one line per system, to ``path``."""
    if not rows:
        raise ValueError("no load rows to plot: run agentspec bench with --concurrency")
    mpl = _matplotlib()
    systems = list(dict.fromkeys(r.system for r in rows))
    levels = sorted({r.concurrency for r in rows})
    fig = mpl.figure.Figure(figsize=(11.0, 4.2), layout="constrained")
    tpot, throughput = fig.subplots(1, 2)
    for system in systems:
        points = sorted((r for r in rows if r.system == system), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in points]
        tpot.plot(xs, [r.tpot_ms for r in points], marker="o", label=system)
        throughput.plot(xs, [r.tokens_per_s for r in points], marker="o", label=system)
    for ax, ylabel, heading in (
        (tpot, "TPOT (ms per output token)", "Time per output token (lower is better)"),
        (throughput, "aggregate tokens/s", "Aggregate throughput (higher is better)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
        ax.set_xlabel("requests in flight (concurrency)")
        ax.set_ylabel(ylabel)
        ax.set_title(heading, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_suptitle(title, "agentspec under load: systems measured in the same process"), fontsize=12)
    return _save(fig, path)
