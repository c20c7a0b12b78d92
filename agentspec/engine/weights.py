"""How the target pass multiplies by its weights: transformers' own linear layers, or oneDNN's.

A pass of a small model is its linear layers: on a CPU they are most of its time, and a verification
pass of K+1 positions is worth running only if it costs little more than one position. transformers'
``nn.Linear`` calls MKL's sgemm, which re-packs the whole weight matrix on every call: cheap next to
a big matrix product, ruinous next to a product with 1–16 rows (measured on a 2-core AVX2 EPYC, all
linear layers of the default model: 51/77/113/138/173 ms for 1/2/4/8/16 rows). oneDNN can take the
weights packed once, in its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``): 44/44/50/64/
97 ms for the same rows. Its packed product is also row-invariant — a row's result does not depend on
how many rows share the call or where it sits (bit for bit, 1–32 rows; MKL's differs by ~5e-5) —
which is what verification wants of a kernel.

``Weights`` names the choice; ``select_weights`` makes it: ``"eager"`` is the model as loaded,
``"onednn"`` a copy of its module tree whose linear layers hold oneDNN-packed weights (the loaded
model is shared and stays untouched: ``generate``, draft models and benchmarks' baselines use it),
and ``"auto"`` measures both on this machine at start-up and keeps the faster. The copy shares every
other parameter; the packed weights are extra memory (the model's linear weights once more, 540 MB
for the default model in float32).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .kv import KVBlock, KVLayout
from .packed import PackedRow, forward_packed

__all__ = ["WEIGHTS", "Weights", "SelectedWeights", "OneDNNLinear", "onednn_supported", "with_onednn_linears", "select_weights"]

log = logging.getLogger("agentspec.engine")

Weights = Literal["auto", "eager", "onednn"]
WEIGHTS: tuple[str, ...] = ("auto", "eager", "onednn")

# oneDNN picks its packed layout for an expected number of rows; 8 is a verification pass. The layout
# (not the rows of a call) fixes the reduction order, so every pass shape gets the same sums.
BATCH_HINT = 8
# A packed copy must give the loaded model's logits up to summation order (float32).
AGREEMENT = 1e-3


class OneDNNLinear(nn.Module):
    """``nn.Linear`` with its weight packed once into oneDNN's layout (CPU, float32). ``weight`` stays
    the original parameter (shared, not copied) for code that reads its shape, dtype or device."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_supported(model: Any) -> str | None:
    """Why ``model`` cannot take oneDNN-packed linear layers here, or None when it can."""
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu":
        return f"oneDNN packing is a CPU path (the model is on {weight.device})"
    if weight.dtype != torch.float32:
        return f"oneDNN packing here is for float32 weights (the model is {weight.dtype})"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build has no oneDNN (mkldnn) linear kernels"
    return None


def with_onednn_linears(model: Any) -> Any:
    """A copy of ``model``'s module tree sharing its parameters, every ``nn.Linear`` packed for oneDNN
    (the output layer too, tied to the embeddings or not). ``model`` itself is unchanged."""
    reason = onednn_supported(model)
    if reason is not None:
        raise NotImplementedError(reason)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    fast = copy.deepcopy(model, memo=shared)
    for module in list(fast.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, OneDNNLinear(child))
    return fast.eval()


@dataclass(frozen=True)
class SelectedWeights:
    """The model a target pass runs (``model``), which weights it holds, and why."""

    name: Literal["eager", "onednn"]
    model: Any
    reason: str
    timings_ms: dict[str, tuple[float, ...]]  # per candidate: pass times at MEASURED_POSITIONS (auto only)


MEASURED_POSITIONS = (1, 8)  # one plain token and a typical verification
_selected: "weakref.WeakKeyDictionary[Any, dict[str, SelectedWeights]]" = weakref.WeakKeyDictionary()
_selected_lock = threading.Lock()


def _pass_ms(model: Any, layout: KVLayout, positions: int, repeats: int = 3, context: int = 64) -> float:
    block = KVBlock(layout)
    forward_packed(model, [PackedRow(block, list(range(100, 100 + context)), 1)])
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        forward_packed(model, [PackedRow(block, [100] * positions, 1)])
        timings.append((time.perf_counter() - started) * 1e3)
        block.length -= positions
    return min(timings)


def _disagreement(model: Any, other: Any, layout: KVLayout) -> float:
    tokens = list(range(200, 240))
    logits = [forward_packed(m, [PackedRow(KVBlock(layout), tokens, 8)])[0] for m in (model, other)]
    return (logits[0] - logits[1]).abs().max().item()


@torch.inference_mode()
def select_weights(model: Any, layout: KVLayout, requested: str = "auto") -> SelectedWeights:
    """The weights a target pass of ``model`` should run with: ``requested``, or for ``"auto"`` the
    faster of the candidates measured here (1- and 8-position passes). Decided once per model and
    request, shared by every engine of that model. Raises ``ValueError`` for a name not in WEIGHTS
    and ``NotImplementedError`` for ``"onednn"`` where it cannot run."""
    if requested not in WEIGHTS:
        raise ValueError(f"Unknown weights {requested!r}; use one of {', '.join(WEIGHTS)}.")
    with _selected_lock:
        chosen = _selected.setdefault(model, {})
        if requested not in chosen:
            chosen[requested] = _select(model, layout, requested)
        return chosen[requested]


def _select(model: Any, layout: KVLayout, requested: str) -> SelectedWeights:
    if requested == "eager":
        return SelectedWeights("eager", model, "requested", {})
    unsupported = onednn_supported(model)
    if requested == "onednn":
        if unsupported is not None:
            raise NotImplementedError(unsupported)
        return SelectedWeights("onednn", with_onednn_linears(model), "requested", {})
    if unsupported is not None:
        return SelectedWeights("eager", model, unsupported, {})
    fast = with_onednn_linears(model)
    difference = _disagreement(model, fast, layout)
    if not difference <= AGREEMENT:
        return SelectedWeights("eager", model, f"oneDNN's logits differ from the model's by {difference:.3g}", {})
    timings = {
        name: tuple(_pass_ms(candidate, layout, positions) for positions in MEASURED_POSITIONS)
        for name, candidate in (("eager", model), ("onednn", fast))
    }
    faster = sum(timings["onednn"]) < sum(timings["eager"])
    shown = ", ".join(f"{name} {'/'.join(f'{ms:.1f}' for ms in t)} ms" for name, t in timings.items())
    reason = f"measured passes of {'/'.join(map(str, MEASURED_POSITIONS))} positions: {shown}"
    log.info("target weights: %s (%s)", "onednn" if faster else "eager", reason)
    return SelectedWeights("onednn", fast, reason, timings) if faster else SelectedWeights("eager", model, reason, timings)
