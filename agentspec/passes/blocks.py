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
from .levels import INTEGER_KIND, BlocksArg, LayerArg, SegmentArg, address
from .packed import Segment
from .products import BlockProduct, GGUFBlocks, StackedProduct
from .threads import kernel_threads

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
    few, *many = product.blocks()
    return BlocksArg(kind, few, many[0] if many else None, product.outputs, None)


FLOAT32 = (torch.float32,)


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
        self.function = blocks.kernels.agentspec_layers
        self.isa = blocks.kernels.isa  # the kernels' instruction-set level
        integer = blocks.activations in INTEGER_ACTIVATIONS
        self.kv_dtypes = (self.key_dtype(), torch.float16) if integer else (torch.float32, torch.float32)
        self.residual_scale = 1.0 if self.arch.residual_scale is None else self.arch.residual_scale

        self.hidden = self.norm.shape[-1]
        self._chains: list[BlocksArg] = []  # the later parts of stacked products, which the layers' arguments point at
        self.layer_args = (LayerArg * len(self.layers))(*(self._layer_arg(index) for index in range(len(self.layers))))

    def _layer_arg(self, index: int) -> LayerArg:
        """blocks.h's agentspec_layer of layer ``index``, each tensor and product checked to be as
        large as the counts the layers declare to the C side (which reads them directly)."""
        layer, hidden, head_dim, intermediate = self.layers[index], self.hidden, self.head_dim, self.intermediate
        q_size = self.heads * head_dim
        width = q_size + 2 * self.kv_heads * head_dim
        shapes = {"qkv": (hidden, width), "o": (q_size, hidden), "gate_up": (hidden, 2 * intermediate), "down": (intermediate, hidden)}
        for name, (inputs, outputs) in shapes.items():
            product = getattr(layer, name)
            if (product.inputs, product.outputs) != (inputs, outputs):
                raise ValueError(f"layer {index}'s {name} product is {product.inputs} inputs to {product.outputs} outputs; the layers take {inputs} to {outputs}")

        def pointer(tensor: torch.Tensor | None, count: int, what: str) -> int | None:
            return None if tensor is None else address(tensor, count, FLOAT32, f"layer {index}'s {what}")

        def norm(module: Any, count: int, what: str) -> int | None:
            return None if module is None else pointer(module.weight, count, what)

        return LayerArg(
            norm(layer.norm1, hidden, "input norm"), norm(layer.norm2, hidden, "MLP norm"), layer.norm1.eps, layer.norm2.eps,
            *(_blocks_arg(getattr(layer, name), self._chains) for name in shapes),
            pointer(layer.qkv_bias, width, "q/k/v bias"), norm(layer.q_norm, head_dim, "query norm"), norm(layer.k_norm, head_dim, "key norm"),
            layer.q_norm.eps if layer.q_norm is not None else 0.0, layer.spec.window or 0,
            0 if layer.spec.rope is None else 1 + self.ropes.index(layer.spec.rope),  # 1 + its table's index in the stacked angles
            norm(layer.post_attention, hidden, "attention's post norm"), norm(layer.post_mlp, hidden, "MLP's post norm"),
            layer.post_attention.eps if layer.post_attention is not None else 0.0, self.arch.activation == "gelu_pytorch_tanh",
            self.arch.attention_softcap or 0.0,
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
        tokens, rotary_dim = hidden.shape[0], cos.shape[-1]
        if hidden.shape[1:] != (self.hidden,) or cos.shape != sin.shape or cos.shape[:2] != (len(tables), tokens):
            raise ValueError(f"the compiled layers take hidden states [T, {self.hidden}] and rotary angles [{len(tables)}, T, dims], not {tuple(hidden.shape)}, {tuple(cos.shape)}")
        angles = len(tables) * tokens * rotary_dim
        args = (SegmentArg * len(segments))(*(self._segment_arg(s, tokens, key_dtype, value_dtype) for s in segments))
        self.function(
            address(hidden, tokens * self.hidden, FLOAT32, "the hidden states"), tokens, self.hidden, self.heads, self.kv_heads, self.head_dim,
            self.intermediate, len(self.layers), self.layer_args, address(cos, angles, FLOAT32, "the rotary cosines"),
            address(sin, angles, FLOAT32, "the rotary sines"), rotary_dim, self.scaling, self.residual_scale,
            args, len(segments), key_dtype == torch.float16, value_dtype == torch.float16, kernel_threads(),
        )
        return hidden

    def _segment_arg(self, segment: Segment, tokens: int, key_dtype: torch.dtype, value_dtype: torch.dtype) -> SegmentArg:
        """blocks.h's agentspec_segment of ``segment`` in a pass of ``tokens``: its tokens within the
        pass's, its new keys and values within its block's capacity, the block of the layers' shape."""
        block = segment.block
        capacity = block.capacity
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        if not 0 <= segment.start <= segment.stop <= tokens or segment.past < 0 or segment.past + segment.stop - segment.start > capacity:
            raise ValueError(
                f"a sequence's tokens {segment.start}..{segment.stop} of a pass of {tokens}, after {segment.past}, do not fit its block of {capacity}"
            )
        if tuple(block.keys.shape) != shape or tuple(block.values.shape) != shape:
            raise ValueError(f"a sequence's keys and values are {tuple(block.keys.shape)}, {tuple(block.values.shape)}; the compiled layers take {shape}")
        size = len(self.layers) * self.kv_heads * capacity * self.head_dim
        keys, values = address(block.keys, size, (key_dtype,), "a sequence's keys"), address(block.values, size, (value_dtype,), "a sequence's values")
        return SegmentArg(segment.start, segment.stop, segment.past, capacity, keys, values)
