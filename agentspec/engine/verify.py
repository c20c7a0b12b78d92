"""Draft verification: pure functions on tensors (no model, no cache, no asyncio).

Glossary for one sequence's part of a pass with K draft tokens:
- **accepted**: the longest draft prefix the target agrees with (greedy) or keeps (sampling);
- **recovered**: the token the target puts at the first rejected position;
- **bonus**: the token sampled after all K were accepted (the target's K+1-th position).
Every sequence commits ``accepted + [recovered or bonus]``: at least one token, at most K + 1.

A pass verifies many sequences at once, flattened as vLLM's rejection sampler does: sequence s owns
``counts[s] + 1`` consecutive rows (its K_s draft positions, then its bonus position), T rows in all.
``draft_tokens`` holds -1 at every bonus row. Both verifiers return tensors (no host
synchronisation): the caller reads every sequence's verdict with one transfer.

Shape letters: S sequences, T rows (sum of K_s + 1), V vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["NO_TOKEN", "draft_distributions", "flatten", "verify_greedy", "verify_sampling"]

NO_TOKEN = -1  # the draft token at a bonus row: nothing is proposed there


def _first_stop(stop: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per sequence, the offset of its first row where ``stop`` holds (its bonus row always does).

    stop: [T] bool; counts: [S] draft lengths K_s. Returns [S] offsets in 0..K_s.
    """
    rows = counts + 1
    segment = torch.repeat_interleave(torch.arange(rows.shape[0], device=stop.device), rows)  # [T]
    starts = torch.cumsum(rows, 0) - rows  # [S]
    offset = torch.arange(stop.shape[0], device=stop.device) - starts[segment]  # [T]
    candidates = torch.where(stop, offset, counts[segment])  # not a stop: no earlier than the bonus row
    return torch.full_like(counts, torch.iinfo(counts.dtype).max).scatter_reduce(0, segment, candidates, "amin")


def verify_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while the target's argmax equals the draft token.

    target_tokens: [T] the target's (processed) argmax at every row; draft_tokens: [T] (-1 at bonus
    rows); counts: [S] draft lengths. Returns ([S] number accepted, [S] the recovered or bonus token).
    """
    accepted = _first_stop(target_tokens != draft_tokens, counts)
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)
    return accepted, target_tokens[starts + accepted]


def flatten(drafts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Many sequences' draft tokens as a pass's rows: ([T] each draft then NO_TOKEN at its bonus
    row, [S] draft lengths)."""
    rows = [token for draft in drafts for token in (*draft, NO_TOKEN)]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)


def draft_distributions(draft_tokens: torch.Tensor, probs: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """One sequence's draft distributions, a row per verified position: [K+1, V].

    draft_tokens: [K]; probs: [M, V] the drafter's distributions of the last M draft tokens (a draft
    model's), None when all are deterministic. Deterministic tokens (grammar, n-gram, cache) are
    one-hot rows; the bonus row is all zeros (nothing was proposed there).
    """
    k = draft_tokens.shape[0]
    rows = torch.zeros(k + 1, vocab, device=draft_tokens.device)
    rows[torch.arange(k, device=draft_tokens.device), draft_tokens] = 1.0
    if probs is not None and probs.shape[0]:
        rows[k - probs.shape[0] : k] = probs.to(rows.dtype)
    return rows


def verify_sampling(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling (Leviathan et al. 2023, Algorithm 1): every output ~ the target distribution.

    target_probs: [T, V] the target's processed distributions; draft_tokens: [T] (-1 at bonus rows);
    draft_probs: [T, V] the drafts' distributions (``draft_distributions``: one-hot for
    deterministic drafts); uniforms: [T] independent U[0, 1) draws; counts: [S] draft lengths.

    Draft token i is accepted iff ``uniforms[i] * q(x_i) < p(x_i)`` (probability min(1, p/q)). At
    the first rejected row the recovered token is drawn from norm(max(p - q, 0)) — with one-hot q,
    p without the draft token — and after K accepted tokens the bonus token from p. That draw is an
    inverse-CDF lookup with the sequence's last uniform (its bonus row's, never used by a test).
    Returns ([S] number accepted, [S] the recovered or bonus token).
    """
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    bonus = draft_tokens == NO_TOKEN
    proposed = draft_tokens.clamp_min(0)
    p_draft, q_draft = target_probs[rows, proposed], draft_probs[rows, proposed]  # [T]
    accepted = _first_stop(bonus | (uniforms * q_draft >= p_draft), counts)
    ends = torch.cumsum(counts + 1, 0) - 1  # [S] each sequence's bonus row
    stop = ends - counts + accepted  # [S] the row whose token is drawn
    target = target_probs[stop]  # [S, V]
    residual = (target - draft_probs[stop]).clamp_min(0.0)  # the bonus row's q is zero: p itself
    mass = residual.sum(dim=-1, keepdim=True)
    distribution = torch.where(mass > 0, residual, target)  # p = q exactly: nothing to recover from
    cdf = distribution.cumsum(dim=-1)
    threshold = uniforms[ends].unsqueeze(-1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    last = (distribution > 0).cumsum(dim=-1).argmax(dim=-1)  # a rounded-up threshold stays on a possible token
    return accepted, torch.minimum(tokens, last)
