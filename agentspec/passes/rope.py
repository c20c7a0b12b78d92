"""LongRoPE (Phi-3.5, Phi-4-mini) with its table chosen per position, so that every pass agrees.

A LongRoPE model has two tables of rotary frequencies: ``short_factor`` for contexts within the one it
was pretrained on (``original_max_position_embeddings``, 4,096 for Phi-3.5 and Phi-4-mini) and
``long_factor`` beyond it. transformers picks one for a whole forward call by its largest position
(``dynamic_rope_update``); llama.cpp picks one for the whole context by its size. Either way the
angles of a position depend on what else is in the call: a verification pass over positions 4,090 to
4,098 would rotate 4,090 with the long table where plain decoding rotated it with the short one, and
speculative decoding would stop matching plain decoding.

``PositionwiseLongRope`` decides by the position alone: below the original context the short table,
from it on the long one — what transformers computes when it decodes a token at a time (every key
then keeps the table of the call that wrote it) and, within the original context, the same bits as
transformers' rotary embedding. ``pin_long_rope`` puts it in place of a model's ``rotary_emb``; every
pass (``fused.py``, ``blocks.py``, the eager and packed passes, early-exit drafts) computes its angles
through that module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PositionwiseLongRope", "pin_long_rope", "cos_sin"]


class PositionwiseLongRope(nn.Module):
    """cos/sin of the positions [B, T], each with the table of its own position (``original``: the
    first position of the long table), scaled by the model's attention factor, as transformers'
    rotary embeddings compute them."""

    def __init__(self, short: torch.Tensor, long: torch.Tensor, original: int, attention_scaling: float) -> None:
        super().__init__()
        if short.shape != long.shape:
            raise ValueError(f"LongRoPE's short and long tables differ in size: {tuple(short.shape)} against {tuple(long.shape)}")
        self.short = nn.Buffer(short.float(), persistent=False)
        self.long = nn.Buffer(long.float(), persistent=False)
        self.original, self.attention_scaling = int(original), float(attention_scaling)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The short table (what a model's ``rotary_emb.inv_freq`` holds before its first long call)."""
        return self.short

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = position_ids[..., None]
        table = torch.where(positions < self.original, self.short.to(x.device), self.long.to(x.device))
        return cos_sin(positions.float() * table, self.attention_scaling, x.dtype)


def cos_sin(freqs: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the angles ``freqs`` [..., dims / 2], each half of the head rotated by the same
    angles, times ``scaling``, in ``dtype``: as transformers' rotary embeddings finish."""
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def pin_long_rope(model: Any) -> bool:
    """Put ``PositionwiseLongRope`` in place of ``model.model.rotary_emb`` where the model's rotary
    embedding is LongRoPE (its tables as transformers computes them); whether it did."""
    body = getattr(model, "model", None)
    rotary = getattr(body, "rotary_emb", None)
    if rotary is None or isinstance(rotary, PositionwiseLongRope) or getattr(rotary, "rope_type", None) != "longrope":
        return False
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = model.config
    original = int(config.rope_parameters["original_max_position_embeddings"])
    compute = ROPE_INIT_FUNCTIONS["longrope"]
    short, scaling = compute(config, device=None)  # seq_len None: the short table
    long, _ = compute(config, device=None, seq_len=original + 1)
    body.rotary_emb = PositionwiseLongRope(short, long, original, scaling).to(rotary.original_inv_freq.device)
    return True
