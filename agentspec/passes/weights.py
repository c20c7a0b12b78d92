"""Which target pass an engine runs, chosen by measurement: transformers' modules, or faster ones.

A pass of a small model is mostly its linear layers, and a verification pass of K+1 positions is
worth running only if it costs little more than one position. transformers' ``nn.Linear`` calls
MKL's sgemm, which re-packs the whole weight matrix on every call: cheap next to a big matrix
product, ruinous next to one of 1–16 rows. oneDNN takes the weights packed once, in its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``), and its packed product is row-invariant — a
row's result does not depend on how many rows share the call or where it sits — which is what
verification wants of a kernel.

The candidates (``CANDIDATES``):
- ``"eager"``: ``forward_packed`` over the model as loaded (any architecture, device, dtype).
- ``"onednn"``: the same over a copy of the model's module tree whose linear layers hold
  oneDNN-packed weights (any architecture; CPU, float32).
- ``"fused"``: ``FusedPass`` (``fused.py``), agentspec's own pass for the families of ``arch.py``,
  on oneDNN-packed weights where they run, else ``F.linear``.
- ``"gguf"``: the fused pass on the blocks of the GGUF file the model was read from (``blocks.py``, ``products.py``;
  a CPU with AVX2, AVX-512 or NEON's dot product, and a C compiler): the same float32 weights in a
  fraction of the bytes per token. The kernels are built for the CPU's instruction-set level and
  give the same bits on every level (``levels.LEVELS``).
- ``"gguf-q16"``: the ``"gguf"`` pass on rows rounded to 16 bits per block of 32 (below: it is in
  ``REDUCED`` too, the one arithmetic ``"auto"`` may pick that is not the loaded model's own).
- ``"static"``: the fused pass over a key/value pool allocated once, one attention call per layer
  for the whole pass, CUDA graphs per pass shape (``static.py``). A GPU pass: ``"auto"`` considers
  it on CUDA only; on a CPU it runs (eagerly) when asked for by name.

``select_weights(..., "auto")`` on a GGUF file where the block kernels run takes a pass by rule
(``GGUF_RULE``: gguf-q16, else gguf — the first that builds; its agreement with the model is
checked by the tests, not at start-up) and builds nothing else, so the same file on the same CPU gets the same pass and the same text on every run.
Elsewhere it builds those that can run here, keeps those whose logits agree with the model's
(float32 rounding; gguf-q16 within ``NEAR_TOLERANCE``), times each on 1- and 8-position passes, and
keeps the fastest. ``SelectedWeights.reason`` records the rule or the timings it chose by.

Reduced precision (``REDUCED``): another model's logits. Asked for by name, but for gguf-q16. On
every pass, speculative decoding equals plain decoding on that pass, token for token
(``tests/test_weights.py``); what differs is plain decoding itself.
- ``"bf16"``: the fused pass with its linear weights rounded to bfloat16 and packed for oneDNN (CPUs
  with AVX-512; half the bytes a token streams). Activations, norms, attention and the cache stay
  float32; each product takes its input rounded to bfloat16 and accumulates in float32.
- ``"gguf-q8"``: the ``"gguf"`` pass with each product's input rows quantised to 8 bits per block
  of 32 (a scale per block, as llama.cpp multiplies these blocks), multiplied by the file's own
  codes with exact integer dot products (``blocks.c``: vpdpbusd where the CPU has VNNI, vpmaddwd
  elsewhere; the same bits). The weights are the file's; the activations are rounded, visibly:
  on the repository's extraction example it names another company than the float32 pass copies
  from the e-mail, so it is never the default.
- ``"gguf-q16"``: the same with the rows quantised to 16 bits per block of 32 (exact integer dot
  products: two planes of bytes with VNNI, 16-bit integers without), a 256th of gguf-q8's rounding,
  with values cached as float16, as llama.cpp caches them, and keys too unless the model's key
  biases are large (``BlockPass.kv_dtypes``: Qwen2's keep float32 keys).
  The integer products take a fraction of the float multiply-adds' instructions, so a pass of several
  positions costs less, and its logits stay within ``NEAR_TOLERANCE`` of the loaded model's: not a
  visible change of model, but greedy decoding can part from float32 decoding where two tokens are
  nearly tied. ``weights="gguf"`` is the loaded model's own float32 arithmetic.

The loaded model is shared and stays untouched (``generate``, draft models on transformers' modules
and the bench's baselines use it); the faster passes hold a second copy of the linear weights. A
GGUF draft model takes its pass here as a target does, and an early exit cuts the target's
(``FusedPass.first_layers``). What each pass measured, and on
which machine: docs/how-it-works.md and docs/kernels.md.
"""
from __future__ import annotations

