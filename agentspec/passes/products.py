"""Products ``x @ W.T`` on a GGUF file's blocks, and which of a model's weights have them.

``read_blocks`` finds each linear weight's tensor in the file (a module tree's as ``FileBlocks``, read
when its product is built; a loaded model's read and checked to dequantise to it bit for bit on 8
rows, ``_agrees``). ``GGUFBlocks.linear`` makes the fused pass's products: a ``BlockProduct`` on
blocks of one kind, times float32 rows or rows rounded to 8 or 16 bits per block of 32
(``activations``; float32 rows where the integer products cannot take the blocks), a
``StackedProduct`` where the stacked weights are of different kinds (Q4_K_M's q, k and v), the
fallback (oneDNN on float32 weights) where a weight has no blocks. Every product is row-invariant by
construction: each output is one accumulator taking the same operations whatever shares the call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..gguf import GGUFFile, GGUFTensor, read_gguf
from ..gguf.modules import FLOAT_TYPES, weights_on_meta
from .arch import GGUF_PROJECTIONS, describe
from .fused import Linear, LinearFactory, fused_unsupported
from .layouts import (
    ACTIVATIONS, GGUF_TYPES, GROUPS, INTEGER_ACTIVATIONS, Blocks, FileBlocks, IntegerLayout, Part, by_lanes_of_runs, by_runs, layout_bytes,
    tensor_blocks, unpermuted,
)
from .levels import PRODUCT_SYMBOLS, address, block_kernels, kernels_or_reason
from .threads import kernel_threads

__all__ = ["GGUFBlocks", "read_blocks", "BlockProduct", "StackedProduct", "block_product", "blocks_unsupported"]

log = logging.getLogger("agentspec.engine")



def blocks_unsupported(model: Any, gguf_file: Path | None, activations: str = "float32", isa: str | None = None) -> str | None:
    """Why ``model`` cannot run on its GGUF file's blocks here (times ``activations``, one of
    ``ACTIVATIONS``; on level ``isa``, default the fastest here), or None when it may (the blocks
    themselves are checked when they are read). Every level runs every activation."""
    if activations not in ACTIVATIONS:
        return f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}"
    if gguf_file is None:
        return "the model was not read from a GGUF file"
    reason = fused_unsupported(model)
    if reason is not None:
        return reason
    weight = model.get_output_embeddings().weight
    if weight.device.type not in ("cpu", "meta") or weight.dtype != torch.float32:  # meta: a module tree of the file (gguf/modules.py)
        return f"the GGUF block kernels take float32 rows on a CPU (the model is {weight.dtype} on {weight.device})"
    kernels = kernels_or_reason(isa)
    return kernels if isinstance(kernels, str) else None


def _read(tensor: GGUFTensor) -> Blocks | None:
    """A GGUF tensor's blocks (None for other types)."""
    return tensor_blocks(tensor.type_name, tensor.data)


def _gguf_names(model: Any) -> list[tuple[str, torch.Tensor, int | None]]:
    """(GGUF tensor name, the loaded weight, heads whose rows llama.cpp's converter may have
    interleaved) of each projection the family's block has (``arch.py``), and of the input embedding
    where the module tree has none (its rows are read from the blocks: ``GGUFBlocks.embedding``)."""
    arch = describe(model)
    family = arch.family
    names = []
    if weights_on_meta(model):
        names.append(("token_embd.weight", model.get_input_embeddings().weight, None))
    for i, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        modules = [(name, getattr(attention, name)) for name in (*family.qkv, "o_proj")]
        modules += [(name, getattr(mlp, name)) for name in (*family.gate_up, "down_proj")]
        for name, module in modules:
            heads = {"q_proj": arch.heads, "k_proj": arch.kv_heads}.get(name) if family.gguf_permuted else None
            names.append((f"blk.{i}.{GGUF_PROJECTIONS[name]}.weight", module.weight, heads))
    names.append(("output.weight", model.get_output_embeddings().weight, None))
    return names


