"""Prefix reuse: keys/values of earlier sequences, for requests that start with the same tokens.

Agents resend a growing conversation every turn, and many requests share a system prompt and tool
section. When a sequence finishes, its keys/values (prompt and output) are kept here, bounded by
memory and evicted least recently used first. A new request copies the keys/values of its longest
common prefix with any kept sequence and prefills only the rest. The copy is a memory copy of the
keys/values, far cheaper than the prefill pass it replaces.

Entries carry the ``cache_salt`` of the request that made them (a tenant of ``agentspec serve``;
None for every request of an embedded client), and a request reuses only entries of its own salt:
how many prompt tokens came from the cache (``cached_prompt_tokens``) would otherwise tell one
tenant what another sent.

Keys/values depend only on the tokens before them, so a reused prefix decodes as a cold one does, up
to float rounding between pass shapes (the same as between a verification and a plain step).
"""

from __future__ import annotations

import collections

import torch

from .kv import KVBlock

__all__ = ["PrefixCache"]


class PrefixCache:
    """Kept sequences' keys/values, LRU within ``max_bytes``."""

    MIN_TOKENS = 16  # shorter common prefixes are not worth a lookup's bookkeeping

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[int, tuple[torch.Tensor, KVBlock, str | None]] = collections.OrderedDict()
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for _, block, _ in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def add(self, tokens: list[int], block: KVBlock, *, salt: str | None = None) -> None:
        """Keep ``block`` (whose first ``len(tokens)`` keys/values are those of ``tokens``) for requests
        of ``salt``; it is not copied, so its sequence must be done with it. Kept sequences of the same
        salt that are prefixes of it go."""
        if len(tokens) < self.MIN_TOKENS or block.nbytes > self.max_bytes:
            return
        ids = torch.tensor(tokens)
        for key, (kept, _, kept_salt) in list(self._entries.items()):
            if kept_salt == salt and len(kept) <= len(ids) and torch.equal(kept, ids[: len(kept)]):
                del self._entries[key]
        self._entries[self._next] = (ids, block, salt)
        self._next += 1
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)

    def fill(self, block: KVBlock, prompt: list[int], *, salt: str | None = None) -> int:
        """Copy into ``block`` the keys/values of the longest prefix of ``prompt`` kept for ``salt``
        (never its last token: its logits are needed). Returns how many tokens were filled in (0: a
        cold prefill)."""
        if not self._entries or len(prompt) <= self.MIN_TOKENS:
            return 0
        ids = torch.tensor(prompt[:-1])
        best_key, best = None, 0
        for key, (kept, _, kept_salt) in self._entries.items():
            if kept_salt != salt:
                continue
            n = min(len(kept), len(ids))
            same = (kept[:n] == ids[:n]).to(torch.int8)
            length = n if bool(same.all()) else int(same.argmin())
            if length > best:
                best_key, best = key, length
        if best < self.MIN_TOKENS or best_key is None:
            return 0
        self._entries.move_to_end(best_key)
        block.copy_prefix(self._entries[best_key][1], best)
        return best
