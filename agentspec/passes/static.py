"""The target pass for a GPU (``weights="static"``): keys and values in one pool allocated once, each
layer's attention for the whole pass in one call, and on CUDA one graph replayed per pass shape.

On a GPU the default model's pass is launch-bound, not arithmetic-bound: the fused pass makes about
ten kernel launches per layer, one attention call per sequence per layer (``packed.attend``), and
its keys/values move whenever a sequence's block grows (``KVBlock.reserve``), so no launch sequence
can be recorded once and replayed. This pass removes each of those:

- ``KVPool``: the keys and values of up to ``sequences`` sequences of up to ``capacity`` tokens, in
  one tensor allocated once (``[slots, layers, 2, kv_heads, capacity, head_dim]``). A sequence's
  block becomes a view of its slot the first time it takes part in a pass (its keys/values copied in
  once) and keeps that address; a block that is garbage-collected frees its slot; when every slot
  is taken, the least recently used block outside the pass gets a private copy of its keys/values
  and gives its slot up. Slot 0 is scratch, written by a pass's padding.
- The pass is laid out as a grid of ``rows × positions`` cells (each bucketed to a power of two):
  row b holds sequence b's new tokens, left-aligned, its padding cells write to scratch and attend
  only to key 0. Each layer writes the new keys/values with one indexed store into the pool and
  runs one attention call over ``rows`` sequences' keys (the pool's slots gathered, up to a key
  bucket), masked per row: variable-length attention without a loop over sequences.
- On CUDA each ``(rows, positions, keys)`` bucket with at most ``GRAPH_POSITIONS`` positions per row
  (decode and verification passes; prefill chunks run eagerly) is captured once as a CUDA graph
  and replayed: a pass is one graph launch plus the copies of its small inputs. ``captured`` counts
  the captures (one per shape, never a storm); ``graph_failures`` says why capture fell back to
  eager, where it did.

Verification already runs on the device with one host read per pass (``Engine._verify``).

On a CPU the same code runs eagerly (tested there, ``tests/test_static.py``); it is slower than the
CPU passes (the grid computes its padding cells), so ``"auto"`` considers it on CUDA only.
Identity: a token's logits must not depend on its pass's shape; the attention over a key bucket
adds exact zeros for the masked keys, which is invariant where the kernel reduces keys in a fixed
order (measured on CPU by the tests; ``tests/cuda_check.py`` measures it on a GPU, with speculative
== plain end to end).
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..engine.kv import KVBlock, KVLayout
from .arch import LayerSpec
from .fused import FusedPass, LinearFactory
from .packed import PackedRow, finish_rows, sdpa, wants_features

__all__ = ["KVPool", "StaticPass", "GRAPH_POSITIONS", "KEY_BUCKET", "bucket"]

log = logging.getLogger("agentspec.engine")

GRAPH_POSITIONS = 16  # positions per row up to which a shape is captured as a graph (decode, verification)
KEY_BUCKET = 256  # attention reads keys in power-of-two multiples of this many positions
CPU_CAPACITY = 1024  # tokens per sequence of a pool on a CPU (a test path there; a GPU pool takes the window)
CPU_SEQUENCES = 8  # slots of a pool on a CPU: a pass of the default batch (more sequences take turns, KVPool)
GPU_POOL_FRACTION = 0.25  # of the device's free memory, for a pool on a GPU
MAX_SEQUENCES = 256


def bucket(n: int, smallest: int = 1, largest: int | None = None) -> int:
    """The power of two times ``smallest`` at least ``n`` (at most ``largest``)."""
    size = smallest
    while size < n:
        size *= 2
    return size if largest is None else min(size, largest)


class KVPool:
    """Keys and values of up to ``sequences`` sequences of up to ``capacity`` tokens, in two tensors
    allocated once; each sequence's ``KVBlock`` is a view of its slot. Slot 0 is scratch."""

    def __init__(self, layout: KVLayout, sequences: int, capacity: int) -> None:
        if sequences < 1 or capacity < 1:
            raise ValueError(f"a key/value pool needs at least one sequence and one token, not {sequences} × {capacity}")
        self.layout, self.capacity = layout, capacity
        # zeros, not empty: attention multiplies masked keys' values by 0, and 0 × NaN is NaN
        shape = (sequences + 1, layout.layers, layout.kv_heads, capacity, layout.head_dim)
        self.keys, self.values = (torch.zeros(shape, dtype=dtype, device=layout.device) for dtype in layout.dtypes)
        self._slots: weakref.WeakKeyDictionary[KVBlock, int] = weakref.WeakKeyDictionary()
        self._owners: collections.OrderedDict[int, weakref.ref[KVBlock]] = collections.OrderedDict()  # least recent first
        self._free = list(range(sequences, 0, -1))
        self.evictions = 0

    @property
    def sequences(self) -> int:
        return self.keys.shape[0] - 1

    def place(self, blocks: Sequence[KVBlock], new: Sequence[int]) -> list[int]:
        """The slots of ``blocks`` for a pass writing ``new[i]`` more tokens into block i; blocks
        not in the pool yet move in. Raises ``ValueError`` (before changing anything) when a
        block would outgrow a slot or the pass has more sequences than the pool."""
        if len(blocks) > self.sequences:
            raise ValueError(f"a pass of {len(blocks)} sequences does not fit a key/value pool of {self.sequences}")
        for block, tokens in zip(blocks, new):
            if block.length + tokens > self.capacity:
                raise ValueError(
                    f"a sequence of {block.length + tokens} tokens does not fit the key/value pool's {self.capacity} per sequence"
                )
        keep = set(map(id, blocks))
        return [self._slot(block, keep) for block in blocks]

    def _slot(self, block: KVBlock, keep: set[int]) -> int:
        slot = self._slots.get(block)
        if slot is not None and block.keys is not None and block.keys.data_ptr() == self.keys[slot].data_ptr():
            self._owners.move_to_end(slot)
            return slot
        if slot is not None:  # its block was reallocated elsewhere since (a reserve past the slot)
            self._release(slot)
        slot = self._take(keep)
        keys, values = self.keys[slot], self.values[slot]
        if block.keys is not None and block.values is not None and block.length:
            keys[:, :, : block.length].copy_(block.keys[:, :, : block.length])
            values[:, :, : block.length].copy_(block.values[:, :, : block.length])
        block.keys, block.values = keys, values
        self._slots[block] = slot
        self._owners[slot] = weakref.ref(block)
        return slot

    def _take(self, keep: set[int]) -> int:
        for slot, owner in list(self._owners.items()):  # slots of blocks that are gone
            if owner() is None:
                self._release(slot)
        if not self._free:
            for slot, owner in self._owners.items():  # the least recently used block outside the pass
                block = owner()
                if block is not None and id(block) not in keep:
                    block.keys, block.values = (None if t is None else t.clone() for t in (block.keys, block.values))  # its own copy
                    self._slots.pop(block, None)
                    self._release(slot)
                    self.evictions += 1
                    break
        return self._free.pop()

    def _release(self, slot: int) -> None:
        del self._owners[slot]
        self._free.append(slot)


