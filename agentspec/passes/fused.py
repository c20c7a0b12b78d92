"""agentspec's own target pass for the decoder families of ``arch.py``: the same arithmetic, less around it.

transformers' forward spends a third of a 1-position pass of a small model outside its arithmetic
(per-layer Python: decorators, kwargs, output capture, the attention interface). ``FusedPass`` runs
the same operations in the same order straight from the model's weights, as its ``Architecture``
describes them — embedding (scaled where the family scales it); per layer the input norm, one product
for q/k/v (plus biases), the per-head q/k norms, the rotary embedding (the model's own ``rotary_emb``,
partial where the family rotates part of a head), the packed attention of ``packed.py`` (windowed and
soft-capped per layer), the output projection, the norms around attention and MLP, one product for
gate/up, the gate activation, the down projection; the final norm and the LM head on the kept
positions only (divided and soft-capped where the family does) — and gives the same logits as
``forward_packed`` over the model, checked at start-up against the model's own forward like every
pass. Fewer, larger products: 4 per layer instead of 7.

Products run on what ``linear`` makes of the weights: oneDNN-packed weights where
``weights.onednn_supported`` says they can (CPU, float32), else ``F.linear`` on the concatenated
weights (any device and dtype), or the GGUF file's own blocks (``products.py``). A family
``arch.describe`` does not cover runs through transformers' modules (``fused_unsupported`` says why).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .arch import ACTIVATIONS, Architecture, LayerSpec, describe
from .packed import PackedRow, attend, finish_rows, pack_rows, store_kv, wants_features

__all__ = ["FusedPass", "fused_unsupported", "rms_norm", "Linear", "LinearFactory"]

Linear = Callable[[torch.Tensor], torch.Tensor]
# Makes the product of weights stacked along their outputs (q, k and v as one product): oneDNN-packed
# or F.linear over the concatenation (``weights.py``), or the GGUF file's own blocks (``products.py``).
LinearFactory = Callable[[Sequence[torch.Tensor]], Linear]


def fused_unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run the fused pass, or None when it can."""
    try:
        describe(model)
    except NotImplementedError as exc:
        return str(exc)
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


