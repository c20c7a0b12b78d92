"""One target pass over the new tokens of many sequences, each with its own keys/values.

``forward_packed`` runs the new tokens of any number of sequences — a prefill chunk, one plain token,
a verification of K drafts — packed into ONE row of one target pass: the linear layers (almost all of
the cost of a small model) see every token at once, and attention runs per sequence over that
sequence's own block. Rows have their own positions, lengths and draft lengths; there is no padding
between them and no per-row cache copy. This is continuous batching: sequences join and leave between
passes.

It plugs into any transformers model that calls attention through ``AttentionInterface`` and writes
keys/values with ``cache.update`` (Llama, Qwen2/3, Mistral, Phi-3, Gemma, SmolLM and most others): the
model runs with the ``agentspec_packed`` attention, which behaves exactly like ``sdpa`` unless a packed
pass is running on the calling thread — so the same model object still serves ``generate`` and draft
models. ``check_packed`` compares a packed pass against the model's own forward once at start-up and
refuses a model it would get wrong.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .kv import KVBlock, KVLayout

__all__ = ["PackedRow", "forward_packed", "check_packed", "use_packed_attention", "PACKED_ATTENTION"]

PACKED_ATTENTION = "agentspec_packed"
_local = threading.local()  # the packed pass running on this thread, if any


@dataclass
class PackedRow:
    """One sequence's part of a packed pass: its new tokens, how many positions before the last
    ``pad`` ones need logits, and ``pad`` trailing filler positions (whose keys/values are dropped)."""

    block: KVBlock
    tokens: list[int]
    logits: int
    pad: int = 0


class _Segment:
    __slots__ = ("block", "start", "stop", "past", "mask")

    def __init__(self, block: KVBlock, start: int, stop: int, groups: int) -> None:
        self.block, self.start, self.stop, self.past = block, start, stop, block.length
        new = stop - start
        self.mask: torch.Tensor | None = None
        if new > 1:  # query i sees the past and new tokens up to itself; tiled once per query group
            keys = torch.arange(self.past + new, device=block.layout.device)
            queries = torch.arange(new, device=block.layout.device) + self.past
            self.mask = (keys[None, :] <= queries[:, None]).repeat(groups, 1)


class _PackedCache:
    """What the model sees as its cache during a packed pass: writes each row's new keys/values into
    its block. Attention then reads the blocks (``_packed_attention``), not what this returns."""

    is_compileable = False

    def __init__(self, segments: list[_Segment], layers: int) -> None:
        self.segments = segments
        self.is_sliding = [False] * layers
        self.is_linear = [False] * layers
        self.is_dummy = [False] * layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        for seg in self.segments:
            end = seg.past + seg.stop - seg.start
            assert seg.block.data is not None
            seg.block.data[layer_idx, 0, :, seg.past : end] = key_states[0, :, seg.start : seg.stop]
            seg.block.data[layer_idx, 1, :, seg.past : end] = value_states[0, :, seg.start : seg.stop]
        return key_states, value_states

    # Asked by transformers' mask preparation; the packed attention needs no mask from it.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[int, int]:
        length = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return length, 0


def _packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any):
    segments: list[_Segment] | None = getattr(_local, "segments", None)
    if segments is None:  # not a packed pass: exactly transformers' sdpa
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("packed attention supports neither logit soft-capping nor attention sinks")
    window = kwargs.get("sliding_window")
    layer = module.layer_idx
    heads, head_dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    outputs = []
    for seg in segments:
        new = seg.stop - seg.start
        end = seg.past + new
        data = seg.block.data
        assert data is not None
        keys, values = data[layer, 0, :, :end].unsqueeze(0), data[layer, 1, :, :end].unsqueeze(0)
        # Grouped-query attention without copying keys: the query heads sharing a kv head become rows.
        q = query[:, :, seg.start : seg.stop].reshape(1, kv_heads, groups * new, head_dim)
        mask = seg.mask
        if window is not None and end > window:
            positions = torch.arange(new, device=query.device) + seg.past
            keys_at = torch.arange(end, device=query.device)
            mask = ((keys_at[None, :] <= positions[:, None]) & (keys_at[None, :] > positions[:, None] - window)).repeat(groups, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=kwargs.get("scaling"))
        outputs.append(out.reshape(1, heads, new, head_dim))
    attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return attn.transpose(1, 2).contiguous(), None


def _packed_mask(*args: Any, **kwargs: Any) -> Any:
    if getattr(_local, "segments", None) is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


_registered = False
_register_lock = threading.Lock()


def use_packed_attention(model: Any) -> None:
    """Switch ``model`` to the packed attention (sdpa outside packed passes). Idempotent."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _register_lock:
        if not _registered:
            AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
            AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)
            _registered = True
    config = model.config
    if getattr(config, "_attn_implementation", None) != PACKED_ATTENTION:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(PACKED_ATTENTION)
        else:  # pragma: no cover - older transformers
            config._attn_implementation = PACKED_ATTENTION


