"""Draft verification: pure functions on tensors (no model, no cache, no asyncio).

Glossary for one step with K draft tokens:
- **accepted**: the longest draft prefix the target agrees with (greedy) or keeps (sampling);
- **recovered**: the token the target puts at the first rejected position;
- **bonus**: the token sampled after all K were accepted (the target's K+1-th position).
Every step commits ``accepted + [recovered or bonus]``: at least one token, at most K + 1.

Shape letters: K draft tokens, V vocabulary.
"""

from __future__ import annotations

import torch

__all__ = ["verify_greedy", "verify_sampling"]


def verify_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy verification.

    target_tokens: [K+1] the target's argmax at each position; draft_tokens: [K].
    Returns (number accepted, the recovered or bonus token).
    """
    k = draft_tokens.shape[0]
    mismatch = (target_tokens[:k] != draft_tokens).nonzero()
    accepted = int(mismatch[0]) if mismatch.numel() else k
    return accepted, int(target_tokens[accepted])


def verify_sampling(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection sampling (Leviathan et al. 2023, Algorithm 1): output ~ the target distribution.

    target_probs: [K+1, V] the target's processed distributions; draft_tokens: [K];
    draft_probs: [K, V] the drafter's distributions, or None for deterministic (one-hot) drafts.
    Random draws, in order: K uniforms, then one categorical sample.
    Returns (number accepted, the recovered or bonus token).
    """
    k = draft_tokens.shape[0]
    positions = torch.arange(k, device=target_probs.device)
    p_draft = target_probs[positions, draft_tokens]  # [K] p(x_i)
    q_draft = draft_probs[positions, draft_tokens] if draft_probs is not None else torch.ones_like(p_draft)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device)
    # accept x_i with probability min(1, p(x_i) / q(x_i))
    rejected = (uniforms * q_draft >= p_draft).nonzero()
    accepted = int(rejected[0]) if rejected.numel() else k
    if accepted == k:
        distribution = target_probs[k]  # bonus token
    else:
        # recovered token ~ norm(max(p - q, 0)); with one-hot q that is p without the draft token
        if draft_probs is None:
            residual = target_probs[accepted].clone()
            residual[draft_tokens[accepted]] = 0.0
        else:
            residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0.0)
        total = residual.sum()
        distribution = residual / total if total > 0 else target_probs[accepted]
    token = torch.multinomial(distribution, 1, generator=generator)
    return accepted, int(token)
