"""Model drafting: a small causal LM (or the target's own first layers) guesses the next tokens.

A draft model sharing the target's tokenizer runs autoregressively on its own KV cache and proposes
k tokens. Under sampling it draws each from its *processed* distribution (the same temperature,
top-k, top-p, min-p and penalty as the target's) with the request's noise at that output position
(``agentspec.sampling``): the target draws with the very same noise, so a draft token is accepted
iff both races pick the same token (coupled sampling), and the output is plain sampling's.

Its cache holds committed tokens only once a step is over: the tokens it fed speculatively (the
grammar's ``after`` tokens and its own draft) stay until ``observe`` says what was committed, and
the cache is cropped to the part of them that was (accepted drafts are not recomputed).

The draft model runs on what ``draft_models.py`` makes of it: a GGUF file's block pass, the
target's own pass cut after its first N layers (early exit), or transformers' modules.

Shape letters: V vocabulary (the target's), D the draft model's output rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import ModelLoadError
from ..logits import LogitsPipeline
from ..params import GenerationParams
from ..sampling import position_keys, sample
from .base import Draft, common_prefix

if TYPE_CHECKING:
    from .draft_models import DraftModel

__all__ = ["DraftChooser", "ModelDrafter", "check_vocab_compatible"]

CONFIDENCE_BUCKETS = 4  # evidence 1..4: the draft's own probability of its first token, in quarters


class DraftChooser:
    """Chooses draft tokens from a drafter's logits as the target will judge them: through the
    request's logits processors (the same temperature, top-k, top-p, min-p and penalty), greedily or
    with the request's noise at the drafted output position (``agentspec.sampling``), so under
    sampling a draft token is accepted iff the target's draw picks it too (coupled sampling).

    ``tokens``: the committed tokens (prompt + output observed so far).
    """

    def __init__(self, params: GenerationParams, vocab_size: int, device: torch.device, prompt: Sequence[int]) -> None:
        self.params = params
        self.tokens: list[int] = list(prompt)
        self.prompt_length = len(self.tokens)  # output positions count from here (sampling noise)
        self.pipeline = LogitsPipeline(params, vocab_size, device)
        self.pipeline.observe(self.tokens)

    def observe(self, committed: Sequence[int]) -> None:
        self.tokens.extend(committed)
        self.pipeline.observe(committed)

    def choose(self, logits: torch.Tensor, extra: list[int]) -> tuple[int, float]:
        """The draft token after the committed tokens + ``extra`` from ``logits`` [V], and the
        drafter's probability of it."""
        # The pipeline's row i sees committed + extra[:i]; only the last row (all of extra) is used.
        penalised = self.params.repetition_penalty != 1.0
        rows = logits.expand(len(extra) + 1, -1) if penalised else logits[None]
        prefix = extra if penalised else ()
        if self.params.greedy:
            token = int(self.pipeline.greedy(rows, prefix)[-1])
            return token, float(logits.softmax(dim=-1)[token])
        probs = self.pipeline.probs(rows, prefix)[-1:]  # [1, V]
        position = len(self.tokens) - self.prompt_length + len(extra)  # the output position it drafts
        keys = torch.tensor(position_keys(self.params.seed, [position]), dtype=torch.int32, device=probs.device)
        token = int(sample(probs, keys)[0])
        return token, float(probs[0, token])

    def draft(self, logits: torch.Tensor, k: int, extra: Sequence[int], min_confidence: float, advance: Callable[[int], torch.Tensor], source: str) -> Draft:
        """Up to ``k`` tokens chosen one by one: from ``logits`` [V] (the drafter's scores of the
        token after the committed tokens + ``extra``), then from ``advance(token)`` — the drafter
        fed its own choice. Stops once the drafter's probability of its own token falls below
        ``min_confidence`` (after the first token, whose probability is the draft's evidence); a
        ``Draft`` of ``source``."""
        extra = list(extra)
        tokens: list[int] = []
        evidence = 0
        for i in range(k):
            token, confidence = self.choose(logits, extra)
            if i == 0:
                evidence = 1 + min(int(confidence * CONFIDENCE_BUCKETS), CONFIDENCE_BUCKETS - 1)
            elif confidence < min_confidence:
                break
            tokens.append(token)
            extra.append(token)
            if i + 1 < k:
                logits = advance(token)
        return Draft(tokens, source, evidence=evidence)


