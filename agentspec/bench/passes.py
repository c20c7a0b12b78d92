"""The target pass in numbers, for ``agentspec bench``: which pass runs and why, what a pass of one
position and of a verification's eight costs, and the bandwidth a one-position pass streams its
weights at against what this machine reads (``read_bandwidth``) — the passes and the reading timed
in turn, so that the ratio compares what one machine did in the same seconds (a VM's bandwidth moved
between 30 and 55 GB/s from one minute to the next on a 2-core Zen 4)."""

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
# After a reading, torch's OpenMP threads spin-wait for their next job (libgomp's GOMP_SPINCOUNT) on
# the cores the kernels' threads need: a pass timed straight after one took 1.4x as long (passes/threads.py)
READ_SETTLE_S = 0.05


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


def _read_seconds(buffer: torch.Tensor) -> float:
    """One reading of ``buffer`` (``torch.sum`` on torch's threads), in seconds."""
    started = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - started


def read_bandwidth() -> float:
    """This machine's read bandwidth in bytes/s, as ``torch.sum`` of a 512 MiB float32 buffer reaches
    it on torch's threads (the passes' own), best of 5 after a first touch."""
    buffer = torch.ones(READ_BYTES // 4)
    return READ_BYTES / min(_read_seconds(buffer) for _ in range(READ_REPEATS))


@dataclass(frozen=True)
class PassReport:
    name: str
    reason: str
    isa: str | None
    ms: dict[int, float]  # a pass's cost by positions, best of READ_REPEATS (timed in turn with the reading)
    weight_bytes: int | None
    read_bytes_per_s: float
    threads: int

    def lines(self) -> list[str]:
        kernels = f" on {self.isa} kernels" if self.isa else ""
        one, eight = (self.ms[p] for p in POSITIONS)
        lines = [
            f"pass {self.name}{kernels}: {self.reason}",
            f"pass of 1 position {one:.2f} ms, of 8 positions {eight:.2f} ms ({eight / one:.2f}x)",
        ]
        read = (
            f"this machine reads {self.read_bytes_per_s / 1e9:.1f} GB/s (torch.sum of 512 MiB, {self.threads} threads; "
            f"passes and reading in turn, best of {READ_REPEATS} each)"
        )
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
    time (``Engine.calibrate(idle=True)``): what is timed after runs on a worker with nothing else to do."""
    engine = getattr(client, "engine", None)
    deadline = time.monotonic() + timeout_s
    while engine is not None and engine.calibrating and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def pass_report(client: Any) -> PassReport:
    """The report of ``client``'s target pass (a local client, started). Blocking, on the engine's
    thread between steps: ``await client.run_on_worker(lambda: pass_report(client))``. Each round
    times a pass of each of ``POSITIONS`` (``Engine.time_pass``, over calibration's past) and one
    reading of 512 MiB; the report keeps the fastest of ``READ_REPEATS`` rounds of each."""
    engine = client.engine
    buffer = torch.ones(READ_BYTES // 4)  # (written: its pages are there before the first reading)
    ms = {p: float("inf") for p in POSITIONS}
    read_s = float("inf")
    for _ in range(READ_REPEATS):
        for p in POSITIONS:
            ms[p] = min(ms[p], engine.time_pass(p))
        read_s = min(read_s, _read_seconds(buffer))
        time.sleep(READ_SETTLE_S)
    weights = engine.weights
    return PassReport(weights.name, weights.reason, weights.isa, ms, weight_bytes(engine.forward), READ_BYTES / read_s, torch.get_num_threads())
