"""The draft sources of one client, and the drafter each request gets from them.

Every request drafts from n-grams of its own prompt and output. Two sources are shared by the
client's requests: the suffix cache of earlier outputs (filled as requests finish) and a costly
drafter of novel text: a trained draft head (``"head:PATH"``, or by default the head agentspec ships
for the loaded target, when there is one), or with ``Client(draft=...)`` a draft model (a separate
model, or ``"early-exit:N"``: the target's first N layers); ``draft="none"`` turns both off. A
draft model runs as the target does: a GGUF file on its block pass, an early exit of a GGUF target
on the target's own pass cut after N layers, each with a key/value cache of its own, no float copy
of the weights made (``draft_models.py``); other models on transformers' modules. As
soon as more than one source can propose, an ``ArbiterDrafter`` picks per step the draft with the
most expected tokens per millisecond; a request with only n-grams gets the n-gram drafter itself. Grammar-forced tokens come first in the engine and are never drafted by a model.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from ..errors import InvalidRequestError, ModelLoadError
from ..params import GenerationParams
from .arbiter import ArbiterDrafter, SourceHistory
from .base import Drafter
from .head import HEAD_PREFIX, DraftHead, HeadDrafter, load_head, shipped_head
from .draft_models import DraftModel, early_exit_model, file_draft_model
from .model import ModelDrafter, check_vocab_compatible
from .ngram import ngram_drafter
from .suffix import SuffixCache, SuffixDrafter

if TYPE_CHECKING:
    from ..passes.packed import PassFunction

__all__ = ["DraftSources", "check_draft_reference"]

EARLY_EXIT = "early-exit:"
NO_MODEL = "none"  # no draft model, not even the head shipped for the target

log = logging.getLogger("agentspec.drafting")

MAX_SALTED_SUFFIX_CACHES = 64  # tenants (cache salts) whose earlier outputs (each up to SuffixCache.max_tokens) and source histories are kept
T = TypeVar("T")


def check_draft_reference(draft: Any) -> None:
    """Validate ``Client(draft=...)`` before anything loads."""
    if draft is None:
        return
    if not isinstance(draft, str) or not draft:
        raise InvalidRequestError(
            f"`draft` must be None, 'none', a model reference (folder, .gguf file, cached hub id), 'head:PATH' or 'early-exit:N', got {draft!r}."
        )
    if draft.startswith(EARLY_EXIT) and not draft[len(EARLY_EXIT) :].isdigit():
        raise InvalidRequestError(f"draft={draft!r}: write 'early-exit:N' with N the number of target layers to draft with, e.g. 'early-exit:8'.")
    if draft.startswith(HEAD_PREFIX) and not draft[len(HEAD_PREFIX) :]:
        raise InvalidRequestError(f"draft={draft!r}: write 'head:PATH' with PATH the folder `agentspec train-draft --out` wrote.")


class PerSalt(Generic[T]):
    """One ``make()`` per cache salt, for at most ``MAX_SALTED_SUFFIX_CACHES`` salts: the least
    recently used is forgotten."""

    def __init__(self, make: Callable[[], T]) -> None:
        self.make = make
        self.by_salt: collections.OrderedDict[str, T] = collections.OrderedDict()

    def get(self, salt: str, *, create: bool = False) -> T | None:
        value = self.by_salt.get(salt)
        if value is None and create:
            value = self.by_salt[salt] = self.make()
            while len(self.by_salt) > MAX_SALTED_SUFFIX_CACHES:
                self.by_salt.popitem(last=False)
        if value is not None:
            self.by_salt.move_to_end(salt)
        return value

    def clear(self) -> None:
        self.by_salt.clear()


class DraftSources:
    """The client-wide sources; ``drafter(params)`` is the engine's ``drafter_factory``.

    ``target``: the target's pass (``Engine.forward``), which an early exit of a GGUF target runs
    the first layers of."""

    def __init__(self, loaded: Any, draft: str | None, costs: Any, *, target: PassFunction | None = None, device: Any = "auto", dtype: Any = "auto") -> None:
        self.loaded = loaded
        self.costs = costs
        self.suffixes = SuffixCache()  # requests without a cache_salt (every request of an embedded client)
        self.history = SourceHistory()  # what those requests measured about the sources, for the next ones
        self._salted: PerSalt[SuffixCache] = PerSalt(SuffixCache)  # a tenant's own (cache_salt), LRU
        self._salted_history: PerSalt[SourceHistory] = PerSalt(SourceHistory)
        self.draft_model: DraftModel | None = None
        self.head: DraftHead | None = None  # a trained draft head: given, or shipped for this target
        self.head_path: Path | None = None
        if draft is None:
            self.head_path = shipped_head(loaded)
            if self.head_path is not None:
                self.head = load_head(self.head_path, loaded, loaded.name)
                log.info("draft head: %s (shipped for %s)", self.head_path, loaded.name)
        elif draft == NO_MODEL:
            pass
        elif draft.startswith(HEAD_PREFIX):
            self.head_path = Path(draft[len(HEAD_PREFIX) :]).expanduser()
            self.head = load_head(self.head_path, loaded, loaded.name)
        elif draft.startswith(EARLY_EXIT):
            self.draft_model = early_exit_model(loaded, int(draft[len(EARLY_EXIT) :]), target)
        elif draft is not None:
            from ..model import load_model

            draft_loaded = load_model(draft, device=device, dtype=dtype)
            if draft_loaded.device != loaded.device:
                raise ModelLoadError(f"The draft model loaded on {draft_loaded.device} but the target is on {loaded.device}.")
            check_vocab_compatible(loaded, draft_loaded)
            self.draft_model = file_draft_model(draft_loaded)

    @property
    def has_model(self) -> bool:
        """Whether the ``"model"`` source drafts: a draft head or a draft model is loaded."""
        return self.head is not None or self.draft_model is not None

    def drafter(self, params: GenerationParams) -> Drafter | None:
        """The request's drafter over the sources it allows (``SpecConfig.sources``) that can propose now."""
        spec = params.spec
        if not spec.speculates:
            return None
        sources: list[Drafter] = []
        if (ngram := ngram_drafter(params, self.loaded)) is not None:
            sources.append(ngram)
        suffixes = self.suffixes_of(params.cache_salt)
        if "suffix" in spec.sources and suffixes is not None and len(suffixes):
            sources.append(SuffixDrafter(suffixes))
        if "model" in spec.sources and self.draft_model is not None:
            sources.append(ModelDrafter(self.draft_model, params, self.loaded.vocab_size, self.loaded.device))
        if "model" in spec.sources and self.head is not None:
            sources.append(HeadDrafter(self.head, params, self.loaded.vocab_size))
        if not sources:
            return None
        if len(sources) == 1 and not isinstance(sources[0], (ModelDrafter, HeadDrafter)):
            return sources[0]
        # a model costs time to run: even alone, the arbiter runs it only when it is predicted to pay
        return ArbiterDrafter(sources, self.costs, history=self.history_of(params.cache_salt))

    def suffixes_of(self, salt: str | None, *, create: bool = False) -> SuffixCache | None:
        """The earlier outputs requests of ``salt`` draft from: a tenant's own (at most
        ``MAX_SALTED_SUFFIX_CACHES`` tenants keep theirs, the least recently used is forgotten), so
        acceptance never tells one tenant what another received."""
        return self.suffixes if salt is None else self._salted.get(salt, create=create)

    def history_of(self, salt: str | None) -> SourceHistory:
        """What requests of ``salt`` measured about the sources (acceptance, drafting times, when a
        losing source is tried again): a tenant's own, like its earlier outputs, so whether and how
        long the arbiter drafts for one tenant — its speed — never follows what another received."""
        history = self.history if salt is None else self._salted_history.get(salt, create=True)
        assert history is not None
        return history

    def clear_suffixes(self) -> None:
        self.suffixes.clear()
        self._salted.clear()

    def finished(self, output_ids: list[int], salt: str | None = None) -> None:
        """A request (of ``salt``) ended with verified output: later requests of that salt may draft from it."""
        cache = self.suffixes_of(salt, create=True)
        assert cache is not None
        cache.add(output_ids)
