"""Draft verification: pure functions on tensors, and greedy verification also on the host's lists
(no model, no cache, no asyncio).

Glossary for one sequence's part of a pass with K draft tokens:
- **accepted**: the longest draft prefix equal to the target's own tokens there: its argmax
  (greedy) or its seeded draw at that output position (sampling);
- **recovered**: the target's token at the first rejected position;
- **bonus**: the target's token after all K were accepted (its K+1-th position).
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

from ..sampling import sample

__all__ = ["NO_TOKEN", "flatten", "verify_greedy", "verify_greedy_rows", "verify_sampling"]

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


def verify_greedy_rows(target_tokens: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``verify_greedy`` on the host, one sequence at a time: each sequence's (number accepted, the
    recovered or bonus token).

    target_tokens: the target's argmax at every row of the pass, flattened as ``flatten`` lays out
    ``drafts`` (each draft's rows, then its bonus row). On a CPU a pass has a few rows, and a loop
    over them costs a few microseconds where the vectorised form's dozen tensor operations, each run
    after the pass has streamed the weights through the caches, cost a quarter of a millisecond.
    """
    rows = sum(len(draft) + 1 for draft in drafts)
    if rows != len(target_tokens):
        raise ValueError(f"the drafts lay out {rows} rows; the pass has {len(target_tokens)}")
    verdicts = []
    at = 0
    for draft in drafts:
        accepted = 0
        while accepted < len(draft) and target_tokens[at + accepted] == draft[accepted]:
            accepted += 1
        verdicts.append((accepted, target_tokens[at + accepted]))
        at += len(draft) + 1
    return verdicts


def flatten(drafts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Many sequences' draft tokens as a pass's rows: ([T] each draft then NO_TOKEN at its bonus
    row, [S] draft lengths)."""
    rows = [token for draft in drafts for token in (*draft, NO_TOKEN)]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)


def verify_sampling(target_probs: torch.Tensor, draft_tokens: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded sampling verification: draw the target's token at every row, accept while it equals the draft.

    target_probs: [T, V] the target's processed distributions; draft_tokens: [T] (-1 at bonus rows);
    keys: [T] each row's noise key, from the request's seed and the row's output position
    (``agentspec.sampling.position_keys``); counts: [S] draft lengths.

    Row t's token is ``sample``'s exponential race on p_t with key t, which depends on nothing but
    (seed, position): a draft token is accepted iff it is the token plain sampling would draw there,
    and the first row that differs (or the bonus row) commits that draw. So the committed tokens are
    plain sampling's, token for token, whatever was drafted, and each is distributed as p.
    Returns ([S] number accepted, [S] the recovered or bonus token).
    """
    return verify_greedy(sample(target_probs, keys), draft_tokens, counts)