@dataclass
class _Grid:
    """A pass laid out as rows × positions (device tensors; what a graph's static inputs hold)."""

    ids: torch.Tensor  # [B, Q] token ids
    positions: torch.Tensor  # [B, Q] rotary positions
    new: torch.Tensor  # [B] real cells per row
    slots: torch.Tensor  # [B] each row's pool slot (0: a padding row)
    write_slots: torch.Tensor  # [B * Q] where each cell's key/value goes: its row's slot, or scratch
    write_positions: torch.Tensor  # [B * Q]


class _Context:
    """What each layer's attention reads: the grid's shape, slots, store indices and mask."""

    __slots__ = ("rows", "positions", "keys", "slots", "write_slots", "write_positions", "masks")

    def __init__(self, grid: _Grid, keys: int, groups: int, windows: set[int | None]) -> None:
        self.rows, self.positions = grid.ids.shape
        self.keys, self.slots = keys, grid.slots
        self.write_slots, self.write_positions = grid.write_slots, grid.write_positions
        key = torch.arange(keys, device=grid.ids.device)[None, None, :]
        real = torch.arange(self.positions, device=grid.ids.device)[None, :] < grid.new[:, None]  # [B, Q]
        at = grid.positions[:, :, None]
        self.masks = {}  # per window of the model's layers (None: all keys up to the cell's position)
        for window in windows:
            visible = (key <= at) & real[:, :, None]
            if window is not None:
                visible &= key > at - window
            visible |= (key == 0) & ~real[:, :, None]  # a padding cell sees key 0 (never a row with nothing to attend)
            self.masks[window] = visible.repeat(1, groups, 1)[:, None]  # [B, 1, groups * Q, keys]: rows per query group