class _Norm:
    """An RMSNorm's weight as the pass multiplies by it (Gemma's ``1 + w`` folded in once) and its epsilon."""

    __slots__ = ("weight", "eps")

    def __init__(self, norm: Any, offset: float) -> None:
        weight = norm.weight.detach()
        self.weight = weight if not offset else (offset + weight.float()).to(weight.dtype)
        self.eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` [T, heads, head_dim] at angles [T, 1, rotary dims]; a family
    rotating part of each head (Phi-4-mini) keeps the rest as it is."""
    dims = cos.shape[-1]
    if dims == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned = x[..., :dims]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, x[..., dims:]), dim=-1)


def _capped(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class _Layer:
    __slots__ = ("spec", "norm1", "norm2", "post_attention", "post_mlp", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down")

    def __init__(self, layer: Any, spec: LayerSpec, arch: Architecture, linear: LinearFactory) -> None:
        family, offset = arch.family, arch.family.norm_offset
        attention, mlp = layer.self_attn, layer.mlp
        self.spec = spec
        self.norm1 = _Norm(layer.input_layernorm, offset)
        # Llama's post_attention_layernorm is the MLP's input norm; a sandwich family's normalises attention's output
        self.norm2 = _Norm(layer.pre_feedforward_layernorm if family.sandwich else layer.post_attention_layernorm, offset)
        self.post_attention = _Norm(layer.post_attention_layernorm, offset) if family.sandwich else None
        self.post_mlp = _Norm(layer.post_feedforward_layernorm, offset) if family.sandwich else None
        self.q_norm = _Norm(attention.q_norm, offset) if family.qk_norm else None
        self.k_norm = _Norm(attention.k_norm, offset) if family.qk_norm else None
        projections = [getattr(attention, name) for name in family.qkv]
        with torch.no_grad():
            self.qkv = linear([p.weight for p in projections])
            self.gate_up = linear([getattr(mlp, name).weight for name in family.gate_up])
            self.o = linear([attention.o_proj.weight])
            self.down = linear([mlp.down_proj.weight])
        biased = any(p.bias is not None for p in projections)
        self.qkv_bias = torch.cat([p.bias.detach() if p.bias is not None else torch.zeros(p.weight.shape[0], dtype=layer.input_layernorm.weight.dtype, device=layer.input_layernorm.weight.device) for p in projections]) if biased else None
        self.o_bias = None if attention.o_proj.bias is None else attention.o_proj.bias.detach()


class FusedPass:
    """A target pass (rows in, each row's kept logits out) computed from a model's weights, as its
    ``Architecture`` (``arch.describe``) says the block computes."""

    def __init__(self, model: Any, linear: LinearFactory, embedding: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.arch = arch = describe(model)
        body = model.model
        self.model = model
        self.heads, self.kv_heads, self.head_dim = arch.heads, arch.kv_heads, arch.head_dim
        self.intermediate = arch.intermediate
        self.activation = ACTIVATIONS[arch.activation]
        self.embed = body.embed_tokens.weight
        # the rows of the input embedding for token ids: the module's weight, or (a module tree of a
        # GGUF file, whose weights are not in its modules) ``embedding``
        self.embedding_rows = embedding or (lambda ids: F.embedding(ids, self.embed))
        self.embed_scale = None if arch.embed_scale is None else torch.tensor(arch.embed_scale, dtype=body.norm.weight.dtype, device=body.norm.weight.device)
        self.rotary = body.rotary_emb
        self.final_norm = _Norm(body.norm, arch.family.norm_offset)
        self.norm, self.eps = self.final_norm.weight, self.final_norm.eps
        self.layers = [_Layer(layer, spec, arch, linear) for layer, spec in zip(body.layers, arch.layers)]
        self.ropes = sorted({spec.rope for spec in arch.layers if spec.rope is not None})
        with torch.no_grad():
            self.head = linear([model.get_output_embeddings().weight])

    def first_layers(self, layers: int) -> "FusedPass":
        """This pass cut after its first ``layers`` decoder layers, then its final norm and LM head
        (an early exit, as in LayerSkip): the same products and weights, shared, not copied; the
        keys and values it reads and writes hold ``layers`` layers. ``ValueError`` unless it keeps
        at least one layer and drops at least one."""
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < len(self.layers):
            raise ValueError(f"an early exit keeps 1 to {len(self.layers) - 1} of the {len(self.layers)} layers, not {layers!r}")
        cut = copy.copy(self)
        cut.layers = self.layers[:layers]
        return cut

    def embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings [T, hidden] (scaled where the family scales them)."""
        hidden = self.embedding_rows(ids)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def rotations(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each rotary table's angles at ``positions`` [1, T]: {table: (cos, sin) [T, rotary dims]}."""
        out = {}
        for rope in self.ropes:
            cos, sin = self.rotary(hidden[None], positions) if rope == "" else self.rotary(hidden[None], positions, rope)
            out[rope] = (cos[0], sin[0])
        return out

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head over final normed hidden states [N, hidden] → [N, V]."""
        logits = self.head(normed)
        if self.arch.logits_divisor is not None:
            logits = logits / self.arch.logits_divisor
        return _capped(logits, self.arch.final_softcap)

    @torch.inference_mode()
    def __call__(self, rows: Sequence[PackedRow]) -> list[torch.Tensor]:
        inputs = pack_rows(rows, self.heads // self.kv_heads)
        hidden = self.embeddings(inputs.input_ids[0])  # [T, hidden]
        hidden = self.decoder_layers(hidden, self.rotations(hidden, inputs.position_ids), inputs.segments)
        if wants_features(rows):  # every token's normed hidden state, of which the kept ones get logits
            normed = self.final_norm(hidden)
            return finish_rows(rows, self.logits(normed[inputs.keep]), normed)
        return finish_rows(rows, self.logits(self.final_norm(hidden[inputs.keep])))

    def decoder_layers(self, hidden: torch.Tensor, rotations: dict[str, tuple[torch.Tensor, torch.Tensor]], segments: Any) -> torch.Tensor:
        """The decoder layers over the pass's tokens: embeddings [T, hidden] in, the last layer's
        output out; ``rotations``: the tokens' rotary angles per table (``rotations``). Each
        sequence's new keys and values go into its block."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        tokens = hidden.shape[0]
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        residual_scale = self.arch.residual_scale
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.norm1(hidden))
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            qk = qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim)
            if layer.q_norm is not None:
                qk = torch.cat((layer.q_norm(qk[:, :heads]), layer.k_norm(qk[:, heads:])), dim=1)
            if layer.spec.rope is not None:  # queries and keys rotated as one tensor: the same arithmetic per element
                cos, sin = rotations[layer.spec.rope]
                qk = _rotate(qk, cos[:, None, :], sin[:, None, :])
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
            attention = layer.o(self.attention(segments, index, q, k, v, layer.spec).reshape(tokens, q_size))
            if layer.o_bias is not None:
                attention = attention + layer.o_bias
            hidden = hidden + self._residual(attention, layer.post_attention, residual_scale)
            gate_up = layer.gate_up(layer.norm2(hidden))
            mlp = layer.down(self.activation(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
            hidden = hidden + self._residual(mlp, layer.post_mlp, residual_scale)
        return hidden

    @staticmethod
    def _residual(x: torch.Tensor, norm: _Norm | None, scale: float | None) -> torch.Tensor:
        x = x if norm is None else norm(x)
        return x if scale is None else x * scale

    def attention(self, segments: Any, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
        """One layer's attention: the pass's new keys and values ([T, kv_heads, head_dim]) stored,
        then each token's query ([T, heads, head_dim]) over its sequence's keys (within the layer's
        window); [T, heads, head_dim] out. ``segments``: what ``decoder_layers`` was given (here,
        ``packed.py``'s segments)."""
        store_kv(segments, layer, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        query = q.transpose(0, 1)[None]
        return attend(segments, layer, query, spec.scaling, spec.window, self.arch.attention_softcap)[0]
