"""Draft sources. Each implements :class:`~agentspec.drafting.base.Drafter`; one file per source."""

from .arbiter import ArbiterDrafter
from .base import NO_DRAFT, Draft, Drafter
from .model import ModelDrafter, check_vocab_compatible
from .ngram import NgramDrafter, NgramIndex, ngram_drafter, propose_ngram
from .suffix import SuffixCache, SuffixDrafter

__all__ = [
    "NO_DRAFT",
    "ArbiterDrafter",
    "Draft",
    "Drafter",
    "ModelDrafter",
    "NgramDrafter",
    "NgramIndex",
    "SuffixCache",
    "SuffixDrafter",
    "check_vocab_compatible",
    "ngram_drafter",
    "propose_ngram",
]