class _Graph:
    __slots__ = ("graph", "grid", "outputs")

    def __init__(self, graph: Any, grid: _Grid, outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.graph, self.grid, self.outputs = graph, grid, outputs


class StaticPass(FusedPass):
    """The fused pass over a static key/value pool, one attention call per layer, graphs on CUDA."""

    def __init__(
        self, model: Any, linear: LinearFactory, *, sequences: int | None = None, capacity: int | None = None, graphs: bool | None = None
    ) -> None:
        super().__init__(model, linear)
        layout = KVLayout.of(model)
        self.device = layout.device
        window = int(getattr(model.config, "max_position_embeddings", 0) or CPU_CAPACITY)
        capacity = capacity or (window if self.device.type == "cuda" else min(window, CPU_CAPACITY))
        if sequences is None:
            sequences = CPU_SEQUENCES
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                sequences = int(free * GPU_POOL_FRACTION) // (layout.bytes_per_token * capacity)
                sequences = max(1, min(MAX_SEQUENCES, sequences))
        self.pool = KVPool(layout, sequences, capacity)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise NotImplementedError("CUDA graphs need a CUDA device")
        self._graphs: dict[tuple[int, int, int], _Graph | None] = {}  # None: its capture failed
        self._graph_memory: Any = None
        self.captured = 0  # graphs captured: one per pass shape
        self.graph_failures: list[str] = []  # why a shape runs eagerly although graphs are on
        self._lock = threading.Lock()  # one pass at a time: engines of one model share this pass and its pool

    def first_layers(self, layers: int) -> FusedPass:
        """Not for this pass: its pool and graphs hold every layer (``NotImplementedError``)."""
        raise NotImplementedError("the static pass's key/value pool and graphs hold every layer; an early exit runs on the CPU passes")

    @torch.inference_mode()
    def __call__(self, rows: Sequence[PackedRow]) -> list[torch.Tensor]:
        with self._lock:
            return self._pass(rows)

    def _pass(self, rows: Sequence[PackedRow]) -> list[torch.Tensor]:
        new = [len(row.tokens) for row in rows]
        slots = self.pool.place([row.block for row in rows], new)
        shape = (
            bucket(len(rows)),  # padding rows read and write only the scratch slot
            bucket(max(new)),
            bucket(max(row.block.length + n for row, n in zip(rows, new)), KEY_BUCKET, self.pool.capacity),
        )
        grid = self._grid(rows, slots, shape)
        logits, normed = self._run(shape, grid)
        width = shape[1]
        keep = [b * width + i for b, (row, n) in enumerate(zip(rows, new)) for i in range(n - row.pad - row.logits, n - row.pad)]
        kept = logits[torch.tensor(keep, device=self.device)]
        features = torch.cat([normed[b * width : b * width + n] for b, n in enumerate(new)]) if wants_features(rows) else None
        return finish_rows(rows, kept, features)

    def _grid(self, rows: Sequence[PackedRow], slots: list[int], shape: tuple[int, int, int]) -> _Grid:
        """The pass's inputs on the host, padded to ``shape``, then moved to the device in one go."""
        height, width, _ = shape
        ids = torch.zeros((height, width), dtype=torch.long)
        positions = torch.arange(width).repeat(height, 1)
        new = torch.zeros(height, dtype=torch.long)
        row_slots = torch.zeros(height, dtype=torch.long)
        write_slots = torch.zeros((height, width), dtype=torch.long)
        write_positions = torch.arange(height * width).remainder(self.pool.capacity).view(height, width)  # scratch
        for b, (row, slot) in enumerate(zip(rows, slots)):
            n, past = len(row.tokens), row.block.length
            ids[b, :n] = torch.tensor(row.tokens)
            positions[b] = torch.arange(past, past + width)
            new[b], row_slots[b] = n, slot
            write_slots[b, :n] = slot
            write_positions[b, :n] = positions[b, :n]
        tensors = [ids, positions, new, row_slots, write_slots.view(-1), write_positions.reshape(-1)]
        return _Grid(*(t.to(self.device, non_blocking=True) for t in tensors))

    def _run(self, shape: tuple[int, int, int], grid: _Grid) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.graphs or shape[1] > GRAPH_POSITIONS:
            return self._compute(grid, shape[2])
        graph = self._graphs[shape] if shape in self._graphs else self._capture(shape)
        if graph is None:  # its capture failed: eager, not captured again
            return self._compute(grid, shape[2])
        for name in ("ids", "positions", "new", "slots", "write_slots", "write_positions"):
            getattr(graph.grid, name).copy_(getattr(grid, name))
        graph.graph.replay()
        return graph.outputs[0].clone(), graph.outputs[1].clone()

    def _capture(self, shape: tuple[int, int, int]) -> _Graph | None:
        """Record the pass of ``shape`` as a CUDA graph over static inputs (a pass of padding only:
        it writes nothing but scratch)."""
        height, width, keys = shape
        cells = height * width

        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=self.device)

        static = _Grid(
            zeros(height, width), torch.arange(width, device=self.device).repeat(height, 1), zeros(height), zeros(height),
            zeros(cells), torch.arange(cells, device=self.device).remainder(self.pool.capacity),
        )
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the capture: lazy initialisation, workspace sizes
                for _ in range(2):
                    self._compute(static, keys)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._graph_memory is None:
                self._graph_memory = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._graph_memory):
                outputs = self._compute(static, keys)
        except RuntimeError as exc:
            reason = f"rows {height}, positions {width}, keys {keys}: {exc}"
            log.warning("CUDA graph capture failed, running that shape eagerly (%s)", reason)
            self.graph_failures.append(reason)
            self._graphs[shape] = None
            return None
        self.captured += 1
        log.info("captured a CUDA graph for passes of %d rows × %d positions over %d keys (%d so far)", height, width, keys, self.captured)
        self._graphs[shape] = entry = _Graph(graph, static, outputs)
        return entry

    def _compute(self, grid: _Grid, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass over ``grid``: every cell's logits and final normed hidden state ([B * Q, ...])."""
        hidden = self.embeddings(grid.ids.reshape(-1))
        rotations = self.rotations(hidden, grid.positions.reshape(1, -1))
        context = _Context(grid, keys, self.heads // self.kv_heads, {spec.window for spec in self.arch.layers})
        hidden = self.decoder_layers(hidden, rotations, context)
        normed = self.final_norm(hidden)
        return self.logits(normed), normed

    def attention(self, context: _Context, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
        """The grid's new keys/values stored in one indexed write per tensor, then one attention call
        over every row's slot up to the key bucket, masked per row (and the layer's window)."""
        rows, width, keys = context.rows, context.positions, context.keys
        kv_heads, groups, head_dim = self.kv_heads, self.heads // self.kv_heads, self.head_dim
        stored_keys, stored_values = self.pool.keys[:, layer], self.pool.values[:, layer]  # [slots, kv_heads, capacity, head_dim]
        stored_keys[context.write_slots, :, context.write_positions] = k
        stored_values[context.write_slots, :, context.write_positions] = v
        row_keys = stored_keys[:, :, :keys].index_select(0, context.slots)  # [B, kv_heads, keys, head_dim]
        row_values = stored_values[:, :, :keys].index_select(0, context.slots)
        # grouped-query attention without copying keys: a kv head's query heads × positions are its rows
        query = q.view(rows, width, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, groups * width, head_dim)
        out = sdpa(query, row_keys, row_values, context.masks[spec.window], spec.scaling, self.arch.attention_softcap)
        return out.view(rows, kv_heads, groups, width, head_dim).permute(0, 3, 1, 2, 4).reshape(rows * width, self.heads, head_dim)
