"""A decoder block described as data: what agentspec's own passes need to know about a model family.

Llama, Qwen2/3, Mistral, Phi-3, Gemma 1/2/3, SmolLM3 and Granite are all the same block — norm,
attention with rotary positions, residual, norm, gated MLP, residual — with a few switches: biases on
the projections (Qwen2), an RMSNorm over each head's queries and keys (Qwen3, Gemma 3), norms that
multiply by ``1 + w`` (Gemma), norms after attention and MLP as well as before (Gemma 2/3), a GELU
gate (Gemma), a scaled embedding, soft-capped attention scores and logits (Gemma 2), sliding windows
on some layers (Mistral, Gemma 2/3, Qwen2 when enabled), layers without rotary positions (SmolLM3),
a rotary table per layer kind (Gemma 3), fused q/k/v and gate/up weights (Phi-3), residual and logit
multipliers (Granite). ``FAMILIES`` holds each family's switches (a few lines per family); ``describe``
reads the rest — sizes, windows per layer, scales, which projections carry biases — from the loaded
model and its config, and checks that the model has every module the description names.

The passes (``fused.py``, ``static.py``, and the projections of ``products.py``) run on an
``Architecture``; transformers' modules stay the reference every pass is checked against at start-up
(``packed.check_packed``). A family not in ``FAMILIES`` runs on the generic pass (the model's own
modules); ``describe`` says why in its ``NotImplementedError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["Family", "FAMILIES", "Architecture", "LayerSpec", "describe", "head_dim", "ACTIVATIONS", "GGUF_PROJECTIONS"]


@dataclass(frozen=True)
class Family:
    """How one model family's block differs from Llama's. Everything not named here is Llama's."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # attention's input projections, stacked in this order
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # the MLP's gate and up projections (one fused weight: gate rows first)
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys before the rotary embedding (q_norm, k_norm)
    norm_offset: float = 0.0  # norms multiply by (offset + weight): Gemma's 1 + w
    sandwich: bool = False  # norms after attention and after the MLP too (post_attention_layernorm, pre/post_feedforward_layernorm)
    activation: str = "hidden_act"  # the config field naming the MLP's gate activation
    rotary_per_layer_type: bool = False  # rotary_emb(hidden, positions, layer_type): a table per kind of layer (Gemma 3)
    no_rope_layers: bool = False  # config.no_rope_layers[i] == 0: layer i has no rotary embedding (SmolLM3)
    multipliers: bool = False  # Granite's embedding_multiplier, residual_multiplier, logits_scaling
    gguf_permuted: bool = False  # llama.cpp's converter interleaves the rotary halves of q/k rows


FAMILIES: dict[str, Family] = {
    "llama": Family(gguf_permuted=True),  # Llama 2/3.x (its RoPE scaling is in rotary_emb), SmolLM2, TinyLlama
    "mistral": Family(gguf_permuted=True),  # Mistral, Ministral: sliding windows read per layer
    "qwen2": Family(),  # biases on q/k/v, read from the modules
    "qwen3": Family(qk_norm=True),
    "phi3": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",)),  # Phi-3/3.5, Phi-4-mini (partial rotary)
    "gemma": Family(norm_offset=1.0),
    "gemma2": Family(norm_offset=1.0, sandwich=True, activation="hidden_activation"),
    "gemma3_text": Family(norm_offset=1.0, sandwich=True, activation="hidden_activation", qk_norm=True, rotary_per_layer_type=True),
    "smollm3": Family(no_rope_layers=True, gguf_permuted=True),
    "granite": Family(multipliers=True, gguf_permuted=True),
}

# The gate activations the passes compute, by transformers' names (ACT2FN computes the same functions)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# llama.cpp's tensor name (blk.N.<name>.weight) of each projection; a fused gate/up is its ffn_up
GGUF_PROJECTIONS = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "qkv_proj": "attn_qkv", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "gate_up_proj": "ffn_up", "down_proj": "ffn_down",
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's varying parts."""

    window: int | None  # sliding window (keys within the last ``window`` positions), None: all
    rope: str | None  # the rotary table it uses ("" the model's one table, a layer type on Gemma 3), None: no rotary embedding
    scaling: float  # attention scores' scale


