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

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..engine.kv import KVBlock, KVLayout

__all__ = [
    "PackedRow", "PackedInputs", "Segment", "pack_rows", "finish_rows", "wants_features", "store_kv", "attend",
    "forward_packed", "check_packed", "use_packed_attention", "PACKED_ATTENTION", "PassFunction", "sdpa",
]

PACKED_ATTENTION = "agentspec_packed"
# A target pass: rows in, each row's kept logits out (``forward_packed`` of a model, or a fused pass).
PassFunction = Callable[[Sequence["PackedRow"]], list[torch.Tensor]]
_local = threading.local()  # the packed pass running on this thread, if any


@dataclass
class PackedRow:
    """One sequence's part of a packed pass: its new tokens, how many positions before the last
    ``pad`` ones need logits, and ``pad`` trailing filler positions (whose keys/values are dropped).

    features: ask the pass for the row's features — the final normed hidden states, what the LM
    head reads — of all its new tokens; the pass leaves them [len(tokens), H] in ``hidden``.
    """

    block: KVBlock
    tokens: list[int]
    logits: int
    pad: int = 0
    features: bool = False
    hidden: torch.Tensor | None = None


class Segment:
    """One row's new tokens in a packed pass: ``[start, stop)`` of the pass's tokens, written to its
    block after ``past`` keys/values, with their causal mask (one query group per row) if several."""

    __slots__ = ("block", "start", "stop", "past", "mask")

    def __init__(self, block: KVBlock, start: int, stop: int, groups: int) -> None:
        self.block, self.start, self.stop, self.past = block, start, stop, block.length
        new = stop - start
        self.mask: torch.Tensor | None = None
        if new > 1:  # query i sees the past and new tokens up to itself; tiled once per query group
            keys = torch.arange(self.past + new, device=block.layout.device)
            queries = torch.arange(new, device=block.layout.device) + self.past
            self.mask = (keys[None, :] <= queries[:, None]).repeat(groups, 1)


@dataclass
class PackedInputs:
    """A packed pass's inputs: every row's new tokens in one row, their positions, the positions
    whose logits are kept, and each row's segment."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    keep: torch.Tensor  # [sum of row.logits]
    segments: list[Segment]


def pack_rows(rows: Sequence[PackedRow], groups: int) -> PackedInputs:
    """Lay ``rows`` out as one pass (``groups``: query heads per key/value head), reserving room in
    each row's block for its new tokens."""
    device = rows[0].block.layout.device
    ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    segments = []
    for row in rows:
        new = len(row.tokens)
        row.block.reserve(new)
        start = len(ids)
        segments.append(Segment(row.block, start, start + new, groups))
        ids.extend(row.tokens)
        positions.extend(range(row.block.length, row.block.length + new))
        keep.extend(range(start + new - row.pad - row.logits, start + new - row.pad))
    return PackedInputs(
        torch.tensor([ids], device=device),
        torch.tensor([positions], device=device),
        torch.tensor(keep, dtype=torch.long, device=device),
        segments,
    )


def finish_rows(rows: Sequence[PackedRow], logits: torch.Tensor, normed: torch.Tensor | None = None) -> list[torch.Tensor]:
    """After a pass: advance each row's block by its tokens; split the kept logits by row; give the
    rows that ask for features theirs from ``normed`` [T, H] (every token's final normed hidden)."""
    start = 0
    for row in rows:
        if row.features:
            assert normed is not None, "this pass computed no features"
            row.hidden = normed[start : start + len(row.tokens)]
        start += len(row.tokens)
        row.block.length += len(row.tokens)
    return list(torch.split(logits, [row.logits for row in rows]))


def wants_features(rows: Sequence[PackedRow]) -> bool:
    """Whether any row asks for its features."""
    return any(row.features for row in rows)


def store_kv(segments: list[Segment], layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write a layer's new keys and values ([1, kv_heads, T, head_dim]) into each row's block."""
    for seg in segments:
        end = seg.past + seg.stop - seg.start
        assert seg.block.keys is not None and seg.block.values is not None
        seg.block.keys[layer, :, seg.past : end] = keys[0, :, seg.start : seg.stop]
        seg.block.values[layer, :, seg.past : end] = values[0, :, seg.start : seg.stop]


def attend(
    segments: list[Segment], layer: int, query: torch.Tensor, scaling: float | None, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Causal attention of each row's queries ([1, heads, T, head_dim]) over its own block's keys and
    values (stored first), within the last ``window`` positions where a window is given, scores
    soft-capped by ``softcap`` where given; returns [1, T, heads, head_dim]."""
    heads, head_dim = query.shape[1], query.shape[3]
    outputs = []
    for seg in segments:
        new = seg.stop - seg.start
        end = seg.past + new
        assert seg.block.keys is not None and seg.block.values is not None
        kv_heads = seg.block.keys.shape[1]
        groups = heads // kv_heads
        keys, values = seg.block.keys[layer, :, :end].unsqueeze(0), seg.block.values[layer, :, :end].unsqueeze(0)
        # Grouped-query attention without copying keys: the query heads sharing a kv head become rows.
        q = query[:, :, seg.start : seg.stop].reshape(1, kv_heads, groups * new, head_dim)
        mask = seg.mask
        if window is not None and end > window:
            positions = torch.arange(new, device=query.device) + seg.past
            keys_at = torch.arange(end, device=query.device)
            mask = ((keys_at[None, :] <= positions[:, None]) & (keys_at[None, :] > positions[:, None] - window)).repeat(groups, 1)
        out = sdpa(q, keys, values, mask, scaling, softcap)
        outputs.append(out.reshape(1, heads, new, head_dim))
    attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return attn.transpose(1, 2).contiguous()


# Fewest query rows a CPU float32 attention product runs with: MKL multiplies 1–3 rows with other
# kernels (another summation order) than 4 or more; from 4 rows to 64 and beyond, over 5–1500 keys,
# a row's result is the same bits whatever shares the call (measured here, 1 and 2 threads).
MIN_ATTENTION_ROWS = 4


def sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float | None, softcap: float | None = None
) -> torch.Tensor:
    """Scaled dot-product attention whose result for a query does not depend on how many queries
    share the call. On a CPU in float32, torch's fused (flash) kernel blocks queries by their number
    (measured: a query's output changes once a call has 4 or more positions), so there attention is
    written out — scores, mask, softmax, weighted sum: every query a row of the same two products —
    with at least ``MIN_ATTENTION_ROWS`` rows (a plain step's 3 query heads per key head get a copy
    of the last), so every pass shape rounds a position alike, as verification needs
    (``tests/test_weights.py``). This is torch's math kernel without its dispatch around it, a
    call's fixed cost being most of a small model's attention. Elsewhere (CUDA, reduced precision: not the default on a CPU) the fused kernel
    runs as it is, except with ``softcap`` (Gemma 2: scores → tanh(scores / cap) · cap before the
    mask), which only the written-out form computes."""
    invariant = query.device.type == "cpu" and query.dtype == torch.float32
    if invariant or softcap is not None:
        rows = query.shape[-2]
        if invariant and rows < MIN_ATTENTION_ROWS:
            extra = MIN_ATTENTION_ROWS - rows
            query = torch.cat([query, query[..., -1:, :].expand(*query.shape[:-2], extra, query.shape[-1])], dim=-2)
            if mask is not None:
                mask = torch.cat([mask, mask[..., -1:, :].expand(*mask.shape[:-2], extra, mask.shape[-1])], dim=-2)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(scale)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(weights, values)[..., :rows, :]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)