def forward_packed(model: Any, rows: Sequence[PackedRow]) -> list[torch.Tensor]:
    """One target pass over every row's new tokens. Returns each row's logits for its last
    ``row.logits`` positions ([row.logits, V]) and advances each block's length by its tokens."""
    layout = rows[0].block.layout
    device = layout.device
    ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    segments = []
    config = model.config
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    for row in rows:
        new = len(row.tokens)
        row.block.reserve(new)
        start = len(ids)
        segments.append(_Segment(row.block, start, start + new, groups))
        ids.extend(row.tokens)
        positions.extend(range(row.block.length, row.block.length + new))
        keep.extend(range(start + new - row.pad - row.logits, start + new - row.pad))
    input_ids = torch.tensor([ids], device=device)
    position_ids = torch.tensor([positions], device=device)
    keep_index = torch.tensor(keep, dtype=torch.long, device=device)
    _local.segments = segments
    try:
        logits = model(
            input_ids=input_ids,
            position_ids=position_ids,
            cache=_PackedCache(segments, layout.layers),
            use_cache=True,
            logits_to_keep=keep_index,
        ).logits[0]
    finally:
        _local.segments = None
    for row in rows:
        row.block.length += len(row.tokens)
    return list(torch.split(logits, [row.logits for row in rows]))


@torch.inference_mode()
def check_packed(model: Any, layout: KVLayout, tolerance: float | None = None) -> float:
    """Largest logit difference between packed passes (two sequences, prefill then verification) and
    the model's own forward on the same tokens; raises ``NotImplementedError`` past ``tolerance``."""
    tolerance = tolerance if tolerance is not None else (1e-3 if layout.dtype == torch.float32 else 0.1)
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (11, 7)]
    reference = [model(input_ids=torch.tensor([t], device=layout.device)).logits[0, -4:].float() for t in texts]
    blocks = [KVBlock(layout), KVBlock(layout)]
    forward_packed(model, [PackedRow(blocks[0], texts[0][:5], 1), PackedRow(blocks[1], texts[1][:2], 1)])
    forward_packed(model, [PackedRow(blocks[1], texts[1][2:], 4), PackedRow(blocks[0], texts[0][5:], 4)])
    blocks[0].length -= 2  # rollbacks: the last tokens again, now as a verification
    blocks[1].length -= 1
    second, first = forward_packed(model, [PackedRow(blocks[1], texts[1][-1:], 1), PackedRow(blocks[0], texts[0][-2:], 2)])
    difference = max(
        (second[-1].float() - reference[1][-1]).abs().max().item(),
        (first.float() - reference[0][-2:]).abs().max().item(),
    )
    if not difference <= tolerance:
        raise NotImplementedError(f"packed attention differs from the model's own attention by {difference:.3g}")
    return difference
