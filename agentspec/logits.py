"""The logits pipeline, applied position by position during verification and plain decoding alike.

For P verified positions the target returns logits ``[P, V]``. Row ``i`` scores the token after
``committed + draft[:i]``, so every history-dependent step (the repetition penalty) must see exactly
that prefix. Order, as in transformers' ``generate``: repetition penalty → temperature → top-k →
top-p → min-p, with the grammar mask (structured output) applied right after the penalty. Greedy
decoding is the argmax after penalty and mask (the later steps keep the argmax).

The engine's verification and a draft model's proposals share it (a draft samples under the same
processors as its target), so it sits below both.

Shape letters: P positions, V vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .params import GenerationParams

__all__ = ["LogitsPipeline"]


class LogitsPipeline:
    """One request's logits processing. ``observe`` committed tokens; call on each verify pass."""

    def __init__(self, params: GenerationParams, vocab_size: int, device: torch.device) -> None:
        self.params = params
        self.vocab_size = vocab_size
        # presence: [V] bool, tokens in the prompt and the committed output (for the penalty)
        self.presence = torch.zeros(vocab_size, dtype=torch.bool, device=device) if params.repetition_penalty != 1.0 else None

    def observe(self, token_ids: Sequence[int]) -> None:
        if self.presence is not None and token_ids:
            self.presence[torch.as_tensor(list(token_ids), device=self.presence.device)] = True

    def _penalize(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:
        # logits: [P, V]; draft: P - 1 tokens; row i sees committed + draft[:i]
        if self.presence is None:
            return logits
        seen = self.presence.expand_as(logits).clone()  # [P, V]
        for i, token in enumerate(draft):
            seen[i + 1 :, token] = True
        penalty = self.params.repetition_penalty
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        return torch.where(seen, penalized, logits)

    def _constrain(self, logits: torch.Tensor, draft: Sequence[int], masks: torch.Tensor | None) -> torch.Tensor:
        # masks: [P, V] bool, the grammar's allowed tokens at each position (None: unconstrained)
        logits = self._penalize(logits.float(), draft)
        return logits if masks is None else logits.masked_fill(~masks, float("-inf"))

    def greedy(self, logits: torch.Tensor, draft: Sequence[int], masks: torch.Tensor | None = None) -> torch.Tensor:
        """[P, V] logits → [P] greedy tokens."""
        return self._constrain(logits, draft, masks).argmax(dim=-1)

    def probs(self, logits: torch.Tensor, draft: Sequence[int], masks: torch.Tensor | None = None) -> torch.Tensor:
        """[P, V] logits → [P, V] sampling distributions (filtered, renormalised)."""
        p = self.params
        logits = self._constrain(logits, draft, masks) / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # drop a token once the mass before it already reaches top_p (the top token always stays)
            drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        if p.min_p > 0.0:
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        return logits.softmax(dim=-1)
