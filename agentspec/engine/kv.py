"""Keys and values per sequence: ``KVLayout`` (what one token's take) and ``KVBlock`` (one sequence's).

Each sequence owns a ``KVBlock``: preallocated keys/values for every layer, with a length. Rolling a
rejected draft back is setting the length (the next pass overwrites the slots); nothing is copied.
The packed pass that writes and reads them is ``packed.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KVLayout", "KVBlock"]


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's keys and values in a model: layers × (key, value) × kv heads × head dim,
    stored as ``dtype`` (the model's, or the one its target pass is meant for: ``pass_layout``)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: Any) -> "KVLayout":
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        weight = model.get_output_embeddings().weight
        return cls(config.num_hidden_layers, kv_heads, head_dim, weight.dtype, weight.device)

    def with_dtype(self, dtype: torch.dtype) -> "KVLayout":
        """The same layout, its keys and values stored as ``dtype`` (a pass's ``kv_dtype``)."""
        return dataclasses.replace(self, dtype=dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class KVBlock:
    """One sequence's keys and values: ``length`` valid tokens, room for more (grown in chunks)."""

    GROWTH = 256  # tokens added per reallocation

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.length = 0
        self.data: torch.Tensor | None = None  # [layers, 2, kv_heads, capacity, head_dim]

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[3]

    @property
    def nbytes(self) -> int:
        """The memory this block takes: its allocation; for a view of a slot of a pool allocated once
        (``static.py``), what its tokens fill (the pool's size does not change as requests come and go)."""
        if self.data is None:
            return 0
        allocated = self.data.numel() * self.data.element_size()
        if self.data.untyped_storage().nbytes() > allocated:  # a view of a larger pool
            return self.length * self.layout.bytes_per_token
        return allocated

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` more after ``length``."""
        needed = self.length + tokens
        if needed <= self.capacity:
            return
        capacity = -(-needed // self.GROWTH) * self.GROWTH
        layout = self.layout
        data = torch.empty(
            (layout.layers, 2, layout.kv_heads, capacity, layout.head_dim), dtype=layout.dtype, device=layout.device
        )
        if self.data is not None and self.length:
            data[:, :, :, : self.length].copy_(self.data[:, :, :, : self.length])
        self.data = data

    def copy_prefix(self, source: "KVBlock", tokens: int) -> None:
        """Start with the first ``tokens`` keys/values of ``source`` (prefix reuse)."""
        self.length = 0
        self.reserve(tokens)
        assert self.data is not None and source.data is not None
        self.data[:, :, :, :tokens].copy_(source.data[:, :, :, :tokens])
        self.length = tokens