import copy
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.kv import KVBlock, KVLayout
from ..errors import ModelLoadError
from ..gguf.modules import weights_on_meta
from .blocks import BlockPass
from .layouts import Blocks
from .products import GGUFBlocks, blocks_unsupported, read_blocks
from .fused import FusedPass, fused_unsupported
from .packed import PackedRow, PassFunction, check_packed, forward_packed, use_packed_attention
from .static import StaticPass

__all__ = [
    "WEIGHTS", "CANDIDATES", "GPU_CANDIDATES", "REDUCED", "NEAR", "NEAR_TOLERANCE", "GGUF_ACTIVATIONS", "SelectedWeights",
    "OneDNNLinear", "onednn_supported", "bf16_supported", "with_onednn_linears", "onednn_linear", "torch_linear", "select_weights",
    "fastest_pass_ms", "pass_layout", "GGUF_RULE",
]

log = logging.getLogger("agentspec.engine")

# "auto" picks among them: the loaded model's logits, or (gguf-q16) within NEAR_TOLERANCE of them
CANDIDATES: tuple[str, ...] = ("eager", "onednn", "fused", "gguf", "gguf-q16", "static")
GPU_CANDIDATES: tuple[str, ...] = ("static",)  # "auto" considers them on CUDA only
# Not the loaded model's float32 arithmetic (rounded weights or activations): another model's logits,
# checked against the loaded model's within their tolerance (REDUCED_TOLERANCE, or NEAR_TOLERANCE);
# speculative decoding on them equals plain decoding on them, like every pass. Comparisons with
# transformers' float32 decoding (the bench's, the tests') take "gguf" instead. Asked for by name,
# except those in CANDIDATES.
REDUCED: tuple[str, ...] = ("bf16", "gguf-q8", "gguf-q16")
WEIGHTS: tuple[str, ...] = ("auto", *CANDIDATES, *(name for name in REDUCED if name not in CANDIDATES))
# bfloat16 weights move the default model's logits by up to ~0.9 on real text (0.2 on check_packed's)
REDUCED_TOLERANCE = 2.0
# 16-bit activations: up to 0.013 on real text, 0.0054 on check_packed's (float32's own: 4e-5)
NEAR = ("gguf-q16",)
NEAR_TOLERANCE = 0.05

# The passes on the GGUF file's blocks, and what each multiplies them by (layouts.ACTIVATIONS)
GGUF_ACTIVATIONS = {"gguf": "float32", "gguf-q8": "q8", "gguf-q16": "q16"}

# oneDNN picks its packed layout for an expected number of rows; 8 is a verification pass. The layout
# (not the rows of a call) fixes the reduction order, so every pass shape gets the same sums.
BATCH_HINT = 8