class ModelDrafter:
    """Drafts with a causal LM that shares the target's tokenizer (``source="model"``).

    model: the draft model (``draft_models.DraftModel``): a GGUF file's block pass or the target's
      own pass cut after N layers (``PassDraft``), or transformers' modules (``ModuleDraft``); each
      request's drafter feeds a cache of its own;
    vocab_size: the target's V; draft logits are cut or padded (-inf) to it, so a draft whose
      embedding matrix is padded differently still lines up id for id;
    max_tokens: most tokens drafted per step (each costs one draft forward);
    min_confidence: stop drafting once the draft's probability of its own token falls below this
      (after the first token). Where the draft stops changes how much is verified, never what is
      committed.
    """

    source = "model"

    def __init__(
        self,
        model: "DraftModel",
        params: GenerationParams,
        vocab_size: int,
        device: torch.device,
        *,
        max_tokens: int = 8,
        min_confidence: float = 0.3,
    ) -> None:
        self.model, self.params, self.vocab_size, self.device = (
            model,
            params,
            vocab_size,
            device,
        )
        self.max_tokens, self.min_confidence = max_tokens, min_confidence
        self.reset(())

    # -- the Drafter protocol -----------------------------------------------------------------------

    def reset(self, prompt: Sequence[int]) -> None:
        """Forget everything; the prompt is fed on the first ``propose`` (lazy prefill)."""
        self.cache = self.model.cache()
        self.chooser = DraftChooser(self.params, self.vocab_size, self.device, prompt)
        self.cached: list[int] = []  # the tokens whose keys/values are in `cache`, in order

    @property
    def tokens(self) -> list[int]:
        """The committed tokens: the prompt and the output observed so far."""
        return self.chooser.tokens

    @torch.inference_mode()
    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        k = min(k, self.max_tokens)
        if k <= 0:
            return Draft([], self.source)
        context = self.tokens + list(after)
        if not context:
            return Draft([], self.source)
        # Keep the cached prefix of the context, but feed at least its last token (for its logits).
        self._crop(min(common_prefix(self.cached, context), len(context) - 1))
        logits = self._feed(context[len(self.cached) :])  # [D] scores of the token after `context`
        return self.chooser.draft(logits, k, after, self.min_confidence, lambda token: self._feed([token]), self.source)

    def observe(self, committed: Sequence[int]) -> None:
        """Keep the speculative keys/values that were committed, drop the rest."""
        self.chooser.observe(committed)
        self._crop(common_prefix(self.cached, self.tokens))

    # -- helpers ------------------------------------------------------------------------------------

    @property
    def cached_length(self) -> int:
        """Positions in the draft's KV cache (the invariant: all of them are committed tokens)."""
        return self.cache.length

    def _crop(self, length: int) -> None:
        if len(self.cached) > length:
            self.cache.crop(length)
            del self.cached[length:]

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run the draft over ``tokens`` (appending them to its cache); the last position's logits [V]."""
        logits = self.cache.feed(tokens)
        self.cached.extend(tokens)
        return _fit_vocab(logits.float(), self.vocab_size)


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[D] draft logits → [V]: padding rows beyond the target's vocabulary dropped, missing ones -inf."""
    if logits.shape[-1] >= vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


# -- compatibility ----------------------------------------------------------------------------------


def check_vocab_compatible(target: Any, draft: Any) -> None:
    """Raise ``ModelLoadError`` unless the draft tokenizes exactly like the target.

    ``target``/``draft``: a ``LoadedModel`` or a tokenizer (anything with ``get_vocab()``). The
    tokenizers must map the same strings to the same ids; embedding matrices padded to different
    sizes are fine (``ModelDrafter`` cuts or pads the draft's logits to the target's vocabulary).
    """
    target_vocab = _vocab(target)
    draft_vocab = _vocab(draft)
    if target_vocab == draft_vocab:
        return
    target_ids = {i: t for t, i in target_vocab.items()}
    draft_ids = {i: t for t, i in draft_vocab.items()}
    for i in range(max(len(target_ids), len(draft_ids)) + 1):
        if target_ids.get(i) != draft_ids.get(i):
            raise ModelLoadError(
                f"The draft model's tokenizer differs from the target's: token id {i} is "
                f"{target_ids.get(i)!r} in the target but {draft_ids.get(i)!r} in the draft "
                f"({len(target_vocab)} vs {len(draft_vocab)} tokens). Use a draft model of the same family "
                "(same tokenizer), or draft='early-exit:N'."
            )
    raise ModelLoadError("The draft model's tokenizer differs from the target's; use a draft of the same family.")


def _vocab(model_or_tokenizer: Any) -> dict[str, int]:
    tokenizer = getattr(model_or_tokenizer, "tokenizer", model_or_tokenizer)
    return dict(tokenizer.get_vocab())