def _agrees(blocks: Blocks, weight: torch.Tensor) -> bool:
    """Whether ``blocks`` dequantise to ``weight`` bit for bit on a few rows spread over it — the
    first four (they tell the rotary halves' interleaving apart), the middle and the last ones — so
    that the check reads a few pages of a loaded weight, not all of it (a snapshot's weights are
    mapped: a pass on the blocks never reads them)."""
    outputs = weight.shape[0]
    rows = torch.unique(torch.tensor([0, 1, 2, 3, outputs // 3, outputs // 2, outputs - 2, outputs - 1]).clamp(0, outputs - 1))
    return blocks.shape == tuple(weight.shape) and torch.equal(blocks.rows(rows).dequantised(), weight.detach()[rows])


def read_blocks(model: Any, gguf_file: Path | GGUFFile) -> dict[int, Part]:
    """``model``'s linear weights as ``gguf_file`` (a path, or the file read) stores them, by id of
    the loaded weight, each checked to dequantise to it bit for bit on a sample of rows (``_agrees``;
    ``NotImplementedError`` where one does not, or where none has blocks). A module tree's weights
    (on the meta device: nothing to check against) take llama.cpp's layout by rule: a family whose
    rows the converter interleaves (``Family.gguf_permuted``) has them un-interleaved, as
    transformers' reader does, and they are read from the file as their products are built
    (``FileBlocks``). ``GGUFBlocks`` takes them, so that passes built together read the file once."""
    gguf = gguf_file if isinstance(gguf_file, GGUFFile) else read_gguf(gguf_file)
    gguf_file, tensors = gguf.path, gguf.tensors
    found: dict[int, Part] = {}
    unread: dict[str, list[str]] = {}  # matrices of types the kernels do not read, by type
    for name, weight, heads in _gguf_names(model):
        tensor = tensors.get(name) or (tensors.get("token_embd.weight") if name == "output.weight" else None)
        if id(weight) in found:
            continue  # the LM head tied to the input embedding
        if tensor is None:
            raise NotImplementedError(f"{gguf_file.name} has no tensor {name}")
        if tensor.type_name not in GGUF_TYPES:  # float or another block type: oneDNN takes this weight, as float32
            if tensor.type_name not in FLOAT_TYPES:
                unread.setdefault(tensor.type_name, []).append(tensor.name)
            continue
        if weight.device.type == "meta":  # a module tree's: read when its product is built
            if tensor.shape != tuple(weight.shape):
                raise NotImplementedError(f"{gguf_file.name}'s {name} has shape {tensor.shape}, the model's {tuple(weight.shape)}")
            found[id(weight)] = FileBlocks(tensor, heads)
            continue
        blocks = _read(tensor)
        with torch.no_grad():
            candidates = [blocks] if heads is None else [unpermuted(blocks, heads), blocks]
            match = next((b for b in candidates if _agrees(b, weight)), None)
        if match is None:
            raise NotImplementedError(f"{gguf_file.name}'s {name} does not dequantise to the loaded weight")
        found[id(weight)] = match
    if not found:
        raise NotImplementedError(f"{gguf_file.name} has no weights of the types the kernels read ({', '.join(GGUF_TYPES)})")
    if unread:
        shown = "; ".join(f"{kind}: {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" for kind, names in sorted(unread.items()))
        log.warning(
            "%s: matrices of types the block kernels do not read run on float32 weights (4-8x the bytes a token reads): %s; "
            "requantise the file to one of %s for the fast pass on all of them", gguf_file.name, shown, ", ".join(GGUF_TYPES),
        )
    return found


class GGUFBlocks:
    """A loaded model's linear weights as its GGUF file stores them, checked against the model.

    ``linear`` makes the fused pass's products (``FusedPass(model, blocks.linear)``): on the
    blocks where every stacked weight has them of one kind (times float32 rows, or rows quantised to 8
    or 16 bits with ``activations="q8"`` or ``"q16"`` — float32 rows for blocks the integer products do
    not take: ``Blocks.integer_layout`` says why), else with ``fallback`` (oneDNN-packed float32).
    ``blocks``: what ``read_blocks(model, gguf_file)`` gave, where it was read already. ``isa``: the
    kernels' instruction-set level (``LEVEL_NAMES``; default the fastest here, capped by
    ``$AGENTSPEC_ISA``): every level gives the same bits, at its own speed."""

    def __init__(
        self, model: Any, gguf_file: Path, fallback: LinearFactory, activations: str = "float32", blocks: dict[int, Blocks] | None = None,
        isa: str | None = None,
    ) -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
        reason = blocks_unsupported(model, gguf_file, activations, isa)
        if reason is not None:
            raise NotImplementedError(reason)
        self.kernels = block_kernels(isa)
        self.fallback, self.activations = fallback, activations
        self.blocks = read_blocks(model, gguf_file) if blocks is None else blocks  # id(loaded weight) -> its blocks
        self.kinds = sorted({b.kind for b in self.blocks.values()})
        embedding = self.blocks.get(id(model.get_input_embeddings().weight)) if weights_on_meta(model) else None
        # A module tree's input embedding: the rows a pass needs, dequantised from the file's blocks
        # (as transformers' reader dequantises them: the same float32 bits)
        self.embedding: Callable[[torch.Tensor], torch.Tensor] | None = None if embedding is None else embedding.dequantised_rows

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks as read (codes, float32 scales and minimums; a matrix still in the file:
        its bytes there)."""
        return sum(b.tensor.nbytes if isinstance(b, FileBlocks) else b.codes.nbytes + b.scales.nbytes + (b.mins.nbytes if b.has_mins else 0) for b in self.blocks.values())

    def linear(self, weights: Sequence[torch.Tensor]) -> Linear:
        """``x @ W.T`` for ``weights`` stacked along their outputs (a matrix still in the file is read
        in runs of rows, and its pages of the file let go once the product has its layout)."""
        parts = [self.blocks.get(id(w)) for w in weights]
        if any(p is None for p in parts):
            return self.fallback(weights)
        if len({p.kind for p in parts}) != 1:  # e.g. Q4_K_M's q, k (Q4_K) and v (Q6_K): a product per run of one kind
            runs: list[list[Part]] = []
            for part in parts:
                if runs and runs[-1][0].kind == part.kind:
                    runs[-1].append(part)
                else:
                    runs.append([part])
            return StackedProduct([self._product(run) for run in runs])
        return self._product(parts)

    def _product(self, parts: Sequence[Part]) -> "BlockProduct":
        try:
            product = BlockProduct(parts, self.kernels, self.activations)
        except NotImplementedError:  # blocks the integer products do not take (Blocks.integer_layout says why): float32 rows
            if self.activations not in INTEGER_ACTIVATIONS:
                raise
            product = BlockProduct(parts, self.kernels, "float32")
        for part in parts:
            if isinstance(part, FileBlocks):
                part.release()
        return product


class BlockProduct:
    """``x @ W.T`` ([rows, in] float32 → [rows, out]) on ``blocks``, with the compiled kernels; with
    ``activations="q8"`` (``"q16"``), on the rows quantised to 8 (16) bits per block of 32 (``blocks.c``).
    ``kernels``: ``block_kernels(isa)`` of the level to run on (default: the fastest here)."""

    def __init__(self, blocks: Blocks | Sequence[Part], kernels: ctypes.CDLL | None = None, activations: str = "float32") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
        parts = [blocks] if isinstance(blocks, Blocks) else list(blocks)  # several: their outputs in turn
        kernels = kernels or block_kernels()
        self.kind, self.activations, self.isa = parts[0].kind, activations, kernels.isa
        self.layout: IntegerLayout | None = None  # how the integer products read the blocks
        if activations in INTEGER_ACTIVATIONS:  # one layout: every row count reads a register's outputs' blocks as one run of memory
            self.few, self.layout = by_lanes_of_runs(parts, kernels.lanes, kernels)  # NotImplementedError where integer_layout_of says why not
            self.many = None
            self.function = functools.partial(kernels.agentspec_int_product, self.layout.number(activations))
        else:
            # Two copies of the blocks, grouped for products of one or two rows and for more: one row
            # streams its tile of 8 outputs' blocks as one run of memory (about twice the bandwidth of
            # three runs per output), but the 2- and 4-output tiles of more rows read groups of 8 slower.
            self.few, self.many = (by_runs(parts, group, lambda run, group=group: run.grouped(group)) for group in GROUPS)
            self.function = getattr(kernels, PRODUCT_SYMBOLS[self.kind])
        self.outputs, self.inputs = sum(part.shape[0] for part in parts), parts[0].shape[1]
        # the bytes of the blocks the kernels read for these outputs and inputs: few's (and many's)
        if self.layout is not None:
            self.block_bytes = (layout_bytes(self.kind, self.outputs, self.inputs, kernels.lanes, self.layout),)
        else:
            self.block_bytes = tuple(layout_bytes(self.kind, self.outputs, self.inputs, group) for group in GROUPS)

    @property
    def nbytes(self) -> int:
        """Bytes a product of one row streams: its blocks as the kernels read them (``few``)."""
        return self.few.nbytes

    def blocks(self) -> list[int]:
        """The addresses of the blocks (``few``, and ``many`` on float32 rows), each checked to hold
        what the kernels read for these outputs and inputs."""
        laid_out = [self.few] if self.many is None else [self.few, self.many]
        return [address(blocks, size, (torch.uint8,), "the product's blocks") for blocks, size in zip(laid_out, self.block_bytes)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        inputs, outputs = self.inputs, self.outputs
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != inputs:
            raise ValueError(f"the block product takes float32 CPU rows of {inputs}, not {x.dtype} {tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, inputs).contiguous()
        count = rows.shape[0]
        out = torch.empty(count, outputs)
        x_at, y_at = address(rows, count * inputs, (torch.float32,), "the product's rows"), address(out, count * outputs, (torch.float32,), "its outputs")
        self.function(x_at, count, inputs, *self.blocks(), y_at, outputs, kernel_threads())
        return out.reshape(*x.shape[:-1], outputs)


class StackedProduct:
    """``x @ W.T`` where W's outputs are parts of different kinds of blocks, one ``BlockProduct`` each
    (their outputs in turn): row-invariant as each is. The compiled layers take it as a chain of
    parts (blocks.h: agentspec_blocks.next)."""

    def __init__(self, products: Sequence[BlockProduct]) -> None:
        self.products = list(products)
        self.outputs, self.inputs = sum(p.outputs for p in self.products), self.products[0].inputs
        self.isa = self.products[0].isa

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.products)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([product(x) for product in self.products], dim=-1)


def block_product(blocks: Blocks, kernels: ctypes.CDLL | None = None, activations: str = "float32") -> Linear:
    """``x @ W.T`` ([rows, in] float32 → [rows, out]) on ``blocks``, with the compiled kernels."""
    return BlockProduct(blocks, kernels, activations)