class OneDNNLinear(nn.Module):
    """``nn.Linear`` with its weight packed once into oneDNN's layout (CPU, float32). ``weight`` stays
    the original parameter (shared, not copied) for code that reads its shape, dtype or device."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._product = onednn_linear(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x.reshape(-1, self.in_features))
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_supported(model: Any) -> str | None:
    """Why ``model`` cannot take oneDNN-packed linear layers here, or None when it can."""
    weight = model.get_output_embeddings().weight
    if weight.device.type not in ("cpu", "meta"):  # meta: a GGUF file's module tree, its float tensors on the CPU
        return f"oneDNN packing is a CPU path (the model is on {weight.device})"
    if weight.dtype != torch.float32:
        return f"oneDNN packing here is for float32 weights (the model is {weight.dtype})"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build has no oneDNN (mkldnn) linear kernels"
    return None


def bf16_supported(model: Any) -> str | None:
    """Why ``model`` cannot run on oneDNN-packed bfloat16 weights here (``"bf16"``), or None when it can."""
    reason = onednn_supported(model)
    if reason is not None:
        return reason
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 instructions oneDNN uses (AVX-512)"
    try:
        onednn_linear(torch.zeros(16, 16), torch.bfloat16)(torch.zeros(2, 16))
    except RuntimeError as exc:  # e.g. "needs avx_ne_convert or avx512bw/vl/dq"
        return f"oneDNN cannot pack bfloat16 weights here ({str(exc).splitlines()[0]})"
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


def _stacked(weight: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """One weight, or several stacked along their outputs (one product for q, k and v)."""
    return weight.detach() if isinstance(weight, torch.Tensor) else torch.cat([w.detach() for w in weight])


def onednn_linear(weight: torch.Tensor | Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x @ weight.T`` ([rows, in] → [rows, out]) on a oneDNN-packed copy of ``weight`` (or of
    several weights stacked along their outputs); with
    ``dtype`` (bfloat16), on the weight and input rounded to it, the result back in ``x``'s dtype.

    A lone row runs as two (itself twice): on AVX-512 CPUs oneDNN computes a 1-row product with
    another reduction order than a product of 2 or more rows (measured here for 1536 inputs: the
    MLP's down projection), so without this a plain step and a verification would round a row
    differently. From 2 rows on the result of a row depends neither on how many share the call nor
    on its place (``tests/test_weights.py``); the second row costs next to nothing."""
    weight = _stacked(weight) if dtype is None else _stacked(weight).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)

    def product(x: torch.Tensor) -> torch.Tensor:
        rows = x.to(weight.dtype)
        if x.shape[0] == 1:
            rows = rows.expand(2, -1).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
        return (out[:1] if x.shape[0] == 1 else out).to(x.dtype)

    return product