@dataclass(frozen=True)
class Architecture:
    """A loaded model's decoder block as the passes run it (``describe``)."""

    model_type: str
    family: Family
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    activation: str  # a key of ACTIVATIONS
    layers: tuple[LayerSpec, ...]
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden), Granite: embedding_multiplier)
    residual_scale: float | None = None  # each block's output multiplied by this before the residual add (Granite)
    attention_softcap: float | None = None  # scores → tanh(scores / cap) * cap before the mask (Gemma 2)
    final_softcap: float | None = None  # logits → tanh(logits / cap) * cap (Gemma 2)
    logits_divisor: float | None = None  # logits divided by this (Granite's logits_scaling)
    biases: tuple[str, ...] = field(default=())  # projections with biases (Qwen2: q/k/v)

    @property
    def compiled(self) -> str | None:
        """Why the compiled decoder layers of ``blocks.c`` cannot run this block, or None when they
        can: they take every switch but an output projection bias and the exact (erf) GELU; the
        embedding and the logits stay in Python."""
        unsupported = [
            ("an output projection bias", "o_proj" in self.biases),
            (f"a {self.activation} gate", self.activation not in ("silu", "swish", "gelu_pytorch_tanh")),
        ]
        missing = [what for what, present in unsupported if present]
        return f"the compiled layers do not compute {' or '.join(missing)} ({self.model_type})" if missing else None


def head_dim(config: Any) -> int:
    """A (text) configuration's attention head size: its ``head_dim`` where it names one (Qwen3's,
    Gemma's), else hidden size / query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def describe(model: Any) -> Architecture:
    """``model``'s block as an ``Architecture``; ``NotImplementedError`` naming what agentspec's own
    passes do not compute (the generic pass still runs it)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise NotImplementedError(f"agentspec's own passes cover model types {', '.join(FAMILIES)}, not {model_type!r}")
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb") or not hasattr(body, "embed_tokens"):
        raise NotImplementedError(f"the {model_type} model has no decoder body (model.embed_tokens, model.layers, model.rotary_emb)")
    activation = getattr(config, family.activation, None)
    if activation not in ACTIVATIONS:
        raise NotImplementedError(f"agentspec's own passes compute {', '.join(ACTIVATIONS)} MLP gates, not {activation!r}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layer_types = getattr(config, "layer_types", None)
    biases: set[str] = set()
    specs = []
    for i, layer in enumerate(body.layers):
        attention, mlp = layer.self_attn, layer.mlp
        modules = {name: getattr(attention, name, None) for name in (*family.qkv, "o_proj")}
        modules.update({name: getattr(mlp, name, None) for name in (*family.gate_up, "down_proj")})
        norms = ["input_layernorm", "post_attention_layernorm"] + (["pre_feedforward_layernorm", "post_feedforward_layernorm"] if family.sandwich else [])
        missing = [name for name, module in modules.items() if module is None] + [name for name in norms if not hasattr(layer, name)]
        if family.qk_norm:
            missing += [name for name in ("q_norm", "k_norm") if not hasattr(attention, name)]
        if missing:
            raise NotImplementedError(f"layer {i} of the {model_type} model has no {', '.join(missing)}")
        biases.update(name for name, module in modules.items() if getattr(module, "bias", None) is not None)
        if getattr(attention, "sinks", None) is not None:
            raise NotImplementedError("agentspec's own passes have no attention sinks")
        # a layer's window: its attention module's, where the family sets one per layer, else the config's
        window = getattr(attention, "sliding_window") if hasattr(attention, "sliding_window") else getattr(config, "sliding_window", None)
        rope: str | None = layer_types[i] if family.rotary_per_layer_type else ""
        if family.no_rope_layers and not config.no_rope_layers[i]:
            rope = None
        specs.append(LayerSpec(int(window) if window else None, rope, float(attention.scaling)))
    if biases - {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"}:
        raise NotImplementedError(f"agentspec's own passes have no biases on the MLP's projections ({', '.join(sorted(biases))})")
    scale = getattr(body.embed_tokens, "embed_scale", None)
    embed_scale = float(scale) if scale is not None else None
    residual_scale = logits_divisor = None
    if family.multipliers:
        embed_scale = float(config.embedding_multiplier)
        residual_scale, logits_divisor = float(config.residual_multiplier), float(config.logits_scaling)
    return Architecture(
        model_type=model_type, family=family, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim(config), intermediate=config.intermediate_size,
        activation=activation, layers=tuple(specs), embed_scale=embed_scale, residual_scale=residual_scale,
        attention_softcap=getattr(config, "attn_logit_softcapping", None), final_softcap=getattr(config, "final_logit_softcapping", None),
        logits_divisor=logits_divisor, biases=tuple(sorted(biases)),
    )
