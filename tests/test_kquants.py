"""A model in the types a user's Q4_K_M file holds, end to end: the default model written as a GGUF
file whose layers are Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K (llama.cpp's Q4_K_M of this model is mostly
Q5_0, Q8_0 and Q6_K: its 576-wide rows are not multiples of the K-quants' 256), loaded by
transformers like any file, runs on the compiled block pass with its logits, and greedy speculative
decoding equals plain decoding on every block pass "auto" may pick.

gguf-py quantises Q4_0, Q5_0, Q5_1 and Q8_0; the K-quant blocks are encoded here (``q4_k``, ``q5_k``, ``q6_k``), simply
(a scale per sub-block from its range) — the format is what matters, not the encoder's error."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from agentspec.engine import Engine
from agentspec.passes.blocks import BlockPass
from agentspec.passes.layouts import GGUF_TYPES, IntegerLayout
from agentspec.passes.products import blocks_unsupported, read_blocks
from agentspec.engine.kv import KVLayout
from agentspec.passes.packed import check_packed, use_packed_attention
from agentspec.passes.weights import NEAR_TOLERANCE, pass_layout, select_weights
from agentspec.model import load_model
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode, drafted_matching_plain, rewrite_gguf


def _half_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _k_quant(weights: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (``bits`` 4) or Q5_K (5) blocks of ``weights`` [rows, inputs]: per 256, d and dmin
    (float16), 6-bit scales and minimums of its 8 sub-blocks of 32, Q5_K's fifth bits (byte l: bit s
    is weight l of sub-block s's), the low 4 bits; w = d * scale * q - dmin * minimum."""
    rows, top = weights.shape[0], 2**bits - 1
    sub = weights.reshape(rows, -1, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # [rows, supers, 8]
    step = (sub.max(-1) - low) / top
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32) + 1e-12
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32) + 1e-12
    scales = np.clip(np.round(step / d[..., None]), 1, 63).astype(np.uint8)
    mins = np.clip(np.round(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    codes = np.round((sub + (dmin[..., None] * mins)[..., None]) / (d[..., None] * scales)[..., None])
    codes = np.clip(codes, 0, top).astype(np.uint8)  # [rows, supers, 8, 32]
    packed = np.concatenate(
        [
            (scales[..., :4] & 63) | ((scales[..., 4:] >> 4) << 6),
            (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6),
            (scales[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    fifth = [((codes >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2).astype(np.uint8)] if bits == 5 else []  # [rows, supers, 32]
    nibbles = ((codes[..., 0::2, :] & 15) | ((codes[..., 1::2, :] & 15) << 4)).reshape(rows, -1, 128)  # run c: sub-blocks 2c, 2c + 1
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), packed, *fifth, nibbles], axis=-1).reshape(rows, -1)


def q4_k(weights: np.ndarray) -> np.ndarray:
    return _k_quant(weights, 4)


def q5_k(weights: np.ndarray) -> np.ndarray:
    return _k_quant(weights, 5)


def q6_k(weights: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``weights`` [rows, inputs]: per 256, 6-bit codes (low 4 bits, then high 2), an
    8-bit scale per 16, d (float16); w = d * scale * (q - 32)."""
    rows = weights.shape[0]
    sub = weights.reshape(rows, -1, 16, 16)
    step = np.abs(sub).max(-1) / 31  # [rows, supers, 16]
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32) + 1e-12
    scales = np.clip(np.round(step / d[..., None]), 1, 127).astype(np.int8)
    codes = np.clip(np.round(sub / (d[..., None] * scales)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(rows, -1, 256)
    low, high = (codes & 15).reshape(rows, -1, 2, 2, 64), (codes >> 4).reshape(rows, -1, 2, 4, 32)
    ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(rows, -1, 128)
    qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)).reshape(rows, -1, 64)
    return np.concatenate([ql, qh, scales.view(np.uint8), _half_bytes(d)], axis=-1).reshape(rows, -1)


# Per layer (by index mod 3): the types of q, k, v / output / gate, up / down. A product stacks q, k
# and v (gate and up) on one kind of block: Q4_0, Q5_0 and Q8_0 are all read as signed bytes.
LAYOUT = (
    {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K"},
    {"ffn_down": "Q4_K"},  # the rest stays Q4_1
    {"attn_output": "Q5_1", "ffn_down": "Q5_K"},
)


def _to_layout(name: str, data: np.ndarray, kind: Any) -> tuple[np.ndarray, Any]:
    import gguf

    parts = name.split(".")
    wanted = LAYOUT[int(parts[1]) % 3].get(parts[2]) if parts[0] == "blk" else None
    if wanted is None:
        return data, kind
    weights = gguf.quants.dequantize(data, kind).reshape(data.shape[0], -1).astype(np.float32)
    kind = gguf.GGMLQuantizationType[wanted]
    return {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}.get(wanted, lambda w: gguf.quants.quantize(w, kind))(weights), kind


def _to_float(name: str, data: np.ndarray, kind: Any) -> tuple[np.ndarray, Any]:
    import gguf

    if kind.name not in GGUF_TYPES:
        return data, kind
    return gguf.quants.dequantize(data, kind).astype(np.float32), gguf.GGMLQuantizationType.F32


@pytest.fixture(scope="module")
def mixed(loaded, tmp_path_factory):
    """The default model as a file of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors, loaded."""
    path = tmp_path_factory.mktemp("kquants") / "SmolLM2-135M-Instruct.mixed.gguf"
    rewrite_gguf(loaded.gguf_file, path, _to_layout)
    model = load_model(path)
    if blocks_unsupported(model.model, model.gguf_file) is not None:
        pytest.skip(f"the GGUF block pass cannot run here: {blocks_unsupported(model.model, model.gguf_file)}")
    return model


@torch.inference_mode()
def test_a_file_of_k_quants_runs_on_the_compiled_block_pass_with_its_logits(mixed):
    """Every linear weight of the file is read from its blocks (so the decoder layers run in one
    compiled call), and the pass gives the loaded model's logits: float32 rows to float32 rounding;
    16-bit rows within their tolerance, each type's blocks in its own bits (Q4_0's and Q5_0's codes
    back in 4 and 5 bits, Q5_1's and Q5_K's in 5, Q6_K's in 6 with a scale per 16; the K-quants'
    scales "factored" as the file keeps them, a super-block's float16 scale and 6- or 8-bit factors:
    their products are no float16 values)."""
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(mixed.gguf_file)).tensors}
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"} <= kinds
    model, layout = mixed.model, KVLayout.of(mixed.model)
    use_packed_attention(model)
    exact = select_weights(model, layout, "gguf", mixed.gguf_file)
    assert isinstance(exact.forward, BlockPass)
    assert check_packed(model, layout, forward=exact.forward) <= 1e-3
    rounded = select_weights(model, layout, "gguf-q16", mixed.gguf_file).forward
    assert isinstance(rounded, BlockPass)
    downs = [layer.down.layout for layer in rounded.layers]  # Q6_K, Q4_K, Q5_K
    wanted = (IntegerLayout("6-bit", False, True, True), IntegerLayout("4-bit", True, True), IntegerLayout("5-bit", True, True))
    assert downs == [wanted[i % 3] for i in range(len(downs))]
    assert rounded.layers[2].o.layout == IntegerLayout("5-bit", True, False)  # Q5_1
    assert rounded.layers[0].gate_up.layout == IntegerLayout("5-bit", False, False)  # Q4_0 + Q5_0
    assert rounded.layers[0].qkv.layout == IntegerLayout("bytes", False, False)  # Q4_0 + Q5_0 + Q8_0
    assert rounded.layers[1].qkv.layout == IntegerLayout("4-bit", True, False)  # Q4_1
    assert check_packed(model, pass_layout(layout, rounded), NEAR_TOLERANCE, forward=rounded) <= NEAR_TOLERANCE


PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 20, separated by commas.",
]


@pytest.mark.parametrize("weights", ["gguf", "gguf-q16"])
def test_greedy_speculative_matches_plain_on_a_file_of_k_quants(mixed, engine, weights):
    """K pinned at 8, so drafts are verified at full length and rolled back, on each block pass."""
    target = Engine(mixed, weights=weights)
    target.costs = engine.costs
    assert drafted_matching_plain(target, mixed, PROMPTS) > 10


def test_the_mixed_file_is_a_coherent_model(mixed):
    """The encoders above keep the model what it was (so the equivalence test drafts real text): it
    still counts."""
    target = Engine(mixed, weights="gguf")
    ids = mixed.chat.encode([{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    seq, pieces = decode(target, ids, GenerationParams(max_tokens=24, spec=SpecConfig(enabled=False)))
    text = "".join(pieces)
    assert list(dict.fromkeys(re.findall(r"\d+", text)))[:5] == ["1", "2", "3", "4", "5"], text  # "1, 2, ..." or "1. 1\n2. 2 ..."


def test_a_file_without_block_types_the_kernels_read_is_refused_with_the_types(mixed, tmp_path):
    """read_blocks names the types it reads where a file has none of them (here: every linear weight
    of the mixed file stored as float32)."""
    path = tmp_path / "float.gguf"
    rewrite_gguf(mixed.gguf_file, path, _to_float)
    with pytest.raises(NotImplementedError, match="has no weights of the types the kernels read"):
        read_blocks(mixed.model, path)
