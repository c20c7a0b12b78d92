"""A GGUF file's model configuration and tokenizer, from its metadata (and LongRoPE's factor tensors).

``model_config`` maps the metadata to a transformers configuration with transformers' own tables
(``GGUF_CONFIG_MAPPING``: ``qwen2.block_count`` → ``num_hidden_layers`` and so on) and the rules its
GGUF loader adds (a missing ``output.weight`` ties the LM head to the embeddings, the vocabulary size
from the token list, Gemma 3's text model), so it is the configuration
``AutoConfig.from_pretrained(..., gguf_file=...)`` gives — the tests compare them per family — without
parsing the file again; plus what the file says and transformers' table drops (``dropped_fields``:
a head size that is not hidden / heads, Phi-3's partial rotary width and its LongRoPE tables), which
agentspec gives transformers' reading too.

Three families of ``passes/arch.py`` have GGUF files llama.cpp runs but no table in transformers:
Gemma (1), SmolLM3 and Granite. ``OWN_TABLES`` reads them as llama.cpp's loader does (its converter's
``GemmaModel``, ``SmolLM3Model``, ``GraniteModel``; ``src/models/*.cpp``): Gemma's keys are Gemma 2's;
SmolLM3's are Llama's, with a layer without rotary every fourth (llama.cpp's fixed
``n_no_rope_layer_step``, transformers' default interval); Granite's are Llama's plus its four
multipliers, the attention's defaulting to 1 / sqrt(head size) where the file has none, as llama.cpp's
does (transformers' class defaults to 1).

``model_tokenizer`` builds the tokenizer from ``tokenizer.ggml.*`` with transformers' GGUF builders (the
``tokenizers`` library underneath): 0.1 s for SmolLM2's 49,152 tokens where ``AutoTokenizer`` over the
file took 3.9 s (it parses the whole file twice through gguf-py), 0.4 s for Qwen2's 151,936; the same
ids for the same text.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ModelLoadError
from .reader import GGUFFile

__all__ = ["model_config", "model_tokenizer", "model_type", "dropped_fields", "OWN_TABLES", "transformers_reads"]

# The special tokens' names in transformers and their ids' keys in the file (tokenizer.ggml.<key>)
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


# {model type: (the transformers table its keys extend, {llama.cpp's key: the config field})}
OWN_TABLES: dict[str, tuple[str, dict[str, str]]] = {
    "gemma": ("gemma2", {}),
    "smollm3": ("llama", {}),
    "granite": ("llama", {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                          "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}),
}


def _plain(value: Any) -> Any:
    """A metadata value as transformers' configurations hold it: arrays as lists."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def model_type(gguf: GGUFFile) -> str:
    """transformers' model type for the file's ``general.architecture`` (llama.cpp calls Gemma 3's text
    model ``gemma3`` and Mistral's ``llama``, naming it in ``general.name``)."""
    architecture = gguf.architecture
    if not isinstance(architecture, str) or not architecture:
        raise ModelLoadError(f"{gguf.path} names no general.architecture; it is not a model llama.cpp's converter wrote.")
    if architecture == "llama" and gguf.metadata.get("general.name") == "mistral":  # transformers' rule, kept to the letter
        return "mistral"
    return {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(architecture, architecture)


def dropped_fields(gguf: GGUFFile) -> dict[str, Any]:
    """What the file says that transformers' table drops, as configuration fields (its reading is
    given them too, ``model._transformers_model``): the ``head_dim`` where it is not hidden / heads
    (Qwen3's ``attention.key_length``), and Phi-3's rotary embedding (``_phi3_rotary``)."""
    meta, architecture = gguf.scalars(), gguf.architecture
    head_dim, hidden, heads = (meta.get(f"{architecture}.{key}") for key in ("attention.key_length", "embedding_length", "attention.head_count"))
    fields: dict[str, Any] = {"head_dim": head_dim} if head_dim and hidden and heads and head_dim * heads != hidden else {}
    if model_type(gguf) == "phi3":
        fields.update(_phi3_rotary(gguf))
    return fields


def _phi3_rotary(gguf: GGUFFile) -> dict[str, Any]:
    """Phi-3's rotary embedding as llama.cpp's converter writes it: the width it rotates
    (``rope.dimension_count``, a fraction of the head: Phi-4-mini's 3/4) and LongRoPE's two tables of
    factors (tensors ``rope_factors_long``/``_short``, with ``rope.scaling.original_context_length``
    and ``.attn_factor``; Phi-3.5, Phi-4-mini)."""
    from .modules import float_array

    meta, architecture = gguf.scalars(), gguf.architecture
    key = lambda name: meta.get(f"{architecture}.{name}")  # noqa: E731
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base") or 10000.0)}
    hidden, heads, rotated = key("embedding_length"), key("attention.head_count"), key("rope.dimension_count")
    if rotated and hidden and heads:
        rope["partial_rotary_factor"] = rotated / (key("attention.key_length") or hidden // heads)
    long, short = (gguf.tensors.get(f"rope_factors_{kind}.weight") for kind in ("long", "short"))
    if long is None or short is None:
        return {"rope_parameters": rope}
    original = key("rope.scaling.original_context_length")
    if not isinstance(original, int) or original <= 0:
        raise ModelLoadError(f"{gguf.path}: LongRoPE factors without {architecture}.rope.scaling.original_context_length")
    rope.update(rope_type="longrope", long_factor=float_array(long).reshape(-1).tolist(), short_factor=float_array(short).reshape(-1).tolist(),
                original_max_position_embeddings=original)
    if key("rope.scaling.attn_factor"):
        rope["attention_factor"] = float(key("rope.scaling.attn_factor"))
    return {"rope_parameters": rope, "original_max_position_embeddings": original}


def transformers_reads(gguf: GGUFFile) -> bool:
    """Whether transformers' own GGUF loader reads the file's architecture (the float reference of
    ``LoadedModel.model``); for the families of ``OWN_TABLES`` agentspec dequantises it itself."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return _table_name(model_type(gguf)) in GGUF_CONFIG_MAPPING


def _table_name(kind: str) -> str:
    """The name of transformers' GGUF table for model type ``kind`` (Gemma 3's is its file's name)."""
    return "gemma3" if kind == "gemma3_text" else kind


def model_config(gguf: GGUFFile) -> Any:
    """The transformers configuration of the model in ``gguf`` (``ModelLoadError`` for an architecture
    neither transformers nor ``OWN_TABLES`` has a GGUF mapping for)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture, kind = gguf.architecture, model_type(gguf)
    if (table_name := _table_name(kind)) in GGUF_CONFIG_MAPPING:
        table = GGUF_CONFIG_MAPPING[table_name]
    elif kind in OWN_TABLES:
        base, extra = OWN_TABLES[kind]
        table = {**GGUF_CONFIG_MAPPING[base], **extra}
    else:
        known = sorted({*OWN_TABLES, *(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))})
        raise ModelLoadError(f"{gguf.path}: GGUF models of architecture {architecture!r} are not supported (agentspec reads {', '.join(known)}).")
    fields: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    fields.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(kind, {}))
    tables = {architecture: table, "tokenizer": GGUF_CONFIG_MAPPING["tokenizer"]}
    for key, value in gguf.metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = tables.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            fields[renamed] = _plain(value)
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in gguf.metadata:
        fields["vocab_size"] = len(gguf.metadata["tokenizer.ggml.tokens"])
    name = gguf.metadata.get("general.name")
    if name is not None:
        fields["_model_name_or_path"] = name
    fields.update(dropped_fields(gguf))
    if kind == "granite" and "attention_multiplier" not in fields and fields.get("num_attention_heads") and fields.get("hidden_size"):  # llama.cpp's kq_scale without the key
        fields["attention_multiplier"] = (fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]) ** -0.5
    try:
        return AutoConfig.for_model(kind, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{gguf.path}: its metadata does not make a {kind} configuration ({exc}).") from exc


def model_tokenizer(gguf: GGUFFile) -> Any:
    """The tokenizer ``tokenizer.ggml.*`` describes, its chat template and special tokens the file's.

    Built by transformers' GGUF tokenizer builders (the vocabulary and merges into the tokenizer class
    of the file's kind: ``GPT2Tokenizer`` for byte-level BPE, ``LlamaTokenizer``, ``GemmaTokenizer``,
    ``T5Tokenizer``), the steps ``convert_gguf_tokenizer`` takes, keeping the tokenizer they build
    instead of wrapping its backend in a new one (which deep-copies it: 0.4 s of Qwen2's 0.8 s); then
    given the file's special tokens, BOS and EOS rules and chat template."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING
    from transformers.integrations.gguf.gguf_tokenizer_mapping import add_gguf_special_tokens, select_tokenizer_builder, set_split_regex

    meta = gguf.metadata
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    description = {name: _plain(meta[f"tokenizer.{key}"]) for key, name in renames.items() if f"tokenizer.{key}" in meta}
    tokens = description.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{gguf.path} has no tokenizer.ggml.tokens; agentspec needs the vocabulary in the file.")
    kind = description.get("tokenizer_type")
    try:  # the builder as transformers' reader names the architecture (gemma3, not gemma3_text)
        tokenizer = select_tokenizer_builder(gguf.architecture, kind)(description)
        tokenizer = set_split_regex(add_gguf_special_tokens(tokenizer, description), description)
    except (ValueError, KeyError, TypeError, NotImplementedError) as exc:
        raise ModelLoadError(f"{gguf.path}: its tokenizer ({kind!r}) cannot be built ({exc}).") from exc
    for name, key in SPECIAL_TOKENS.items():
        index = meta.get(f"tokenizer.ggml.{key}")
        setattr(tokenizer, name, tokens[index] if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(tokens) else None)
    template = meta.get("tokenizer.chat_template")
    tokenizer.chat_template = template if isinstance(template, str) else None
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
    tokenizer.add_bos_token = meta.get("tokenizer.ggml.add_bos_token", kind == "llama") is True
    tokenizer.add_eos_token = meta.get("tokenizer.ggml.add_eos_token") is True
    return tokenizer