class _PackedCache:
    """What the model sees as its cache during a packed pass: writes each row's new keys/values into
    its block. Attention then reads the blocks (``_packed_attention``), not what this returns."""

    is_compileable = False

    def __init__(self, segments: list[Segment], layers: int) -> None:
        self.segments = segments
        self.is_sliding = [False] * layers
        self.is_linear = [False] * layers
        self.is_dummy = [False] * layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        store_kv(self.segments, layer_idx, key_states, value_states)
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
    segments: list[Segment] | None = getattr(_local, "segments", None)
    softcap = kwargs.get("softcap")
    if segments is None:  # not a packed pass: exactly transformers' sdpa (which has no soft-capping: then written out)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return _softcapped_attention(query, key, value, attention_mask, kwargs.get("scaling"), softcap), None
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("packed attention has no attention sinks")
    return attend(segments, module.layer_idx, query, kwargs.get("scaling"), kwargs.get("sliding_window"), softcap), None


def _softcapped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None, softcap: float
) -> torch.Tensor:
    """transformers' eager attention with soft-capped scores (Gemma 2), for a model's own forward:
    [B, heads, T, D] queries over [B, kv_heads, S, D] keys/values with its boolean or additive
    mask; [B, T, heads, D] out."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:  # sdpa_mask leaves a plain causal mask to the kernel: queries are the last of the keys
        queries, keys = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(queries, keys, dtype=torch.bool, device=scores.device).tril(keys - queries)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask[..., : key.shape[-2]]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


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
    config = model.config
    if getattr(config, "_attn_implementation", None) != PACKED_ATTENTION:  # it would attend without the past
        raise RuntimeError("forward_packed needs the packed attention: call use_packed_attention(model) first.")
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    inputs = pack_rows(rows, groups)
    _local.segments = inputs.segments
    normed: list[torch.Tensor] = []
    # The final norm's output over every token is what the LM head reads: the features.
    hook = model.get_decoder().norm.register_forward_hook(lambda module, args, out: normed.append(out[0])) if wants_features(rows) else None
    try:
        logits = model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            cache=_PackedCache(inputs.segments, rows[0].block.layout.layers),
            use_cache=True,
            logits_to_keep=inputs.keep,
        ).logits[0]
    finally:
        _local.segments = None
        if hook is not None:
            hook.remove()
    return finish_rows(rows, logits, normed[0] if normed else None)


@torch.inference_mode()
def check_packed(model: Any, layout: KVLayout, tolerance: float | None = None, forward: PassFunction | None = None) -> float:
    """Largest logit difference between packed passes (two sequences, prefill then verification) and
    the model's own forward on the same tokens; raises ``NotImplementedError`` past ``tolerance``.
    ``forward`` is the pass to check (default: ``forward_packed`` of ``model``)."""
    run = forward or functools.partial(forward_packed, model)
    tolerance = tolerance if tolerance is not None else (1e-3 if layout.dtype == torch.float32 else 0.1)
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (11, 7)]
    reference = [model(input_ids=torch.tensor([t], device=layout.device)).logits[0, -4:].float() for t in texts]
    blocks = [KVBlock(layout), KVBlock(layout)]
    run([PackedRow(blocks[0], texts[0][:5], 1), PackedRow(blocks[1], texts[1][:2], 1)])
    run([PackedRow(blocks[1], texts[1][2:], 4), PackedRow(blocks[0], texts[0][5:], 4)])
    blocks[0].length -= 2  # rollbacks: the last tokens again, now as a verification
    blocks[1].length -= 1
    second, first = run([PackedRow(blocks[1], texts[1][-1:], 1), PackedRow(blocks[0], texts[0][-2:], 2)])
    difference = max(
        (second[-1].float() - reference[1][-1]).abs().max().item(),
        (first.float() - reference[0][-2:]).abs().max().item(),
    )
    if not difference <= tolerance:
        raise NotImplementedError(f"packed passes differ from the model's own forward by {difference:.3g}")
    return difference
