"""The draft models a ``ModelDrafter`` runs, each over a key/value cache of its own per request.

A draft model is whatever gives the logits of the token after a run of tokens fed one chunk at a
time: ``cache()`` makes a request's cache, whose ``feed(tokens)`` runs the model over the tokens
(appending their keys and values) and returns the last position's logits [D], and whose
``crop(length)`` forgets the keys and values past ``length`` tokens. Two kinds:

- ``PassDraft``: one of agentspec's passes (``passes/fused.py``) over a ``KVBlock`` — the block
  pass of a GGUF draft model read from its file (``file_draft_model``), or the target's own pass cut
  after its first N layers (``early_exit_model``). A GGUF file's weights are its blocks, laid out
  once by the pass: no float32 copy of them and no transformers module holding them exists. A
  rolled back draft is a shorter ``length``; the next feed overwrites the slots.
- ``ModuleDraft``: a causal LM called as transformers calls one (a safetensors draft model,
  ``EarlyExitModel`` over a target with float weights, the tests' tiny models) over a ``DynamicCache``.

Which pass a draft runs changes how many of its tokens the target accepts, never the output: every
draft is verified by the target's pass.

``EarlyExitModel`` is the transformers form of an early exit: the target's first N decoder layers,
its final norm and its LM head (no extra weights, no extra download: self-speculation, as in
LayerSkip / Draft&Verify).

Shape letters: D the draft model's output rows, H its hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from ..engine.kv import KVBlock, KVLayout
from ..errors import ModelLoadError
from ..passes.fused import FusedPass
from ..passes.packed import PackedRow, PassFunction
from ..passes.weights import pass_layout, select_weights
from .model import ModelDrafter

__all__ = ["DraftCache", "DraftModel", "EarlyExitModel", "ModuleDraft", "PassDraft", "early_exit_drafter", "early_exit_model", "file_draft_model"]


class DraftCache(Protocol):
    """One request's keys and values in a draft model: ``length`` tokens of them."""

    @property
    def length(self) -> int: ...

    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run the model over ``tokens`` after the cached ones (caching theirs too); the last
        token's logits [D]."""
        ...

    def crop(self, length: int) -> None:
        """Keep the keys and values of the first ``length`` tokens only."""
        ...


class DraftModel(Protocol):
    """A causal LM sharing the target's tokenizer, run by ``ModelDrafter``."""

    def cache(self) -> DraftCache: ...


# -- on agentspec's passes ----------------------------------------------------------------------------


class PassDraft:
    """A draft model on one of agentspec's passes (``FusedPass``, ``BlockPass``): its keys and values
    in a ``KVBlock`` of the pass's layout (as many layers as the pass runs, in its ``kv_dtypes``)."""

    def __init__(self, forward: FusedPass) -> None:
        self.forward = forward
        layout = pass_layout(KVLayout.of(forward.model), forward)
        self.layout = dataclasses.replace(layout, layers=len(forward.layers))

    def cache(self) -> "_BlockCache":
        return _BlockCache(self.forward, self.layout)


class _BlockCache:
    __slots__ = ("forward", "block")

    def __init__(self, forward: PassFunction, layout: KVLayout) -> None:
        self.forward, self.block = forward, KVBlock(layout)

    @property
    def length(self) -> int:
        return self.block.length

    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.forward([PackedRow(self.block, list(tokens), 1)])[0][-1]

    def crop(self, length: int) -> None:
        self.block.length = min(self.block.length, length)


def file_draft_model(draft: Any) -> DraftModel:
    """The draft model of ``draft`` (a ``LoadedModel``): where its GGUF file is the model (its module
    tree holds none of the file's quantised weights: ``float_model`` would dequantise them), the
    block pass "auto" takes for the file, as for a target — ``ModelLoadError`` where none runs
    here; otherwise transformers' model, as loaded."""
    if draft.float_model is None:
        return ModuleDraft(draft.model, draft.device)
    module = draft.module
    try:
        forward = select_weights(module, KVLayout.of(module), "auto", draft.gguf_file).forward
    except ModelLoadError as exc:
        raise ModelLoadError(f"The draft model {draft.name} cannot run here: {exc}") from exc
    if not isinstance(forward, FusedPass):
        raise ModelLoadError(f"The draft model {draft.name} runs on agentspec's block passes, and none runs here; use a safetensors draft or draft='early-exit:N'.")
    return PassDraft(forward)


