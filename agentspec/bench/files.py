"""Random-weight GGUF files of real models' shapes, for measuring load time, memory and speed.

A pass's speed and memory do not depend on the weights' values, so a file of a real model's shape,
types and vocabulary, with random blocks, measures what the real file would: ``write_model_file``
writes one in llama.cpp's Q4_K_M mix — per llama.cpp's ``llama_model_quantize``: Q4_K matrices,
Q6_K for the value and down projections of the first and last eighth of the layers and every third
between, Q6_K output layer; where a matrix's rows are not a multiple of 256 weights, the K-quants
fall back as llama.cpp's do (Q4_K → Q5_0, Q6_K → Q8_0: Qwen2.5-0.5B's 896-wide matrices) — with
the tokenizer of a GGUF vocabulary file (llama.cpp ships them: ``models/ggml-vocab-qwen2.gguf``,
``ggml-vocab-llama-bpe.gguf`` in its source and llama-cpp-python's source release), so that the
embedding and LM head have their real sizes. Block scales are small float16 values, codes random
bytes: the activations stay finite through every layer.

    python -m agentspec.bench.files qwen2.5-1.5b OUT.gguf --vocab ggml-vocab-qwen2.gguf
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Shape", "SHAPES", "write_model_file", "quant_types", "copy_tokenizer"]


@dataclass(frozen=True)
class Shape:
    architecture: str  # llama.cpp's
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool  # the LM head is the input embedding
    biases: bool = False  # on q, k, v (Qwen2)
    rope_base: float = 1e6
    eps: float = 1e-6
    context: int = 32768


SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, tied=True, biases=True),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True, biases=True),
    "qwen2.5-3b": Shape("qwen2", 2048, 36, 16, 2, 11008, 151936, tied=True, biases=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False, rope_base=500000.0, eps=1e-5, context=131072),
}

# (weights a block, bytes a block, byte offsets of float16 scales in a block)
BLOCKS = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q5_0": (32, 22, (0,)), "Q8_0": (32, 34, (0,))}
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's, for rows not a multiple of 256 weights
SCALE = np.float16(2e-5)  # every block's float16 scale (and K-quants' minimum scale)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def quant_types(shape: Shape) -> dict[str, str]:
    """Q4_K_M's type of every matrix of ``shape`` by GGUF name (before the fallback for narrow rows)."""
    types = {"token_embd.weight": "Q6_K" if shape.tied else "Q4_K"}
    if not shape.tied:
        types["output.weight"] = "Q6_K"
    for i in range(shape.layers):
        high = "Q6_K" if _more_bits(i, shape.layers) else "Q4_K"
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{name}.weight"] = "Q4_K"
        types[f"blk.{i}.attn_v.weight"] = high
        types[f"blk.{i}.ffn_down.weight"] = high
    return types


def _matrix_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    shapes = {"token_embd.weight": (shape.vocab, shape.hidden)}
    if not shape.tied:
        shapes["output.weight"] = (shape.vocab, shape.hidden)
    for i in range(shape.layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (shape.hidden, shape.hidden), f"blk.{i}.attn_k.weight": (kv, shape.hidden),
            f"blk.{i}.attn_v.weight": (kv, shape.hidden), f"blk.{i}.attn_output.weight": (shape.hidden, shape.hidden),
            f"blk.{i}.ffn_gate.weight": (shape.intermediate, shape.hidden), f"blk.{i}.ffn_up.weight": (shape.intermediate, shape.hidden),
            f"blk.{i}.ffn_down.weight": (shape.hidden, shape.intermediate),
        }
    return shapes


def _random_blocks(kind: str, rows: int, inputs: int, rng: np.random.Generator) -> np.ndarray:
    weights, size, scales = BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows, inputs // weights, size), dtype=np.uint8)
    for offset in scales:
        raw[..., offset : offset + 2] = np.frombuffer(SCALE.tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def copy_tokenizer(writer: Any, source: str | Path) -> int:
    """Every ``tokenizer.*`` key of the GGUF file ``source`` (a vocabulary file, or a model's) into
    gguf-py's ``writer``, with its value types; returns the number of tokens."""
    import gguf

    fields = gguf.GGUFReader(str(source)).fields
    for field in fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    return len(fields["tokenizer.ggml.tokens"].data)


def write_model_file(shape: Shape, vocab_file: str | Path, out: str | Path, seed: int = 0) -> Path:
    """A random-weight GGUF file of ``shape`` in the Q4_K_M mix, with ``vocab_file``'s tokenizer."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), shape.architecture)
    tokens = copy_tokenizer(writer, vocab_file)
    if tokens != shape.vocab:
        raise ValueError(f"{vocab_file} has {tokens} tokens; this shape's vocabulary is {shape.vocab}")
    head_dim = shape.hidden // shape.heads
    writer.add_context_length(shape.context)
    writer.add_block_count(shape.layers)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    types = quant_types(shape)
    for name, (rows, inputs) in _matrix_shapes(shape).items():
        kind = types[name] if inputs % 256 == 0 else FALLBACK.get(types[name], types[name])
        writer.add_tensor(name, _random_blocks(kind, rows, inputs, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(shape.hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(shape.hidden, np.float32))
        if shape.biases:
            for name, size in (("attn_q", shape.hidden), ("attn_k", kv), ("attn_v", kv)):
                writer.add_tensor(f"blk.{i}.{name}.bias", rng.normal(0, 0.5, size).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight GGUF file of a real model's shape (Q4_K_M mix).")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out")
    parser.add_argument("--vocab", required=True, help="a GGUF vocabulary file of the shape's tokenizer (llama.cpp's models/ggml-vocab-*.gguf)")
    args = parser.parse_args(argv)
    path = write_model_file(SHAPES[args.shape], args.vocab, args.out)
    print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
