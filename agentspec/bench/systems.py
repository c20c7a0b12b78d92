"""The systems ``agentspec bench`` compares, and which workloads each one runs on.

Systems (all greedy, same stop tokens, same max_tokens):
- ``hf_plain``          transformers ``generate(do_sample=False)``
- ``hf_prompt_lookup``  transformers ``generate(prompt_lookup_num_tokens=10)`` (n-gram assisted)
- ``outlines``          outlines' own constrained generation (``outlines.Generator`` over the same
                        transformers model, the same JSON schema, compact whitespace)
- ``llamacpp``          llama.cpp (llama-cpp-python) on the same GGUF file, plain; its own JSON-schema
                        grammar under a schema (``llamacpp.py``)
- ``llamacpp_prompt_lookup``  llama.cpp with its prompt-lookup drafting (10 tokens)
- ``agentspec_plain``   agentspec with ``speculative=False`` (the same loop with K = 0)
- ``agentspec[S+...]``  agentspec drafting from the named sources only (``SpecConfig.sources``):
                        each source on its own, where the workload gives it something to draft
- ``agentspec``         agentspec with speculation, every source

A system runs where it can do the task: transformers ``generate`` has no grammar, so not on the
constrained workloads (tool call, extraction, agent loop); outlines only on those (one request each);
llama.cpp (where installed, on a GGUF model) everywhere but the agent loop, its prompt lookup only
without a grammar;
``agentspec[grammar]`` only under a grammar, ``agentspec[suffix]`` only on the agent loop (every
other timed request starts with the suffix cache cleared), ``agentspec[model]`` only with a draft
head or model (``Client(draft=...)``, or the head shipped for the model); a subset of sources only
where it leaves out one that applies (else it is ``agentspec``): with a draft head, ``agentspec[ngram]``,
``agentspec[grammar+ngram]`` and, on the agent loop, ``agentspec[grammar+ngram+suffix]`` are agentspec
without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types import DRAFT_SOURCES
from .llamacpp import LLAMACPP_SYSTEMS
from .llamacpp import unavailable as llamacpp_unavailable
from .workloads import Workload

if TYPE_CHECKING:
    from ..client import Client

__all__ = ["PEERS", "SYSTEMS", "SUFFIX_PAIRS", "parse_system", "applicable_sources", "applies"]

PEERS = ("hf_plain", "hf_prompt_lookup", "outlines", *LLAMACPP_SYSTEMS, "agentspec_plain")
# each source alone; what the suffix cache adds on the agent loop, to n-grams alone and to grammar +
# n-grams (``suffix_gain``: the first pair that ran per baseline; with a draft head, "agentspec" holds
# the head too); all
SUFFIX_PAIRS = (
    ("agentspec[ngram+suffix]", "agentspec[ngram]"),
    ("agentspec[grammar+ngram+suffix]", "agentspec[grammar+ngram]"),
    ("agentspec", "agentspec[grammar+ngram]"),
)
SYSTEMS = (
    *PEERS,
    *(f"agentspec[{source}]" for source in DRAFT_SOURCES),
    "agentspec[ngram+suffix]",
    "agentspec[grammar+ngram]",
    "agentspec[grammar+ngram+suffix]",
    "agentspec",
)


def parse_system(system: str) -> tuple[str, ...] | None:
    """The draft sources of an agentspec system (``"agentspec[grammar+ngram]"``), None for a peer.

    Raises ValueError for a name that is neither.
    """
    if system == "agentspec":
        return DRAFT_SOURCES
    if system in PEERS:
        return None
    if system.startswith("agentspec[") and system.endswith("]"):
        sources = tuple(system[len("agentspec[") : -1].split("+"))
        if sources and set(sources) <= set(DRAFT_SOURCES) and len(set(sources)) == len(sources):
            return sources
    raise ValueError(
        f"unknown system {system!r}; choose from {', '.join(PEERS)}, agentspec, or agentspec[S+...] with S in "
        f"{', '.join(DRAFT_SOURCES)}"
    )


def applicable_sources(work: Workload, client: Client) -> tuple[str, ...]:
    """The draft sources that have something to draft on this workload."""
    return tuple(
        source for source in DRAFT_SOURCES
        if source == "ngram"
        or (source == "grammar" and work.constrained)
        or (source == "suffix" and work.is_loop)
        or (source == "model" and _has_model_source(client))
    )


def _has_model_source(client: Client) -> bool:
    """Whether the client drafts with a model: a draft head (given, or shipped) or a draft model."""
    return client.backend.name == "local" and client.draft_sources.has_model


def applies(system: str, work: Workload, client: Client) -> bool:
    """Whether ``system`` runs on ``work`` (see the module docstring)."""
    if system.startswith("hf_"):
        return not work.constrained
    if system == "outlines":
        return work.constrained and not work.is_loop
    if system in LLAMACPP_SYSTEMS:
        runs = not work.is_loop if system == "llamacpp" else not work.constrained
        return runs and llamacpp_unavailable(client) is None
    sources = parse_system(system)
    if sources is None or system == "agentspec":
        return True
    useful = set(applicable_sources(work, client))
    return set(sources) < useful  # a proper subset: otherwise the same run as ``agentspec``
