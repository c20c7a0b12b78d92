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

from ..passes.arch import head_dim

__all__ = ["KVLayout", "KVBlock"]


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's keys and values in a model: layers × (key, value) × kv heads × head dim,
    keys stored as ``dtype`` (the model's, or the one its target pass is meant for: ``pass_layout``)
    and values as ``value_dtype`` (None: ``dtype`` too)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    value_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, model: Any) -> "KVLayout":
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        weight = model.get_output_embeddings().weight
        # a GGUF file's module tree keeps its weights in the file (meta device) and runs on the CPU
        device = torch.device("cpu") if weight.device.type == "meta" else weight.device
        return cls(config.num_hidden_layers, kv_heads, head_dim(config), weight.dtype, device)

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The keys' dtype and the values'."""
        return self.dtype, self.value_dtype or self.dtype

    def with_dtype(self, dtype: torch.dtype, value_dtype: torch.dtype | None = None) -> "KVLayout":
        """The same layout, its keys stored as ``dtype`` and its values as ``value_dtype`` (default:
        ``dtype``): a pass's ``kv_dtypes``."""
        return dataclasses.replace(self, dtype=dtype, value_dtype=None if value_dtype in (None, dtype) else value_dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * sum(torch.finfo(d).bits for d in self.dtypes) // 8


class KVBlock:
    """One sequence's keys and values: ``length`` valid tokens, room for more (grown in chunks)."""

    GROWTH = 256  # tokens added per reallocation

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.length = 0
        self.keys: torch.Tensor | None = None  # [layers, kv_heads, capacity, head_dim], layout.dtypes[0]
        self.values: torch.Tensor | None = None  # the same shape, layout.dtypes[1]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """The memory this block takes: its allocation; for a view of a slot of a pool allocated once
        (``static.py``), what its tokens fill (the pool's size does not change as requests come and go)."""
        if self.keys is None or self.values is None:
            return 0
        allocated = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        if self.keys.untyped_storage().nbytes() > self.keys.numel() * self.keys.element_size():  # a view of a larger pool
            return self.length * self.layout.bytes_per_token
        return allocated

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` more after ``length``."""
        needed = self.length + tokens
        if needed <= self.capacity:
            return
        capacity = -(-needed // self.GROWTH) * self.GROWTH
        layout = self.layout
        shape = (layout.layers, layout.kv_heads, capacity, layout.head_dim)
        keys, values = (torch.empty(shape, dtype=dtype, device=layout.device) for dtype in layout.dtypes)
        if self.keys is not None and self.values is not None and self.length:
            keys[:, :, : self.length].copy_(self.keys[:, :, : self.length])
            values[:, :, : self.length].copy_(self.values[:, :, : self.length])
        self.keys, self.values = keys, values

    def pad(self, tokens: int) -> None:
        """Append ``tokens`` keys and values of zeros: a past of that length whose contents do not
        matter (calibration times passes over it; attention costs the same whatever it reads)."""
        self.reserve(tokens)
        assert self.keys is not None and self.values is not None
        self.keys[:, :, self.length : self.length + tokens].zero_()
        self.values[:, :, self.length : self.length + tokens].zero_()
        self.length += tokens

    def copy_prefix(self, source: "KVBlock", tokens: int) -> None:
        """Start with the first ``tokens`` keys/values of ``source`` (prefix reuse)."""
        self.length = 0
        self.reserve(tokens)
        assert self.keys is not None and self.values is not None and source.keys is not None and source.values is not None
        self.keys[:, :, :tokens].copy_(source.keys[:, :, :tokens])
        self.values[:, :, :tokens].copy_(source.values[:, :, :tokens])
        self.length = tokens
