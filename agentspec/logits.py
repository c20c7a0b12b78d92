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


# top-p looks for the nucleus among this many most likely tokens first, then eight times as many, up
# to the whole vocabulary (sorting all 49,152 of SmolLM2's took ~3.5 ms a position; the top 256 ~0.1)
NUCLEUS_FIRST = 256


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[P, V] logits → [P, V] bool: the tokens top-p keeps. In order of probability, a token is
    dropped once the mass before it reaches ``top_p`` (the top token always stays): the kept tokens
    are a prefix of that order, found among the ``k`` most likely once the mass before the k-th
    reaches ``top_p`` (every later token's is larger), k growing until it does or is the vocabulary.
    Each row alone: which of equally likely tokens at the edge a search keeps depends on its k, so a
    row's must not depend on the other rows of its pass (a verification's rows against plain decoding's one)."""
    probs = logits.softmax(dim=-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    vocab = probs.shape[-1]
    for row, kept in zip(probs, keep):
        k = min(NUCLEUS_FIRST, vocab)
        while True:
            top, order = torch.topk(row, k)  # descending
            before = top.cumsum(dim=0) - top  # the mass before each
            if k == vocab or bool(before[-1] >= top_p):
                break
            k = min(vocab, k * 8)
        kept[order] = before < top_p
    return keep


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
            logits = logits.masked_fill(~_nucleus(logits, p.top_p), float("-inf"))
        if p.min_p > 0.0:
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        return logits.softmax(dim=-1)