def early_exit_model(loaded: Any, layers: int, target: PassFunction | None = None) -> DraftModel:
    """The first ``layers`` decoder layers of ``loaded`` (a ``LoadedModel``), its final norm and its
    LM head as a draft model: where ``target`` — the target's pass — is one of agentspec's own
    (a GGUF file's block pass, or a fused pass), that pass cut after ``layers`` layers
    (``FusedPass.first_layers``: its weights shared, none read or converted); otherwise
    transformers' modules of the float model (``EarlyExitModel``; for a GGUF file, dequantised).
    ``ModelLoadError`` unless ``layers`` keeps at least one layer and drops at least one."""
    if isinstance(target, FusedPass):
        _check_exit_layers(layers, len(target.layers))
        try:
            return PassDraft(target.first_layers(layers))
        except NotImplementedError:  # a pass over a pool of every layer (the GPU's static pass)
            pass
    return ModuleDraft(EarlyExitModel(loaded.model, layers), loaded.device)


def _check_exit_layers(layers: Any, total: int) -> None:
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ModelLoadError(f"draft='early-exit:{layers}': N must be an integer from 1 to {total - 1} (the target has {total} layers).")


# -- on transformers' modules ---------------------------------------------------------------------------


class ModuleDraft:
    """A draft model called as transformers calls a causal LM — ``model(input_ids=, cache=,
    use_cache=True, logits_to_keep=)`` → ``.logits`` [1, P, D] — over a ``DynamicCache``; its inputs
    go to ``device``."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device

    def cache(self) -> "_DynamicCache":
        return _DynamicCache(self.model, self.device)


class _DynamicCache:
    __slots__ = ("model", "device", "kv")

    def __init__(self, model: Any, device: torch.device) -> None:
        from transformers import DynamicCache

        self.model, self.device, self.kv = model, device, DynamicCache()

    @property
    def length(self) -> int:
        return self.kv.get_seq_length()

    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        inputs = torch.tensor([list(tokens)], device=self.device)
        return self.model(input_ids=inputs, cache=self.kv, use_cache=True, logits_to_keep=1).logits[0, -1]

    def crop(self, length: int) -> None:
        if self.length > length:
            self.kv.crop(length - self.length)  # a negative count removes that many


class EarlyExitModel:
    """The target's first ``n_layers`` decoder layers + final norm + LM head, as a transformers-called
    draft model (``ModuleDraft``).

    Holds references to the target's modules, never copies: drafting costs no memory but a KV
    cache for N layers. Works for Llama-shaped models (``model.model.{embed_tokens, layers, norm,
    rotary_emb}`` and an output embedding), which covers Llama, SmolLM, Mistral and Qwen2.
    """

    def __init__(self, causal_lm: Any, n_layers: int) -> None:
        base = getattr(causal_lm, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, name) for name in needed):
            raise ModelLoadError(
                f"draft='early-exit:{n_layers}' needs a Llama-shaped model (model.model.layers, norm, rotary_emb); "
                f"{type(causal_lm).__name__} is not. Use a separate draft model instead."
            )
        _check_exit_layers(n_layers, len(base.layers))
        self.config = base.config
        self.embed_tokens, self.norm, self.rotary_emb = base.embed_tokens, base.norm, base.rotary_emb
        self.layers = list(base.layers[:n_layers])
        self.lm_head = causal_lm.get_output_embeddings()

    def __call__(self, *, input_ids: torch.Tensor, cache: Any, use_cache: bool = True, logits_to_keep: int = 0) -> SimpleNamespace:
        from transformers.masking_utils import create_causal_mask

        # As LlamaModel.forward: positions continue the cache; one causal mask and one rotary
        # embedding are shared by all layers; layer i writes layer i of the cache.
        hidden = self.embed_tokens(input_ids)  # [1, P, H]
        past = cache.get_seq_length()
        position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=cache, position_ids=position_ids)
        rotary = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids, cache=cache, use_cache=use_cache)
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = self.norm(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return SimpleNamespace(logits=self.lm_head(hidden))


def early_exit_drafter(loaded: Any, n_layers: int, params: Any, *, target: PassFunction | None = None, **options: Any) -> ModelDrafter:
    """A ``ModelDrafter`` over the first ``n_layers`` of ``loaded`` (a ``LoadedModel``; ``target``:
    the target's pass, as for ``early_exit_model``)."""
    return ModelDrafter(early_exit_model(loaded, n_layers, target), params, loaded.vocab_size, loaded.device, **options)
