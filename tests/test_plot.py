"""``agentspec.bench.plot`` writes readable PNGs from synthetic bench rows (no model is loaded)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

import matplotlib  # noqa: F401  (the bench extra, which `make` installs: fail here, not skip, without it)
from agentspec.bench import BenchRow, LoadRow
from agentspec.bench.plot import write_bench_plot, write_load_plot


def row(workload: str, system: str, tokens_per_s: float, **extra) -> BenchRow:
    tokens = extra.pop("tokens", 128)
    extra.setdefault("tokens_per_pass", 1.0)  # one token per target pass unless drafted
    return BenchRow(workload, system, tokens, tokens / tokens_per_s, tokens_per_s, tokens, True, **extra)


def bench_rows(per_source: bool = False) -> list[BenchRow]:
    rows = []
    for name, speed, sources in (
        ("document_answer", 95.0, {"ngram": 40, "suffix": 30}),
        ("code_edit", 120.0, {"ngram": 70, "suffix": 10, "model": 5}),
        ("chat", 40.0, {"model": 12}),
    ):
        rows += [row(name, "hf_plain", 30.0), row(name, "hf_prompt_lookup", 45.0), row(name, "agentspec_plain", 32.0)]
        rows.append(row(name, "agentspec", speed, acceptance=0.7, tokens_per_pass=2.4, accepted_by_source=sources))
    rows += [  # constrained: no hf_* rows, an outlines peer
        row("tool_call", "outlines", 20.0, tokens=64),
        row("tool_call", "agentspec_plain", 28.0, tokens=64),
        row("tool_call", "agentspec", 150.0, tokens=64, acceptance=0.9, tokens_per_pass=4.1,
            accepted_by_source={"grammar": 40, "ngram": 8}),
    ]
    if per_source:
        for name in ("document_answer", "code_edit", "chat", "tool_call"):
            for i, source in enumerate(("grammar", "ngram", "suffix", "model")):
                rows.append(row(name, f"agentspec[{source}]", 50.0 + 10 * i, tokens_per_pass=1.2 + 0.4 * i))
    return rows


def load_rows() -> list[LoadRow]:
    return [
        LoadRow(n, system, 4 * n, 256 * n, 2.0, rate * n ** 0.7, 40.0, tpot + 2 * n, pass_tokens)
        for n in (1, 2, 4, 8)
        for system, rate, tpot, pass_tokens in (("agentspec_plain", 30.0, 30.0, 1.0), ("agentspec", 70.0, 12.0, 2.5))
    ]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert len(data) > 10_000
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("per_source", [False, True])
def test_bench_plot(tmp_path, per_source):
    out = write_bench_plot(bench_rows(per_source), tmp_path / "figs" / "bench.png", title="Qwen2.5-0.5B")
    assert out == tmp_path / "figs" / "bench.png"
    width, height = png_size(out)
    assert 800 <= width <= 3000 and 600 <= height <= 3000
    assert (height > 1200) == per_source  # the per-source panel adds a third row


def test_load_plot(tmp_path):
    out = write_load_plot(load_rows(), str(tmp_path / "load.png"), title="Qwen2.5-0.5B")
    width, height = png_size(out)
    assert 800 <= width <= 3000 and 300 <= height <= 1500 and width > height


def test_bench_plot_needs_agentspec_rows(tmp_path):
    rows = [r for r in bench_rows() if r.system != "agentspec"]
    with pytest.raises(ValueError, match="no 'agentspec' rows"):
        write_bench_plot(rows, tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()


def test_load_plot_needs_rows(tmp_path):
    with pytest.raises(ValueError, match="no load rows"):
        write_load_plot([], tmp_path / "load.png")


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        write_load_plot(load_rows(), tmp_path / "load.png")
