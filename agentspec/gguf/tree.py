"""agentspec's own module tree for a GGUF file on the block passes: the structure transformers'
modules would give, without importing transformers' modeling code.

The block passes read a model's structure from its modules (``passes/arch.describe``: projections,
norms, windows, scales; ``FusedPass``: the rotary table, the norms' weights, the biases) and multiply
the file's own blocks; they never run the modules. Building transformers' module tree for that
imports its modeling code — generation, masking, the distributed tensors and torch's compiler with
it: 2.9 s of a 0.5B file's 5 s start-up on a 2-core Zen 4 (docs/gguf.md). ``file_tree`` builds the
same tree from agentspec's classes: the same module and parameter names (so gguf-py's table maps the
file's tensors to them, and ``describe`` reads it as it reads transformers'), the same attributes
(each attention's ``scaling`` and ``sliding_window``, Gemma's embedding scale), the rotary tables
computed as transformers' rotary embeddings compute them (``ROPE_INIT_FUNCTIONS``), and the file's
float tensors loaded as ``modules.load_float_tensors`` loads them. The tests hold it to transformers'
tree per family: the same description, the same tensors bit for bit, the same logits.

The tree has no ``forward``: where a float model is needed (another pass by name, a draft model, the
tests' reference) ``LoadedModel.model`` builds transformers' own. ``file_tree_reads`` says which
configurations it builds (a rotary embedding that changes with the sequence's length, "dynamic",
goes to transformers' tree, as does a file whose matrices are all float: that tree is the model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..passes.arch import head_dim
from ..passes.rope import cos_sin
from .modules import load_float_tensors
from .reader import GGUFFile

__all__ = ["file_tree", "file_tree_reads", "FileTree", "RotaryTable"]

META = torch.device("meta")
# Families whose attention modules carry a window per layer (the config's layer_types), as transformers' do
WINDOW_PER_LAYER = ("qwen2", "qwen3", "gemma2", "gemma3_text", "smollm3")
MLP_BIAS = ("llama", "smollm3", "granite")  # families whose MLP has biases where config.mlp_bias says
SCALED_EMBEDDING = ("gemma", "gemma2", "gemma3_text")  # embeddings times sqrt(hidden): a buffer of the embedding module
# rotary types whose tables are fixed at build (LongRoPE's two are pinned per position: passes/rope.py)
FIXED_ROPE = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """Whether transformers' attention of ``config`` has biases on q/k/v, and on its output: Qwen2's
    on q/k/v always, Mistral's and Phi-3's none, the others' as ``attention_bias`` says. (A bias the
    file has beyond these is loaded too: ``modules.load_float_tensors``.)"""
    kind = config.model_type
    if kind == "qwen2":
        return True, False
    if kind in ("mistral", "phi3"):
        return False, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def _rope_parameters(config: Any) -> list[tuple[str | None, dict[str, Any]]]:
    """(layer type or None, its rotary parameters) of every table the model has."""
    parameters = config.rope_parameters
    if config.model_type == "gemma3_text":
        return [(kind, parameters[kind]) for kind in sorted(set(config.layer_types)) if parameters.get(kind) is not None]
    return [(None, parameters)]


def file_tree_reads(config: Any) -> bool:
    """Whether ``file_tree`` builds the model of ``config`` (a family of ``passes/arch.py`` whose
    rotary tables are fixed when built)."""
    from ..passes.arch import FAMILIES

    if config.model_type not in FAMILIES:
        return False
    try:  # LongRoPE is pinned per position for one table only (passes/rope.py), not per layer type
        return all(params.get("rope_type", "default") in FIXED_ROPE and not (kind is not None and params.get("rope_type") == "longrope")
                   for kind, params in _rope_parameters(config))
    except (AttributeError, KeyError, TypeError):
        return False


class RotaryTable(nn.Module):
    """transformers' rotary embedding of the model's families: ``forward(x, positions[, layer_type])``
    gives (cos, sin) of each position, the frequencies of ``inv_freq`` (per layer type on Gemma 3,
    ``<type>_inv_freq``) times the rotary type's attention scaling, in ``x``'s dtype."""

    def __init__(self, config: Any) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        super().__init__()
        tables = _rope_parameters(config)
        self.rope_type: Any = tables[0][1]["rope_type"] if tables[0][0] is None else {}  # read by passes/rope.pin_long_rope
        self.scalings: dict[str | None, float] = {}
        for kind, params in tables:
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":
                inverse, scaling = self._default(config, params), 1.0
            elif kind is None:
                inverse, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
            else:
                inverse, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=kind)
            prefix = "" if kind is None else f"{kind}_"
            if kind is not None:
                self.rope_type[kind] = rope_type
            self.register_buffer(f"{prefix}inv_freq", inverse, persistent=False)
            self.register_buffer(f"{prefix}original_inv_freq", inverse.clone(), persistent=False)
            self.scalings[kind] = scaling

    @staticmethod
    def _default(config: Any, params: dict[str, Any]) -> torch.Tensor:
        """Plain RoPE's frequencies over the head (Phi-3: over its rotated fraction)."""
        dim = head_dim(config)
        if config.model_type == "phi3":
            dim = int(dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inverse = getattr(self, "inv_freq" if layer_type is None else f"{layer_type}_inv_freq")
        return cos_sin(position_ids[..., None].float() * inverse.to(device=x.device, dtype=torch.float), self.scalings[layer_type], x.dtype)


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=META), requires_grad=False)
        self.variance_epsilon = eps


