"""The target pass in numbers, for ``agentspec bench``: which pass runs and why, what a pass of one
position and of a verification's eight costs, and the bandwidth a one-position pass streams its
weights at against what this machine reads (``read_bandwidth``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PassReport", "pass_report", "read_bandwidth", "weight_bytes", "until_calibrated"]

POSITIONS = (1, 8)  # a plain step, and a verification of 7 drafted tokens
READ_BYTES = 2**29  # the buffer read_bandwidth sums (512 MiB): far larger than any cache
READ_REPEATS = 5


def weight_bytes(forward: Any) -> int | None:
    """Bytes of weights a one-position pass of ``forward`` reads — every decoder product's layout and
    the LM head's, as the kernels stream them (``BlockProduct.nbytes``) — or None where a product is
    not on the file's blocks (transformers' or oneDNN's weights: not counted here)."""
    layers = getattr(forward, "layers", None)
    if not layers:
        return None
    products = [product for layer in layers for product in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    products.append(getattr(forward, "head", None))
    sizes = [getattr(product, "nbytes", None) for product in products]
    return None if any(size is None for size in sizes) else sum(sizes)


def read_bandwidth() -> float:
    """This machine's read bandwidth in bytes/s, as ``torch.sum`` of a 512 MiB float32 buffer reaches
    it on torch's threads (the passes' own), best of 5 after a first touch."""
    buffer = torch.ones(READ_BYTES // 4)
    best = float("inf")
    for _ in range(READ_REPEATS):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return READ_BYTES / best


@dataclass(frozen=True)
class PassReport:
    name: str
    reason: str
    isa: str | None
    ms: dict[int, float]  # a pass's cost by positions (the engine's measurements: calibrated, then live)
    weight_bytes: int | None
    read_bytes_per_s: float
    threads: int
    estimated: tuple[int, ...] = ()  # shapes of ``ms`` the engine has not measured (a pass of LONG_PASS_MS or more is not calibrated)

    def lines(self) -> list[str]:
        kernels = f" on {self.isa} kernels" if self.isa else ""
        one, eight = (self.ms[p] for p in POSITIONS)
        shown = [f"{self.ms[p]:.2f} ms" + (" (not measured: the engine's estimate)" if p in self.estimated else "") for p in POSITIONS]
        lines = [
            f"pass {self.name}{kernels}: {self.reason}",
            f"pass of 1 position {shown[0]}, of 8 positions {shown[1]} ({eight / one:.2f}x)",
        ]
        read = f"this machine reads {self.read_bytes_per_s / 1e9:.1f} GB/s (torch.sum of 512 MiB, {self.threads} threads, best of {READ_REPEATS})"
        if self.weight_bytes is None:
            lines.append(f"weights a token: not all on the file's blocks, so not counted; {read}")
        else:
            reached = self.weight_bytes / (one / 1e3)
            lines.append(
                f"weights a token {self.weight_bytes / 2**20:.0f} MiB: 1 position streams them at {reached / 1e9:.1f} GB/s, "
                f"{reached / self.read_bytes_per_s:.0%} of what {read}"
            )
        return lines


async def until_calibrated(client: Any, timeout_s: float = 120.0) -> None:
    """Wait until a local client's engine has measured the pass shapes its start-up left for idle
    time (``Engine.calibrate(idle=True)``): what is timed after runs on a worker with nothing else to do,
    and the pass costs reported are measured, not estimated."""
    engine = getattr(client, "engine", None)
    deadline = time.monotonic() + timeout_s
    while engine is not None and engine.calibrating and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def pass_report(client: Any) -> PassReport:
    """The report of ``client``'s target pass (a local client, started). Blocking: it reads 512 MiB five times."""
    engine = client.engine
    weights = engine.weights
    return PassReport(
        weights.name, weights.reason, weights.isa, {p: engine.costs.cost(p) for p in POSITIONS}, weight_bytes(engine.forward),
        read_bandwidth(), torch.get_num_threads(), tuple(p for p in POSITIONS if not engine.costs.measured(p)),
    )
