"""agentspec's own target pass for Llama-architecture models: the same arithmetic, less around it.

transformers' forward spends a third of a 1-position pass of the default model outside its
arithmetic (per-layer Python: decorators, kwargs, output capture, the attention interface; measured
80 ms against 58 ms here, 30 layers). ``FusedLlamaPass`` runs the same operations in the same order
straight from the model's weights — embedding, per layer RMSNorm, one product for q/k/v, rotary
embedding (the model's own ``rotary_emb``), the packed attention of ``packed.py``, the output
projection, RMSNorm, one product for gate/up, SiLU, the down projection; the final norm and the
LM head on the kept positions only — and gives the same logits as ``forward_packed`` over the
model (bit for bit on the default model, checked at start-up against the model's own forward like
every pass). Fewer, larger products: 4 per layer instead of 7.

Products run on what ``linear`` makes of the weights: oneDNN-packed weights where
``weights.onednn_supported`` says they can (CPU, float32), else ``F.linear`` on the concatenated
weights (any device and dtype), or the GGUF file's own blocks (``blocks.py``). Only what a
Llama decoder layer does is supported (``fused_unsupported`` says why not); other architectures run
through transformers' modules.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .packed import PackedRow, Segment, attend, finish_rows, pack_rows, store_kv, wants_features

__all__ = ["FusedLlamaPass", "fused_unsupported", "rms_norm", "FUSED_MODEL_TYPES", "Linear", "LinearFactory"]

FUSED_MODEL_TYPES = ("llama",)  # SmolLM, Llama 2/3, TinyLlama, ... (model_type as in the config)

Linear = Callable[[torch.Tensor], torch.Tensor]
# Makes the product of weights stacked along their outputs (q, k and v as one product): oneDNN-packed
# or F.linear over the concatenation (``weights.py``), or the GGUF file's own blocks (``blocks.py``).
LinearFactory = Callable[[Sequence[torch.Tensor]], Linear]


def fused_unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run the fused pass, or None when it can."""
    config = model.config
    if getattr(config, "model_type", None) not in FUSED_MODEL_TYPES:
        return f"the fused pass covers model types {', '.join(FUSED_MODEL_TYPES)}, not {getattr(config, 'model_type', None)!r}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"the fused pass computes SiLU MLPs, not {config.hidden_act!r}"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "the model has no Llama decoder body (model.layers, model.rotary_emb)"
    for layer in body.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(getattr(linear, "bias", None) is not None for linear in linears):
            return "the fused pass has no linear biases"
        if getattr(attention, "sliding_window", None) is not None or getattr(config, "sliding_window", None):
            return "the fused pass has no sliding-window attention"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm (float32 statistics, back to the input's dtype); in float32 torch's fused kernel,
    which computes the same sums (bit for bit on the default model, ``tests/test_weights.py``) in one
    call instead of six."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    __slots__ = ("norm1", "norm2", "qkv", "o", "gate_up", "down", "eps1", "eps2", "scaling")

    def __init__(self, layer: Any, linear: LinearFactory) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.scaling = attention.scaling
        with torch.no_grad():
            self.qkv = linear([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
            self.gate_up = linear([mlp.gate_proj.weight, mlp.up_proj.weight])
            self.o = linear([attention.o_proj.weight])
            self.down = linear([mlp.down_proj.weight])


class FusedLlamaPass:
    """A target pass (rows in, each row's kept logits out) computed from a Llama model's weights."""

    def __init__(self, model: Any, linear: LinearFactory) -> None:
        reason = fused_unsupported(model)
        if reason is not None:
            raise NotImplementedError(reason)
        config, body = model.config, model.model
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        self.embed = body.embed_tokens.weight
        self.rotary = body.rotary_emb
        self.norm, self.eps = body.norm.weight, body.norm.variance_epsilon
        self.layers = [_Layer(layer, linear) for layer in body.layers]
        with torch.no_grad():
            self.head = linear([model.get_output_embeddings().weight])

    @torch.inference_mode()
    def __call__(self, rows: Sequence[PackedRow]) -> list[torch.Tensor]:
        inputs = pack_rows(rows, self.heads // self.kv_heads)
        hidden = F.embedding(inputs.input_ids[0], self.embed)  # [T, hidden]
        cos, sin = self.rotary(hidden[None], inputs.position_ids)
        hidden = self.decoder_layers(hidden, cos[0], sin[0], inputs.segments)
        if wants_features(rows):  # every token's normed hidden state, of which the kept ones get logits
            normed = rms_norm(hidden, self.norm, self.eps)
            return finish_rows(rows, self.head(normed[inputs.keep]), normed)
        logits = self.head(rms_norm(hidden[inputs.keep], self.norm, self.eps))
        return finish_rows(rows, logits)

    def decoder_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Any) -> torch.Tensor:
        """The decoder layers over the pass's tokens: embeddings [T, hidden] in, the last layer's
        output out; ``cos``/``sin`` [T, head_dim] are the tokens' rotary angles. Each sequence's
        new keys and values go into its block."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        tokens = hidden.shape[0]
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(rms_norm(hidden, layer.norm1, layer.eps1))
            # queries and keys rotated as one tensor: the same arithmetic per element, half the calls
            qk = qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
            attention = self.attention(segments, index, q, k, v, layer.scaling)
            hidden = hidden + layer.o(attention.reshape(tokens, q_size))
            gate_up = layer.gate_up(rms_norm(hidden, layer.norm2, layer.eps2))
            hidden = hidden + layer.down(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
        return hidden

    def attention(self, segments: Any, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """One layer's attention: the pass's new keys and values ([T, kv_heads, head_dim]) stored,
        then each token's query ([T, heads, head_dim]) over its sequence's keys; [T, heads, head_dim]
        out. ``segments``: what ``decoder_layers`` was given (here, ``packed.py``'s segments)."""
        store_kv(segments, layer, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return attend(segments, layer, q.transpose(0, 1)[None], scaling)[0]