def torch_linear(weight: torch.Tensor | Sequence[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x @ weight.T`` with ``F.linear`` (any device and dtype); several weights stack along their outputs."""
    weight = _stacked(weight)
    return lambda x: F.linear(x, weight)


@dataclass(frozen=True)
class SelectedWeights:
    """The target pass an engine runs (``forward``), which one it is, and why it was chosen."""

    name: str  # one of CANDIDATES
    forward: PassFunction
    reason: str
    timings_ms: dict[str, tuple[float, ...]]  # per candidate measured: pass times at MEASURED_POSITIONS (auto only)
    # How far its logits may be from the loaded model's own forward (``check_packed``; None: that
    # check's default, float32 rounding). A pass on rounded weights is another model: its bound only
    # catches a broken pass (attention without its past is off by whole units).
    tolerance: float | None = None
    # The instruction-set level of the compiled kernels it runs on (levels.LEVEL_NAMES), where it has them
    isa: str | None = None
    # Whether an engine checks it against the model's own forward at start-up (``Engine.calibrate``):
    # not a pass "auto" takes by rule on a GGUF file, whose check lives in the tests — the check runs
    # transformers' float32 forward, which reads every weight of the loaded model (a snapshot's are
    # mapped, and the pass on the blocks never reads them).
    check_at_start: bool = True


MEASURED_POSITIONS = (1, 8)  # one plain token and a typical verification
_selected: "weakref.WeakKeyDictionary[Any, dict[str, SelectedWeights]]" = weakref.WeakKeyDictionary()
_selected_lock = threading.Lock()


def fastest_pass_ms(forward: PassFunction, rows: list[PackedRow], repeats: int) -> float:
    """The fastest of ``repeats`` runs of one pass over ``rows`` (rolled back after each), in ms; on
    CUDA each run waits for the device, so the time is the pass's, not its launch's."""
    device = rows[0].block.layout.device
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        forward(rows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append((time.perf_counter() - started) * 1e3)
        for row in rows:
            row.block.length -= len(row.tokens)
    return min(timings)


def pass_layout(layout: KVLayout, forward: PassFunction) -> KVLayout:
    """The key/value layout an engine runs ``forward`` on: ``layout``, its keys and values stored in
    the pass's ``kv_dtypes`` where it names them (``BlockPass``: float16 values on integer rows)."""
    dtypes = getattr(forward, "kv_dtypes", None)
    return layout if dtypes is None or dtypes == layout.dtypes else layout.with_dtype(*dtypes)


def _pass_ms(forward: PassFunction, layout: KVLayout, positions: int, repeats: int = 3, context: int = 64) -> float:
    block = KVBlock(pass_layout(layout, forward))
    forward([PackedRow(block, list(range(100, 100 + context)), 1)])
    return fastest_pass_ms(forward, [PackedRow(block, [100] * positions, 1)], repeats)


def _build(model: Any, name: str, gguf_file: Path | None = None, read: Callable[[], dict[int, Blocks]] | None = None) -> PassFunction:
    """The pass ``name`` over ``model``; ``NotImplementedError`` where it cannot run. ``read``: the
    GGUF file's blocks (``read_blocks``), shared by the passes built together."""
    if name in GGUF_ACTIVATIONS:
        activations = GGUF_ACTIVATIONS[name]
        reason = blocks_unsupported(model, gguf_file, activations) or onednn_supported(model)
        if reason is not None:
            raise NotImplementedError(reason)
        blocks = GGUFBlocks(model, gguf_file, fallback=onednn_linear, activations=activations, blocks=read() if read else None)
        try:  # the decoder layers in one compiled call where every layer product has blocks
            return BlockPass(model, blocks)
        except NotImplementedError as exc:
            log.info("GGUF blocks: the layers run from Python (%s)", exc)
            return FusedPass(model, blocks.linear, blocks.embedding)
    if name in ("eager", "onednn"):
        use_packed_attention(model)
        return functools.partial(forward_packed, model if name == "eager" else with_onednn_linears(model))
    reason = fused_unsupported(model) or (bf16_supported(model) if name == "bf16" else None)
    if reason is not None:
        raise NotImplementedError(reason)
    if name == "bf16":
        return FusedPass(model, functools.partial(onednn_linear, dtype=torch.bfloat16))
    linear = torch_linear if onednn_supported(model) is not None else onednn_linear
    return StaticPass(model, linear) if name == "static" else FusedPass(model, linear)


@torch.inference_mode()
def select_weights(model: Any, layout: KVLayout, requested: str = "auto", gguf_file: Path | None = None) -> SelectedWeights:
    """The target pass for ``model``: ``requested``, or for ``"auto"`` the fastest of the candidates
    that can run here and agree with the model (1- and 8-position passes, timed here). Decided once
    per model and request, shared by every engine of that model. ``gguf_file``: the file the model
    was read from, for the ``"gguf"`` pass. Raises ``ValueError`` for a name not in WEIGHTS and
    ``NotImplementedError`` for a candidate that cannot run here."""
    if requested not in WEIGHTS:
        raise ValueError(f"Unknown weights {requested!r}; use one of {', '.join(WEIGHTS)}.")
    with _selected_lock:
        chosen = _selected.setdefault(model, {})
        if requested not in chosen:
            chosen[requested] = _select(model, layout, requested, gguf_file)
        return chosen[requested]


def _select(model: Any, layout: KVLayout, requested: str, gguf_file: Path | None) -> SelectedWeights:
    tree = weights_on_meta(model)  # a GGUF file's module tree: only the block passes run on it
    if requested != "auto":
        forward = _build(model, requested, gguf_file)
        # a module tree has no float weights for check_packed to run transformers' forward on: its
        # passes' checks are the tests'
        return SelectedWeights(requested, forward, "requested", {}, _tolerance(requested), getattr(forward, "isa", None), check_at_start=not tree)
    left_out: list[str] = []
    read = functools.cache(lambda: read_blocks(model, gguf_file))  # once for "gguf" and "gguf-q16"
    by_rule = _gguf_by_rule(model, gguf_file, read, left_out)
    if by_rule is not None:
        return by_rule
    if tree:
        reasons = "; ".join(left_out) or blocks_unsupported(model, gguf_file, GGUF_ACTIVATIONS[GGUF_RULE[-1]]) or "no pass built"
        gigabytes = 4 * model.num_parameters() / 1e9
        raise ModelLoadError(
            f"{gguf_file.name} runs on agentspec's block kernels, which cannot run here ({reasons}). "
            f"To run it on its weights dequantised to float32 (about {gigabytes:.1f} GB of memory), pass weights='fused' (or 'eager')."
        )
    candidates: dict[str, PassFunction] = {"eager": _build(model, "eager")}
    for name in CANDIDATES[1:]:
        if name in GGUF_RULE and any(reason.startswith(f"{name}:") for reason in left_out):
            continue  # the rule tried it already
        if name in GPU_CANDIDATES and layout.device.type != "cuda":
            left_out.append(f"{name}: a GPU pass (on a CPU it computes its padding; ask for it by name)")
            continue
        try:  # cannot run here, or its logits differ from the model's own forward (check_packed)
            forward = _build(model, name, gguf_file, read)
            check_packed(model, pass_layout(layout, forward), _tolerance(name), forward=forward)
        except NotImplementedError as exc:
            left_out.append(f"{name}: {exc}")
            continue
        candidates[name] = forward
    timings = {name: tuple(_pass_ms(forward, layout, p) for p in MEASURED_POSITIONS) for name, forward in candidates.items()}
    best = min(timings, key=lambda name: sum(timings[name]))
    shown = ", ".join(f"{name} {'/'.join(f'{ms:.1f}' for ms in t)} ms" for name, t in timings.items())
    reason = f"measured passes of {'/'.join(map(str, MEASURED_POSITIONS))} positions: {shown}"
    if left_out:
        reason += f"; not candidates here: {'; '.join(left_out)}"
    isa = getattr(candidates[best], "isa", None)
    # a GGUF file off the block kernels runs on weights dequantised to float32: several times the
    # file's memory and slower, never without saying so
    level = logging.WARNING if gguf_file is not None and best not in GGUF_ACTIVATIONS else logging.INFO
    log.log(level, "target pass: %s%s (%s)", best, f" on {isa} kernels" if isa else "", reason)
    return SelectedWeights(best, candidates[best], reason, timings, _tolerance(best), isa)


# A GGUF file on a CPU with kernels: the first of these that builds, by rule (its check is in the tests)
GGUF_RULE = ("gguf-q16", "gguf")


def _gguf_by_rule(model: Any, gguf_file: Path | None, read: Callable[[], dict[int, Blocks]], left_out: list[str]) -> SelectedWeights | None:
    """"auto" on a GGUF file where the block kernels run: the first pass of ``GGUF_RULE`` that builds,
    chosen by rule, not by timing — the same file on the same CPU takes the same pass, and so gives
    the same text, on every run (gguf and gguf-q16 differ where two tokens nearly tie) — and the only
    pass built. Its agreement with the model is the tests' to check, for every family (``tests/
    test_families.py``, ``test_weights.py``), not each start-up's. None where neither builds (their
    reasons added to ``left_out``): then the other candidates are timed."""
    if gguf_file is None or blocks_unsupported(model, gguf_file, GGUF_ACTIVATIONS[GGUF_RULE[-1]]) is not None:
        return None
    for name in GGUF_RULE:
        try:
            forward = _build(model, name, gguf_file, read)
        except NotImplementedError as exc:
            left_out.append(f"{name}: {exc}")
            continue
        isa = getattr(forward, "isa", None)
        reason = f"a GGUF file on {isa} kernels takes the first of {', '.join(GGUF_RULE)} that builds here"
        if left_out:
            reason += f"; not {'; '.join(left_out)}"
        log.info("target pass: %s on %s kernels (%s)", name, isa, reason)
        return SelectedWeights(name, forward, reason, {}, _tolerance(name), isa, check_at_start=False)
    return None


def _tolerance(name: str) -> float | None:
    return NEAR_TOLERANCE if name in NEAR else REDUCED_TOLERANCE if name in REDUCED else None
