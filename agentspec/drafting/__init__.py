"""Draft sources. Each implements :class:`~agentspec.drafting.base.Drafter`; one file per source."""

from .base import NO_DRAFT, Draft, Drafter
from .ngram import NgramDrafter, NgramIndex, propose_ngram

__all__ = ["Draft", "Drafter", "NO_DRAFT", "NgramDrafter", "NgramIndex", "propose_ngram"]