class _Linear(nn.Linear):
    """A linear module whose weight (and bias) is on the meta device until loaded (no initialisation:
    on meta it would import torch's compiler)."""

    def __init__(self, inputs: int, outputs: int, bias: bool = False) -> None:
        super().__init__(inputs, outputs, bias=bias, device=META)

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass

    def __init__(self, vocab: int, hidden: int, scale: float | None) -> None:
        super().__init__(vocab, hidden, device=META)
        if scale is not None:
            self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)


class _Attention(nn.Module):
    def __init__(self, config: Any, family: Any, index: int) -> None:
        super().__init__()
        hidden, dim = config.hidden_size, head_dim(config)
        q_size, kv_size = config.num_attention_heads * dim, (config.num_key_value_heads or config.num_attention_heads) * dim
        sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size, "qkv_proj": q_size + 2 * kv_size}
        qkv_bias, o_bias = _attention_biases(config)
        for name in family.qkv:
            setattr(self, name, _Linear(hidden, sizes[name], qkv_bias))
        self.o_proj = _Linear(q_size, hidden, o_bias)
        if family.qk_norm:
            self.q_norm, self.k_norm = _Norm(dim, config.rms_norm_eps), _Norm(dim, config.rms_norm_eps)
        kind = config.model_type
        if kind in ("gemma2", "gemma3_text"):
            self.scaling = config.query_pre_attn_scalar**-0.5
        elif kind == "granite":
            self.scaling = config.attention_multiplier
        else:
            self.scaling = dim**-0.5
        if kind in WINDOW_PER_LAYER:
            sliding = config.layer_types[index] == "sliding_attention" and (kind != "smollm3" or config.use_sliding_window)
            self.sliding_window = config.sliding_window if sliding else None


class _MLP(nn.Module):
    def __init__(self, config: Any, family: Any) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        bias = config.model_type in MLP_BIAS and bool(getattr(config, "mlp_bias", False))
        for name in family.gate_up:
            setattr(self, name, _Linear(hidden, inner * (2 if name == "gate_up_proj" else 1), bias))
        self.down_proj = _Linear(inner, hidden, bias)


class _Layer(nn.Module):
    def __init__(self, config: Any, family: Any, index: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn, self.mlp = _Attention(config, family, index), _MLP(config, family)
        self.input_layernorm, self.post_attention_layernorm = _Norm(hidden, eps), _Norm(hidden, eps)
        if family.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = _Norm(hidden, eps), _Norm(hidden, eps)


class _Body(nn.Module):
    def __init__(self, config: Any, family: Any) -> None:
        super().__init__()
        scale = config.hidden_size**0.5 if config.model_type in SCALED_EMBEDDING else None
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, scale)
        self.layers = nn.ModuleList(_Layer(config, family, i) for i in range(config.num_hidden_layers))
        self.norm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryTable(config)


class FileTree(nn.Module):
    """A causal LM's modules as transformers names them (``model.embed_tokens``, ``model.layers``,
    ``model.norm``, ``model.rotary_emb``, ``lm_head``), its matrices on the meta device."""

    def __init__(self, config: Any) -> None:
        from transformers import GenerationConfig

        from ..passes.arch import FAMILIES

        super().__init__()
        family = FAMILIES[config.model_type]
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        self.model = _Body(config, family)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_decoder(self) -> nn.Module:
        return self.model

    def num_parameters(self) -> int:
        """Its weights' count, those in the file included (tied ones once)."""
        return sum(p.numel() for p in self.parameters())


def file_tree(gguf: GGUFFile, config: Any, quantised: frozenset[str]) -> FileTree:
    """The model of ``config`` (``file_tree_reads``) with the file's float tensors loaded and its
    matrices of the ``quantised`` types left on the meta device (another type is dequantised into
    it: ``modules.load_float_tensors``)."""
    model = FileTree(config)
    load_float_tensors(model, gguf, config, quantised)
    return model.eval().requires_grad_(False)
