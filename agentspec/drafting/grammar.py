"""The grammar as a draft source: the text a structured-output grammar forces, drafted ahead.

Canonical forcing (``structured.grammar``) allows only the canonical tokens of forced text, so they
always verify. After them comes the token the look-back held back (the forced text's last token,
which the model may merge with the free text after it). It is proposed as the model last wrote its
bytes: compact JSON's ``":"`` is one canonical token, but the model writes ``":`` then ``"``.
``Spellings`` learns that from every request's output and is shared by an engine's requests.

A request's ``GrammarDrafter`` also keeps its grammar position: an ``int`` state after the committed
tokens. Every draft, whatever its source, is walked through the grammar and cut at the first token it
rejects (``walk``), and verification masks each position with the state after the draft tokens
before it (``masks``). Rolling a rejected draft back is keeping the committed state.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .base import NO_DRAFT, Draft

__all__ = ["GrammarDrafter", "Spellings"]


class Spellings(dict[int, list[int]]):
    """How the model writes the tokens grammars hold back: {held token: the tokens it wrote for its
    bytes}. Drafts only: a wrong spelling costs acceptance, never output."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        super().__init__()
        self.token_bytes = token_bytes

    def of(self, held: int) -> list[int]:
        return self.get(held, [held])

    def learn(self, held: int, output: Sequence[int], at: int) -> bool:
        """Read how ``output`` spelled ``held`` from ``output[at]`` on; False until all of its bytes
        are there. Tokens that do not end exactly on its bytes (merged with free text) teach nothing."""
        target = self.token_bytes[held]
        written, end = b"", at
        while len(written) < len(target) and end < len(output):
            written += self.token_bytes[output[end]]
            end += 1
        if len(written) < len(target):
            return False
        if written == target:
            self[held] = list(output[at:end])
        return True


class GrammarDrafter:
    """One request's grammar: its position, its forced drafts, and the cut and masks of any draft.

    grammar: ``Grammar``, ``RepeatedGrammar``, ``CallListGrammar`` (structured.grammar, .formats) or
      ``AutoCallGrammar`` (structured.triggers);
    proposes: whether forced text is drafted (``"grammar"`` in ``SpecConfig.sources``); without it
      the forced tokens are decoded one per pass, under the same masks.
    """

    source = "grammar"

    def __init__(self, grammar: Any, spellings: Spellings, *, proposes: bool = True) -> None:
        self.grammar, self.spellings, self.proposes = grammar, spellings, proposes
        self.state: int = grammar.initial_state
        self.output: list[int] = []  # committed tokens, to read how the model spelled a held token
        self._held_at: tuple[int, int] | None = None  # (offset in output, token): the last held token drafted

    def propose(self, k: int) -> Draft:
        """The canonical tokens of the forced text, then the held token as the model spells it."""
        if not self.proposes or k <= 0:
            return NO_DRAFT
        tokens = self.grammar.forced(self.state)
        held = self.grammar.held(self.state)
        if held is not None:
            if self._held_at is None:
                self._held_at = (len(self.output) + len(tokens), held)
            tokens = tokens + self.spellings.of(held)
        tokens = tokens[:k]
        return Draft(tokens, self.source, forced=len(tokens)) if tokens else NO_DRAFT

    def walk(self, draft: Sequence[int]) -> list[int]:
        """The states along ``draft`` until the first token the grammar rejects: [state now, state
        after draft[0], ...]; the draft's allowed prefix is one shorter than the list."""
        states = [self.state]
        for token in draft:
            following = self.grammar.advance(states[-1], token)
            if following is None:
                break
            states.append(following)
        return states

    def masks(self, states: Sequence[int]) -> torch.Tensor | None:
        """[P, V] bool: the tokens allowed at each state; None where nothing is constrained."""
        if all(self.grammar.unconstrained(s) for s in states):
            return None
        return torch.stack([self.grammar.mask(s) for s in states])

    def advance(self, token: int) -> bool:
        """Commit one verified token; True once the structured output is complete."""
        self.state = self.grammar.next_state(self.state, token)
        return self.grammar.is_complete(self.state)

    def observe(self, committed: Sequence[int]) -> None:
        """Tokens committed this step (the request goes on): learn the held token's spelling."""
        self.output.extend(committed)
        if self._held_at is not None and self.spellings.learn(self._held_at[1], self.output, self._held_at[0]):
            self._held_at = None
