"""The target pass on a GGUF file's own weight blocks (``weights="gguf"``, ``"gguf-q16"``): the
file's weights, in their own bytes.

A pass of a small model on a CPU streams every weight once per token, so the bytes it reads set its
time. The default model's file stores its linear weights as Q4_1 blocks (32 weights share a float16
scale and minimum: 0.625 bytes a weight) and its embedding — the tied LM head — as Q8_0 (1.06 bytes
a weight): 98 MB for what the float32 model reads as 540 MB. ``blocks.c`` multiplies float32 rows
by those blocks directly, rounding each weight exactly as the GGUF reader dequantises it, so its
products are those of the float32 weights (the sums in another order: within float32 rounding of
the model's own logits). From a few rows on, float32 products are bound by multiply-adds, not bytes;
that is why the same blocks also multiply rows rounded to integers per block of 32
(``activations``: ``"q8"``, ``"q16"``; ``weights="gguf-q8"``, ``"gguf-q16"``): exact integer dot
products do several times a float FMA's multiply-adds per instruction, and 16-bit rows keep the
logits within ~0.01 of float32's (``blocks.c``, ``weights.py``).

The package's parts: ``levels.py`` (the instruction-set levels and the kernels' build),
``layouts.py`` (blocks and the kernels' layouts of them), ``products.py`` (the products, and which
weights have blocks), and here ``BlockPass``: the decoder layers in one compiled call. Weights whose
blocks are of a type the kernels do not read (or float) take oneDNN's float32 products instead.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .arch import describe
from .fused import FusedPass
from .layouts import BLOCK_TYPES, GGUF_TYPES, INTEGER_ACTIVATIONS
from .levels import INTEGER_KIND, BlocksArg, LayerArg, SegmentArg
from .packed import Segment
from .products import BlockProduct, GGUFBlocks, StackedProduct

__all__ = ["BlockPass", "KEY_BIAS_LIMIT"]

# Keys of a pass on integer rows are cached as float32 where a layer's key bias reaches this, else
# as float16 (values always float16 there). float16 rounds a key relative to its size: the real
# Qwen2.5 files' key biases of |145|-|158| (layers 0-1) put keys at |160|, each ~0.06 off, and moved
# the logits by 0.25 where float32 keys move them by 0.002 (docs/kernels.md). Without such a bias a
# key is a normed row times the projection, and float16 keeps it to the values' error.
KEY_BIAS_LIMIT = 16.0


def _blocks_arg(product: BlockProduct | StackedProduct, keep: list[BlocksArg]) -> BlocksArg:
    """blocks.h's agentspec_blocks of ``product``; a stacked one's later parts are appended to
    ``keep``, which must outlive the call that reads them."""
    if isinstance(product, StackedProduct):
        first, *rest = (_blocks_arg(part, keep) for part in product.products)
        keep.extend(rest)
        for arg, following in zip([first, *rest], rest):
            arg.next = ctypes.pointer(following)
        return first
    kind = BLOCK_TYPES.index(product.kind) if product.layout is None else INTEGER_KIND + product.layout.number(product.activations)
    return BlocksArg(kind, product.few.data_ptr(), None if product.many is None else product.many.data_ptr(), product.outputs, None)


class BlockPass(FusedPass):
    """The fused pass on the GGUF blocks with its decoder layers in one call of the compiled code
    (``agentspec_layers`` in blocks.c): the same operations in the same order, without the ~120
    framework calls a pass makes in Python. It takes the blocks ``Architecture.compiled`` allows
    (every family of ``arch.py``: Qwen2's biases, Qwen3's q/k norms, Mistral's windows, SmolLM3's
    layers without rotary, Phi-3's partial rotary, Granite's multipliers, Gemma's GELU, post norms,
    rotary tables per layer type and soft-capped scores); the embedding and the logits stay in
    Python. Its logits are the loaded model's to float32 rounding (``check_packed``), and
    row-invariant: each token's arithmetic reads only its own row and its sequence's keys and values.

    It reads and writes keys and values of float32 or float16 (one pair of dtypes per pass).
    ``kv_dtypes`` (keys', values') is the pair it is meant for: float32 on float32 rows (the loaded
    model's arithmetic); on integer rows — another model's arithmetic already — float16 values, as
    llama.cpp stores its cache, and float16 keys unless a key bias reaches ``KEY_BIAS_LIMIT``
    (``key_dtype``). Attention streams a sequence's whole cache (or window) each token, for long
    contexts more bytes than the weights of a small model."""

    def __init__(self, model: Any, blocks: GGUFBlocks) -> None:
        reason = describe(model).compiled
        if reason is not None:
            raise NotImplementedError(reason)
        super().__init__(model, blocks.linear, blocks.embedding)
        if self.head_dim % 16 or self.head_dim > 128 or self.heads % self.kv_heads:
            raise NotImplementedError(f"the compiled layers take head dims of 16..128 in steps of 16, not {self.head_dim}")
        products = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in self.layers]
        if not all(isinstance(product, (BlockProduct, StackedProduct)) for four in products for product in four):
            raise NotImplementedError(f"not every linear product of the decoder layers has blocks of one type ({', '.join(GGUF_TYPES)}) in the file")
        self.scaling = self.layers[0].spec.scaling
        if any(layer.spec.scaling != self.scaling for layer in self.layers):
            raise NotImplementedError("the compiled layers take one attention scale for all layers")
        if any(layer.q_norm is not None and layer.q_norm.eps != layer.k_norm.eps for layer in self.layers):
            raise NotImplementedError("the compiled layers take one epsilon for a layer's query and key norms")
        if any(layer.post_attention is not None and layer.post_attention.eps != layer.post_mlp.eps for layer in self.layers):
            raise NotImplementedError("the compiled layers take one epsilon for a layer's two post norms")
        for layer in self.layers:  # the C side reads these tensors' memory directly
            tensors = [layer.norm1.weight, layer.norm2.weight, *(t for t in (layer.qkv_bias,) if t is not None)]
            tensors += [norm.weight for norm in (layer.q_norm, layer.k_norm, layer.post_attention, layer.post_mlp) if norm is not None]
            assert all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors)
        self.function = blocks.kernels.agentspec_layers
        self.isa = blocks.kernels.isa  # the kernels' instruction-set level
        integer = blocks.activations in INTEGER_ACTIVATIONS
        self.kv_dtypes = (self.key_dtype(), torch.float16) if integer else (torch.float32, torch.float32)
        self.residual_scale = 1.0 if self.arch.residual_scale is None else self.arch.residual_scale

        def pointer(tensor: torch.Tensor | None) -> int | None:
            return None if tensor is None else tensor.data_ptr()

        gelu = self.arch.activation == "gelu_pytorch_tanh"
        self._chains: list[BlocksArg] = []  # the later parts of stacked products, which the layers' arguments point at

        self.layer_args = (LayerArg * len(self.layers))(
            *(
                LayerArg(
                    layer.norm1.weight.data_ptr(), layer.norm2.weight.data_ptr(), layer.norm1.eps, layer.norm2.eps,
                    *(_blocks_arg(product, self._chains) for product in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                    pointer(layer.qkv_bias), pointer(layer.q_norm and layer.q_norm.weight), pointer(layer.k_norm and layer.k_norm.weight),
                    layer.q_norm.eps if layer.q_norm is not None else 0.0, layer.spec.window or 0,
                    0 if layer.spec.rope is None else 1 + self.ropes.index(layer.spec.rope),  # 1 + its table's index in the stacked angles
                    pointer(layer.post_attention and layer.post_attention.weight), pointer(layer.post_mlp and layer.post_mlp.weight),
                    layer.post_attention.eps if layer.post_attention is not None else 0.0, gelu, self.arch.attention_softcap or 0.0,
                )
                for layer in self.layers
            )
        )

    def key_dtype(self) -> torch.dtype:
        """The keys' dtype on integer rows: float32 where a layer's key bias reaches ``KEY_BIAS_LIMIT``
        (keys that float16 would round by more than the values), else float16."""
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        biases = [layer.qkv_bias[q_size : q_size + kv_size] for layer in self.layers if layer.qkv_bias is not None]
        largest = max((bias.abs().max().item() for bias in biases), default=0.0)
        return torch.float32 if largest >= KEY_BIAS_LIMIT else torch.float16

    def decoder_layers(self, hidden: torch.Tensor, rotations: dict[str, tuple[torch.Tensor, torch.Tensor]], segments: list[Segment]) -> torch.Tensor:
        hidden = hidden.contiguous().clone()  # written in place
        # every rotary table's angles stacked [tables, T, rotary dims], in self.ropes' order (a model with no rotary layer reads none)
        tables = [rotations[rope] for rope in self.ropes] or [(torch.zeros(hidden.shape[0], 2),) * 2]
        cos, sin = (torch.stack([table[i] for table in tables]).contiguous() for i in (0, 1))
        dtypes = {(s.block.keys.dtype, s.block.values.dtype) for s in segments}
        if len(dtypes) != 1 or not set(next(iter(dtypes))) <= {torch.float32, torch.float16}:
            names = sorted((str(k).removeprefix("torch."), str(v).removeprefix("torch.")) for k, v in dtypes)
            shown = ", ".join(f"{k} keys with {v} values" for k, v in names)
            raise ValueError(f"the compiled layers take key/value blocks of one pair of dtypes (float32 or float16 each) per pass, not {shown}")
        key_dtype, value_dtype = next(iter(dtypes))
        args = (SegmentArg * len(segments))(
            *(SegmentArg(s.start, s.stop, s.past, s.block.capacity, s.block.keys.data_ptr(), s.block.values.data_ptr()) for s in segments)
        )
        self.function(
            hidden.data_ptr(), hidden.shape[0], hidden.shape[1], self.heads, self.kv_heads, self.head_dim, self.intermediate,
            len(self.layers), self.layer_args, cos.data_ptr(), sin.data_ptr(), cos.shape[-1], self.scaling, self.residual_scale,
            args, len(segments), key_dtype == torch.float16, value_dtype == torch.float16, torch.get_num_threads(),
        )
        return hidden
