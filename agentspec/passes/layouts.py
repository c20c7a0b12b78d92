"""A GGUF matrix's weights as the kernels read them: blocks of 32 weights and their layouts.

``tensor_blocks`` reads a GGUF tensor's bytes into ``Blocks`` of one of four kinds (``BLOCK_TYPES``),
each weight rounded exactly as the GGUF reader dequantises it. ``Blocks.grouped`` lays them out for
the products on float32 rows (a group of outputs' blocks side by side, so a product of one row
streams one run of memory per tile of outputs), ``Blocks.by_lanes`` for the integer products (codes
in as few bits as they need, scales as float16 or as the K-quants' factors: ``IntegerLayout``).
``FileBlocks`` is a matrix of a mapped file not read yet: ``by_runs`` and ``by_lanes_of_runs`` build a
layout from it in runs of rows, so no whole matrix is ever converted at once.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..gguf import GGML_TYPES, GGUFTensor
from .levels import address
from .threads import kernel_threads

__all__ = [
    "BLOCK", "GROUPS", "BLOCK_TYPES", "GGUF_TYPES", "ACTIVATIONS", "INTEGER_ACTIVATIONS", "INTEGER_CODES", "INTEGER_OFFSETS", "SUPER",
    "READ_AS", "IntegerLayout", "integer_layout_of", "Blocks", "tensor_blocks", "FileBlocks", "FileRun", "Part", "rotary_order", "unpermuted", "by_runs", "by_lanes_of_runs",
    "layout_bytes",
]

BLOCK = 32  # weights per block, both types
GROUPS = (8, 4)  # outputs whose blocks are stored together: for products of 1-2 rows, of more (FEW, MANY in blocks.c)
# The kernels' blocks of 32 weights (blocks.c): Q4_1 (4-bit codes, a scale and a minimum), Q8_0
# (signed bytes, a scale), Q8_16 (signed bytes, a scale per 16) and Q8_1 (unsigned bytes, a scale and
# a minimum). The integer products take each in as many bits as its codes need (IntegerLayout).
BLOCK_TYPES = ("Q4_1", "Q8_0", "Q8_16", "Q8_1")
# Bytes of one output's block in ``Blocks.grouped``: its codes, then its float32 scales (and minimum)
# (blocks.c: Q4_1_BYTES(1) ...)
GROUPED_BYTES = {"Q4_1": 16 + 8, "Q8_0": 32 + 4, "Q8_16": 32 + 8, "Q8_1": 32 + 8}
# The GGUF types read into them, each weight exactly as the GGUF reader dequantises it: (weights per
# block, bytes per block). Q4_0 and Q5_0 become Q8_0 (code - 8 or - 16, the block's scale); Q4_K
# becomes Q4_1 (per 32 weights: the super-block's scale times the 6-bit scale, minus its minimum
# times the 6-bit minimum); Q6_K becomes Q8_16 (code - 32, the super-block's scale times the 8-bit
# scale of each 16); Q5_1 and Q5_K become Q8_1 (5-bit codes as bytes; Q5_K's scales and minimums as
# Q4_K's). The rest (Q2_K, Q3_K, IQ types, float tensors) take oneDNN's float32 products.
GGUF_TYPES = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
# What a product multiplies the blocks by: float32 rows (the loaded model's products), or the rows
# quantised per block of 32 to integers, multiplied by the codes with exact integer dot products: to
# 8 bits as llama.cpp does (``"q8"``), or to 16 (``"q16"``: within ~0.01 of float32's logits on the
# default model). Both are another model's arithmetic (weights.py: "gguf-q8" is asked for by name,
# "gguf-q16" is a candidate of "auto").
ACTIVATIONS = ("float32", "q8", "q16")
INTEGER_ACTIVATIONS = ("q8", "q16")
# The integer products' codes (blocks.c: CODES_*), as many bytes a weight as the file's: signed bytes
# (Q8_0's, stored + 128), 4-bit codes two to a byte as the file packs them (Q4_0's, Q4_1's, Q4_K's),
# 5-bit ones (Q5_0's, Q5_1's, Q5_K's: the 4-bit registers, then one register of the fifth bits) and
# 6-bit ones (Q6_K's: the 5-bit registers, then one of the sixth bits). Blocks without minimums store
# their codes offset to unsigned ones: by 128, 8, 16 and 32.
INTEGER_CODES = ("bytes", "4-bit", "5-bit", "6-bit")
INTEGER_OFFSETS = {"bytes": 128, "4-bit": 8, "5-bit": 16, "6-bit": 32}
SUPER = 8  # blocks of a K-quant super-block (256 weights): their scales share a float16 one (blocks.c: SUPER)
# ``code_statistics`` of a GGUF type's blocks over its whole range of codes, scales as the type keeps
# them: the integer layout a matrix of that type nearly always takes (``by_lanes_of_runs`` starts in it)
FULL_RANGE = {
    "Q4_0": (False, -8, 7), "Q4_1": (False, 0, 15), "Q5_0": (False, -16, 15), "Q5_1": (False, 0, 31), "Q8_0": (False, -127, 127),
    "Q4_K": (True, 0, 15), "Q5_K": (True, 0, 31), "Q6_K": (True, -32, 31),
}


@dataclass(frozen=True)
class IntegerLayout:
    """How the integer products read a matrix's blocks (``Blocks.by_lanes``; blocks.c: INT_LAYOUT)."""

    codes: str  # one of INTEGER_CODES
    mins: bool  # a minimum per block (else the codes are offset: INTEGER_OFFSETS)
    # scales (and minimums) as the K-quants keep them: 8-bit factors of a float16 scale per super-block
    # (Blocks.factors, Blocks.supers), no float16 values themselves; else as float16
    factored: bool
    halves: bool = False  # a scale per 16 weights (Q6_K's)

    def number(self, activations: str) -> int:
        """blocks.c's INT_LAYOUT of these blocks times ``activations`` ("q8" or "q16")."""
        number = ((INTEGER_CODES.index(self.codes) * 2 + self.mins) * 2 + self.factored) * 2 + self.halves
        return number * 2 + INTEGER_ACTIVATIONS.index(activations)


def integer_layout_of(kind: str, has_factors: bool, factored: bool, low: int, high: int) -> IntegerLayout | str:
    """How the integer products read blocks of ``kind`` (``Blocks.integer_layout``) whose scales
    (or minimums) are not all float16 values (``factored``) and whose codes span ``low..high``
    (``Blocks.code_statistics``; a matrix read in runs of rows: any run's, the least, the largest), or
    why they cannot; ``has_factors``: they keep a K-quant's factors."""
    if kind == "Q8_16":  # Q6_K's: a scale per 16 weights, 8-bit factors of the super-block's
        if low < -32 or high > 31:
            return f"the integer products take blocks with a scale per 16 weights in codes of up to 6 bits, and these span {low}..{high}"
        factored = True
    elif kind == "Q8_1" and high > 31:
        return f"the integer products take unsigned codes of up to 5 bits with minimums, and these reach {high}"
    if factored and not has_factors:
        if kind == "Q8_16":
            return "the integer products take a scale per 16 weights only as a K-quant's 8-bit factors of a float16 one (Q6_K's), and these blocks have none"
        return "the integer products take scales that are float16 values or a K-quant's 8-bit factors of one, and these are neither"
    if kind == "Q4_1":
        return IntegerLayout("4-bit", True, factored)
    if kind == "Q8_16":
        return IntegerLayout("6-bit", False, True, True)
    if kind == "Q8_1":
        return IntegerLayout("4-bit" if high <= 15 else "5-bit", True, factored)
    fits = [codes for codes in ("4-bit", "5-bit") if -INTEGER_OFFSETS[codes] <= low and high < INTEGER_OFFSETS[codes]]
    return IntegerLayout(fits[0] if fits else "bytes", False, False)


@dataclass(frozen=True)
class Blocks:
    """One weight matrix [outputs, inputs] as blocks of 32 along its inputs."""

    kind: str  # one of BLOCK_TYPES
    codes: torch.Tensor  # Q4_1: uint8 [outputs, inputs / 32, 16]; Q8_0, Q8_16: int8, Q8_1: uint8 [outputs, inputs / 32, 32]
    scales: torch.Tensor  # float32 [outputs, inputs / 32] (Q8_16: [outputs, inputs / 16])
    mins: torch.Tensor  # float32 [outputs, inputs / 32] (Q8_0, Q8_16: zeros, unused)
    # The K-quants' scales and minimums as their file keeps them (tensor_blocks; None for the other
    # types): per block its 8-bit factors — of its scale (Q8_16: of each half's), then of its minimum —
    # and per super-block of SUPER blocks the float16 values they multiply — d, then -dmin: scales ==
    # supers * factors and mins == supers * factors, exactly (11 bits times 8 fit float32's 24).
    factors: torch.Tensor | None = None  # int8 [outputs, inputs / 32, scales per block + has_mins]
    supers: torch.Tensor | None = None  # float32 [outputs, ceil(inputs / 32 / SUPER), 1 + has_mins]

    @property
    def has_mins(self) -> bool:
        return self.kind in ("Q4_1", "Q8_1")

    @property
    def has_factors(self) -> bool:
        """Whether they keep a K-quant's factors (``factors``, ``supers``)."""
        return self.factors is not None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * BLOCK

    def dequantised(self) -> torch.Tensor:
        """The float32 weights, rounded as the GGUF reader rounds them (a product, then a sum)."""
        if self.has_mins:
            codes = torch.cat([self.codes & 15, self.codes >> 4], dim=-1) if self.kind == "Q4_1" else self.codes
            return (self.scales[..., None] * codes.float() + self.mins[..., None]).reshape(self.shape)
        outputs, blocks = self.codes.shape[:2]
        per = 2 if self.kind == "Q8_16" else 1  # scales per block
        return (self.scales.view(outputs, blocks, per, 1) * self.codes.view(outputs, blocks, per, -1).float()).reshape(self.shape)

    def grouped(self, group: int) -> torch.Tensor:
        """The blocks as ``blocks.c`` reads them: outputs in groups of ``group`` (the last padded
        with zeros); per group, its blocks in input order, each the group's codes, then its scales
        (and minimums) as float32: ``[groups, inputs / 32, group * bytes per block]`` bytes."""
        outputs, blocks = self.codes.shape[:2]
        groups = -(-outputs // group)

        def per_group(part: torch.Tensor) -> torch.Tensor:  # [outputs, blocks, bytes] -> [groups, blocks, group * bytes]
            part = torch.cat([part, part.new_zeros(groups * group - outputs, *part.shape[1:])])
            return part.view(groups, group, blocks, -1).transpose(1, 2).reshape(groups, blocks, -1)

        parts = [self.codes.view(torch.uint8), self.scales.view(outputs, blocks, -1).view(torch.uint8)]
        if self.has_mins:
            parts.append(self.mins[..., None].view(torch.uint8))
        return torch.cat([per_group(p) for p in parts], dim=-1).contiguous()

    def integer_layout(self) -> IntegerLayout | str:
        """How the integer products read these blocks (``by_lanes``), or why they cannot: in as few
        bits as their codes take (Q4_0's and Q5_0's, read as Q8_0, back to 4 and 5 bits; Q5_1's and
        Q5_K's, read as Q8_1, to 5; Q6_K's, read as Q8_16, to 6), with scales as float16 or, where they
        are no float16 values, as the K-quants' factors. Found once per matrix (it reads every code
        and scale)."""
        return self._integer_layout

    @functools.cached_property
    def _integer_layout(self) -> IntegerLayout | str:
        return integer_layout_of(self.kind, self.has_factors, *self.code_statistics())

    def code_statistics(self) -> tuple[bool, int, int]:
        """What the integer layout depends on (``integer_layout_of``): whether a scale (or minimum)
        is not a float16 value, and the smallest and largest code."""
        values = (self.scales, self.mins) if self.has_mins else (self.scales,)
        factored = not all(torch.equal(v.to(torch.float16).float(), v) for v in values)
        low, high = (int(v) for v in torch.aminmax(self.codes)) if self.codes.numel() else (0, 0)
        return factored, low, high

    def by_lanes(self, lanes: int, layout: IntegerLayout | None = None) -> torch.Tensor:
        """The blocks as the integer products of ``blocks.c`` read them (``integer_layout``), ``lanes``
        outputs to a register (the level's: 16 on AVX-512, 8 on AVX2): outputs in groups of
        ``lanes`` (the last padded with zeros); per group, its blocks in input order, each its codes as
        registers of ``lanes`` 4-byte lanes, then the ``lanes`` scales (and minimums) as float16 — the
        file's own values — (halves: the ``lanes`` scales of each half block in turn): ``[groups,
        inputs / 32, bytes per block]``; factored, each block's ``lanes`` factors (scales, minimums)
        as signed bytes, and before each super-block of SUPER blocks the ``lanes`` float16 values
        they multiply (d, then -dmin): ``[groups, bytes per group]``. Register j, lane o: output o's codes
        4j..4j+3 as bytes (plus 128); or, 4-, 5- and 6-bit codes, the bytes holding codes 4j..4j+3 in
        their low nibbles and 16+4j.. in their high ones (registers 0..3), then the fifth bits
        (register 4: bit 8i + j is code 4j + i's) and the sixth (register 5, arranged the same).
        ``layout``: the one to write (a run of a matrix's rows takes the matrix's), default theirs."""
        layout = layout or self.integer_layout()
        if isinstance(layout, str):
            raise NotImplementedError(layout)
        outputs, blocks = self.codes.shape[:2]
        groups = -(-outputs // lanes)
        pad = groups * lanes - outputs
        if self.kind == "Q4_1":  # (always 4-bit) byte j holds codes j and j + 16 already, as the file packs them
            stored = self.codes
        else:  # unsigned: the offset added in bytes (wrapping as two's complement does)
            codes = self.codes.view(torch.uint8) + (0 if layout.mins else INTEGER_OFFSETS[layout.codes])  # [outputs, blocks, 32]
            if layout.codes == "bytes":
                stored = codes
            else:
                parts = [(codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)]  # as the file packs 4-bit codes
                shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
                for bit in range(4, 4 + INTEGER_CODES.index(layout.codes) - 1):  # 5-bit: bit 4; 6-bit: bits 4 and 5
                    high = ((codes >> bit) & 1).view(*codes.shape[:-1], 8, 4)  # [.., j, i]: code 4j + i's bit
                    parts.append((high << shifts).sum(-2, dtype=torch.uint8))  # byte i, bit j: code 4j + i's
                stored = torch.cat(parts, dim=-1)
        stored = torch.cat([stored, stored.new_zeros(pad, *stored.shape[1:])])
        registers = stored.shape[-1] // 4  # 8 (bytes), 4 (4-bit), 5 (5-bit) or 6 (6-bit)
        parts = [stored.view(groups, lanes, blocks, registers, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, -1)]

        def by_group(values: torch.Tensor) -> torch.Tensor:  # [outputs, n, k] -> bytes [groups, n, k lanes' values in turn]
            values = torch.cat([values, values.new_zeros(pad, *values.shape[1:])])
            return values.view(groups, lanes, values.shape[1], -1).permute(0, 2, 3, 1).contiguous().view(groups, values.shape[1], -1).view(torch.uint8)

        if not layout.factored:
            for values in (self.scales, self.mins) if layout.mins else (self.scales,):
                parts.append(by_group(values.reshape(outputs, blocks, -1).to(torch.float16)))  # [outputs, blocks, 1 or 2 (halves)]
            return torch.cat(parts, dim=-1).contiguous()
        assert self.factors is not None and self.supers is not None  # integer_layout: factored only with them
        per_block = torch.cat([*parts, by_group(self.factors)], dim=-1)  # [groups, blocks, bytes per block]
        supers = by_group(self.supers.to(torch.float16))  # [groups, super-blocks, bytes]
        count, size = supers.shape[1], per_block.shape[-1]
        per_block = torch.cat([per_block, per_block.new_zeros(groups, count * SUPER - blocks, size)], dim=1).view(groups, count, -1)
        return torch.cat([supers, per_block], dim=-1).view(groups, -1)[:, : count * supers.shape[-1] + blocks * size].contiguous()

    def integer_unsupported(self) -> str | None:
        """Why the integer products cannot take these blocks (``by_lanes``), or None when they can."""
        layout = self.integer_layout()
        return layout if isinstance(layout, str) else None

    def rows(self, order: torch.Tensor) -> "Blocks":
        return Blocks(self.kind, *(None if t is None else t[order].contiguous() for t in (self.codes, self.scales, self.mins, self.factors, self.supers)))

    def dequantised_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 weights (as ``FileBlocks.dequantised_rows``)."""
        return self.rows(ids).dequantised()

    def slice(self, start: int, stop: int) -> "Blocks":
        """Outputs ``start`` .. ``stop - 1`` (views)."""
        return Blocks(self.kind, *(None if t is None else t[start:stop] for t in (self.codes, self.scales, self.mins, self.factors, self.supers)))

    @staticmethod
    def stack(parts: Sequence["Blocks"]) -> "Blocks":
        """The outputs of ``parts`` (one kind) in turn; factored where every part is."""
        fields = ("codes", "scales", "mins") + (("factors", "supers") if all(p.factors is not None for p in parts) else ())
        return Blocks(parts[0].kind, *(torch.cat([getattr(p, f) for p in parts]).contiguous() for f in fields))


def _halves(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 values, 2 bytes each along the last axis, as float32."""
    return raw.copy().view(np.float16).astype(np.float32)


def _torch(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def tensor_blocks(kind: str, raw: np.ndarray) -> Blocks | None:
    """A GGUF tensor's blocks from its bytes (``raw``: ``[outputs, bytes]``, as gguf-py reads them)
    for a type in ``GGUF_TYPES``, rounded exactly as gguf-py's ``dequantize`` rounds them (each a
    product, then a sum); None for other types."""
    if kind not in GGUF_TYPES:
        return None
    size, width = GGUF_TYPES[kind]
    raw = np.asarray(raw).view(np.uint8)
    outputs = raw.shape[0]
    raw = raw.reshape(outputs, -1, width)  # [outputs, blocks (super-blocks for K types), bytes]
    if kind == "Q4_1":
        scales, mins, codes = _torch(_halves(raw[..., 0:2])[..., 0], _halves(raw[..., 2:4])[..., 0], raw[..., 4:])
        return Blocks("Q4_1", codes, scales, mins)
    if kind == "Q5_1":  # d, m (float16), 32 fifth bits, 16 bytes of nibbles
        nibbles = raw[..., 8:]
        high = (raw[..., 4:8].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1) | (high.astype(np.uint8) << 4)
        scales, mins, codes = _torch(_halves(raw[..., 0:2])[..., 0], _halves(raw[..., 2:4])[..., 0], codes)
        return Blocks("Q8_1", codes, scales, mins)
    if kind in ("Q4_0", "Q5_0", "Q8_0"):
        if kind == "Q8_0":
            codes = raw[..., 2:].copy().view(np.int8)
        else:
            nibbles = raw[..., -16:]
            codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int8)  # byte j: codes j and j + 16
            if kind == "Q5_0":  # the fifth bits: bit j of a 32-bit word
                high = (raw[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
                codes = codes | (high.astype(np.int8) << 4)
            codes = codes - np.int8(8 if kind == "Q4_0" else 16)
        scales, codes = _torch(_halves(raw[..., 0:2])[..., 0], codes)
        return Blocks("Q8_0", codes, scales, torch.zeros_like(scales))
    blocks = raw.shape[1] * size // BLOCK
    if kind in ("Q4_K", "Q5_K"):  # d, dmin (float16), 12 bytes of 6-bit scales and minimums, [Q5_K: 32 bytes of fifth bits,] 128 of nibbles
        d, dmin, packed, nibbles = _halves(raw[..., 0:2]), _halves(raw[..., 2:4]), raw[..., 4:16].reshape(outputs, -1, 3, 4), raw[..., -128:]
        low, high, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        sub_scales = np.concatenate([low & 63, (both & 15) | ((low >> 2) & 48)], axis=-1).astype(np.float32)  # [outputs, super-blocks, 8]
        sub_mins = np.concatenate([high & 63, (both >> 4) | ((high >> 2) & 48)], axis=-1).astype(np.float32)
        scales, mins = (d * sub_scales).reshape(outputs, blocks), -(dmin * sub_mins).reshape(outputs, blocks)
        factors = np.stack([sub_scales, sub_mins], axis=-1).reshape(outputs, blocks, 2).astype(np.int8)
        supers = np.concatenate([d, -dmin], axis=-1)  # [outputs, super-blocks, 2]
        # 4 runs of 32 bytes: sub-block 2c in the low nibbles of run c, 2c + 1 in the high ones
        runs = nibbles.reshape(outputs, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        codes = (runs & 15).reshape(outputs, blocks, 32)
        if kind == "Q5_K":  # sub-block s's fifth bits: bit s of the 32 bytes
            high = raw[..., 16:48].reshape(outputs, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            codes = codes | ((high & 1).reshape(outputs, blocks, 32) << 4)
            return Blocks("Q8_1", *_torch(codes, scales, mins, factors, supers))
        codes = codes[..., :16] | (codes[..., 16:] << 4)  # as Q4_1 packs them: byte j holds codes j and j + 16
        return Blocks("Q4_1", *_torch(codes, scales, mins, factors, supers))
    # Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed 8-bit scales (one per 16), d (float16)
    low = raw[..., 0:128].reshape(outputs, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    high = raw[..., 128:192].reshape(outputs, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    codes = ((low & 15).reshape(outputs, blocks, 32) | ((high & 3).reshape(outputs, blocks, 32) << 4)).astype(np.int8) - np.int8(32)
    factors = raw[..., 192:208].copy().view(np.int8)  # [outputs, super-blocks, 16]
    d = _halves(raw[..., 208:210])
    scales, codes, factors, supers = _torch((d * factors.astype(np.float32)).reshape(outputs, blocks * 2), codes, factors.reshape(outputs, blocks, 2), d)
    return Blocks("Q8_16", codes, scales, torch.zeros(outputs, blocks), factors, supers)


def rotary_order(outputs: int, heads: int) -> torch.Tensor:
    """For each of ``outputs`` query/key rows, the row llama.cpp's converter stored it as: within a
    head, the two rotary halves interleaved (output t * half + j is row 2j + t)."""
    return torch.arange(outputs).reshape(heads, outputs // heads // 2, 2).transpose(1, 2).reshape(outputs)


def unpermuted(blocks: Blocks, heads: int) -> Blocks:
    """Undo llama.cpp's converter, which stores each head's query/key rows with the two rotary halves
    interleaved (transformers' GGUF reader undoes it the same way)."""
    return blocks.rows(rotary_order(blocks.shape[0], heads))


# The kind of blocks each GGUF type is read into (``tensor_blocks``)
READ_AS = {"Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q4_1": "Q4_1", "Q4_K": "Q4_1", "Q5_1": "Q8_1", "Q5_K": "Q8_1", "Q6_K": "Q8_16"}
# Weights of a run of rows read at a time while a product's layout is built: the transient memory of a
# build is a few times this many bytes, whatever the matrix (a 151,936-row LM head included)
RUN_WEIGHTS = 1 << 22
RUN_ALIGN = 64  # a run's rows: a multiple of every level's lanes and of GROUPS


@dataclass(frozen=True)
class FileBlocks:
    """A matrix of a mapped GGUF file, read into blocks in runs of rows (``slice``) while a product's
    layout is built, its pages of the file let go after (``release``): the product's layout is the
    only copy of the weights that stays in memory, and no whole matrix is ever converted at once.
    ``heads``: llama.cpp's converter interleaved the rotary halves of each of this many heads' rows
    (undone as they are read)."""

    tensor: GGUFTensor
    heads: int | None = None

    @property
    def kind(self) -> str:
        return READ_AS[self.tensor.type_name]

    @property
    def shape(self) -> tuple[int, int]:
        return self.tensor.shape[0], self.tensor.shape[1]

    def slice(self, start: int, stop: int) -> Blocks:
        """Outputs ``start`` .. ``stop - 1`` as blocks (read from the file)."""
        kind, data = self.tensor.type_name, self.tensor.data
        if self.heads is None:
            blocks = tensor_blocks(kind, data[start:stop])
        else:
            per = self.shape[0] // self.heads  # a head's rows: the interleaving stays within them
            first, last = start // per * per, -(-stop // per) * per
            blocks = unpermuted(tensor_blocks(kind, data[first:last]), (last - first) // per).slice(start - first, stop - first)
        self.tensor.file.release(self.tensor, slice(start, stop))  # converted: the file's pages may go
        return blocks

    def row_addresses(self, start: int, stop: int) -> np.ndarray:
        """Where outputs ``start`` .. ``stop - 1`` lie in the mapping (uint64 addresses of their rows of
        GGUF blocks; with ``heads``, the rows llama.cpp's converter moved them to)."""
        data = self.tensor.data
        if self.heads is None:
            rows = np.arange(start, stop, dtype=np.uint64)
        else:
            rows = rotary_order(self.shape[0], self.heads)[start:stop].numpy().astype(np.uint64)
        return data.ctypes.data + rows * np.uint64(data.shape[1])

    def dequantised_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 weights (an embedding's: its rows in the file's order), read from
        the file (``GGUFFile.read_rows``) without mapping its pages."""
        return tensor_blocks(self.tensor.type_name, self.tensor.file.read_rows(self.tensor, ids.cpu().numpy())).dequantised()

    def release(self) -> None:
        """Let go of the matrix's pages of the file (a product built on it no longer reads them)."""
        self.tensor.file.release(self.tensor)


Part = Blocks | FileBlocks

# The GGUF types the kernels' repacker reads (blocks.c: agentspec_gguf_by_lanes), by ggml type number
GGML_NUMBERS = {name: number for number, (name, _, _) in GGML_TYPES.items() if name in GGUF_TYPES}
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


class FileRun:
    """A run of outputs of mapped GGUF matrices (``FileBlocks``) not converted yet, which the compiled
    kernels lay out for the integer products straight from the file's bytes (blocks.c:
    ``agentspec_gguf_statistics``, ``agentspec_gguf_by_lanes``: the same bytes as ``Blocks.by_lanes``
    of ``tensor_blocks``, about twenty times faster); its pages of the file are let go once laid out."""

    def __init__(self, pieces: Sequence[tuple[FileBlocks, int, int]], kernels) -> None:
        self.kernels, self.pieces = kernels, list(pieces)
        first = self.pieces[0][0]
        self.kind, self.inputs = first.kind, first.shape[1]
        for part, start, stop in self.pieces:  # the kernels read `inputs` weights of each row where its address says
            weights, size = GGUF_TYPES[part.tensor.type_name]
            data = part.tensor.data
            if part.shape[1] != self.inputs or self.inputs % weights or data.ndim != 2 or data.shape[1] < self.inputs // weights * size or not 0 <= start <= stop <= data.shape[0]:
                raise ValueError(f"{part.tensor.name}: rows {start}..{stop} of {self.inputs} {part.tensor.type_name} weights are not in its data {data.shape}")
        self.addresses = np.ascontiguousarray(np.concatenate([part.row_addresses(start, stop) for part, start, stop in self.pieces]))
        self.types = np.concatenate([np.full(stop - start, GGML_NUMBERS[part.tensor.type_name], np.int32) for part, start, stop in self.pieces])
        self.has_factors = all(part.tensor.type_name in _K_QUANTS for part, _, _ in self.pieces)

    @property
    def outputs(self) -> int:
        return len(self.addresses)

    def code_statistics(self) -> tuple[bool, int, int]:
        """As ``Blocks.code_statistics`` (Q4_1's codes compared unpacked: ``integer_layout_of`` does
        not look at them)."""
        stats = (ctypes.c_int * 3)()
        if self.kernels.agentspec_gguf_statistics(*self._rows(), self.outputs, self.inputs, kernel_threads(), stats):
            raise ValueError("the kernels' repacker does not read these blocks")
        return bool(stats[0]), stats[1], stats[2]

    def _rows(self) -> tuple[int, int]:
        """The addresses of the rows' addresses and of their types, for the kernels."""
        return address(self.addresses, self.outputs, (np.uint64,), "the rows' addresses"), address(self.types, self.outputs, (np.int32,), "the rows' types")

    def by_lanes(self, lanes: int, layout: IntegerLayout, into: torch.Tensor | None = None) -> torch.Tensor:
        """``Blocks.by_lanes(lanes, layout)`` of these outputs, from the file's bytes (written ``into``
        a contiguous tensor of that shape where given); then their pages go."""
        return self._by_lanes(lanes, layout, into, None)

    def by_lanes_and_statistics(self, lanes: int, layout: IntegerLayout, into: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[bool, int, int]]:
        """``by_lanes`` and ``code_statistics`` in one reading of the file (a run written in the
        layout of the runs before it finds on the way whether it needs a wider one)."""
        stats = (ctypes.c_int * 3)()
        return self._by_lanes(lanes, layout, into, stats), (bool(stats[0]), stats[1], stats[2])

    def _by_lanes(self, lanes: int, layout: IntegerLayout, into: torch.Tensor | None, stats) -> torch.Tensor:
        if lanes != self.kernels.lanes:
            raise ValueError(f"the kernels lay out {self.kernels.lanes} lanes, not {lanes}")
        groups, size = -(-self.outputs // lanes), _group_bytes(self.kind, self.inputs, lanes, layout)
        if into is not None and (into.dtype != torch.uint8 or not into.is_contiguous() or into.numel() != groups * size):
            raise ValueError(f"a run's layout is {groups} x {size} bytes, contiguous")
        out = torch.empty(groups, size, dtype=torch.uint8) if into is None else into.view(groups, size)
        codes = INTEGER_CODES.index(layout.codes)
        if self.kernels.agentspec_gguf_by_lanes(
            *self._rows(), self.outputs, self.inputs, codes, layout.mins, layout.factored, layout.halves,
            kernel_threads(), address(out, groups * size, (torch.uint8,), "a run's layout"), stats,
        ):
            raise ValueError("the kernels' repacker does not read these blocks")
        for part, start, stop in self.pieces:
            part.tensor.file.release(part.tensor, slice(start, stop))  # laid out: the file's pages may go
        if into is not None:
            return into
        if not layout.factored:
            return out.view(out.shape[0], -(-self.inputs // BLOCK), -1)  # [groups, blocks, bytes per block], as Blocks.by_lanes
        return out


def layout_bytes(kind: str, outputs: int, inputs: int, group: int, layout: IntegerLayout | None = None) -> int:
    """Bytes of ``outputs`` x ``inputs`` weights of ``kind`` as the kernels read them:
    ``Blocks.grouped(group)``, or with an integer ``layout``, ``Blocks.by_lanes(group, layout)``."""
    groups = -(-outputs // group)
    return groups * (inputs // BLOCK * group * GROUPED_BYTES[kind] if layout is None else _group_bytes(kind, inputs, group, layout))


def _group_bytes(kind: str, inputs: int, lanes: int, layout: IntegerLayout) -> int:
    """Bytes of a group of ``lanes`` outputs in ``layout`` (``Blocks.by_lanes``)."""
    blocks = inputs // BLOCK
    registers = 8 if layout.codes == "bytes" else 3 + INTEGER_CODES.index(layout.codes)
    values = (2 if layout.halves else 1) + layout.mins  # scales (and minimums) a block
    if not layout.factored:
        return blocks * (registers * 4 + values * 2) * lanes
    return -(-blocks // SUPER) * (1 + layout.mins) * 2 * lanes + blocks * (registers * 4 + values) * lanes


def _run(parts: Sequence[Part], first: int, last: int, kernels=None) -> Blocks | FileRun:
    """Outputs ``first`` .. ``last - 1`` of the outputs of ``parts`` in turn (one kind), as blocks; or,
    with ``kernels``, as a ``FileRun`` (every part a ``FileBlocks``)."""
    pieces, start = [], 0
    for part in parts:
        stop = start + part.shape[0]
        if start < last and stop > first:
            pieces.append((part, max(first, start) - start, min(last, stop) - start))
        start = stop
    if kernels is not None:
        return FileRun(pieces, kernels)  # type: ignore[arg-type]
    blocks = [part.slice(begin, end) for part, begin, end in pieces]
    return blocks[0] if len(blocks) == 1 else Blocks.stack(blocks)


def _run_rows(inputs: int) -> int:
    return max(RUN_ALIGN, RUN_WEIGHTS // inputs // RUN_ALIGN * RUN_ALIGN)


def _full_range_layout(parts: Sequence[Part]) -> IntegerLayout | None:
    """The integer layout of blocks of the first part's GGUF type over its whole range (``FULL_RANGE``),
    or None where the integer products take no such blocks."""
    statistics = FULL_RANGE.get(parts[0].tensor.type_name)  # type: ignore[union-attr]
    if statistics is None:
        return None
    layout = integer_layout_of(parts[0].kind, all(part.tensor.type_name in _K_QUANTS for part in parts), *statistics)  # type: ignore[union-attr]
    return layout if isinstance(layout, IntegerLayout) else None


class _Relayout(Exception):
    """A run's blocks need another integer layout than the runs before them took."""


def by_runs(parts: Sequence[Part], group: int, layout_of: Callable[..., torch.Tensor], kernels=None) -> torch.Tensor:
    """``layout_of`` (a layout in groups of ``group`` outputs, ``[groups, ...]``) of the outputs of
    ``parts`` in turn, built in runs of rows into one tensor. With ``kernels``, each run is a
    ``FileRun`` and, after the first, ``layout_of(run, into)`` may write its layout ``into`` its part
    of the tensor (and return that)."""
    outputs = sum(part.shape[0] for part in parts)
    rows = _run_rows(parts[0].shape[1])
    out, group_at = None, 0
    for first in range(0, outputs, rows):
        run = _run(parts, first, min(first + rows, outputs), kernels)
        into = None if out is None or kernels is None else out[group_at : group_at + -(-run.outputs // group)]
        piece = layout_of(run) if into is None else layout_of(run, into)
        if out is None:
            out = torch.empty(-(-outputs // group), *piece.shape[1:], dtype=piece.dtype)
        if piece is not into:
            out[group_at : group_at + piece.shape[0]] = piece
        group_at += piece.shape[0]
    return out


def by_lanes_of_runs(parts: Sequence[Part], lanes: int, kernels=None) -> tuple[torch.Tensor, IntegerLayout]:
    """``Blocks.by_lanes`` of the outputs of ``parts`` in turn, built in runs of rows, and the layout:
    the one their codes and scales take together (``integer_layout_of``). Each run is written in the
    layout of the runs so far; a run that needs a wider one (larger codes, scales that are not
    float16 values) starts the build again in it — the layouts only widen, and a matrix's runs
    nearly always agree, so the file is nearly always read once. ``NotImplementedError`` where the
    integer products cannot take them. ``kernels`` (of ``lanes``): parts that are all ``FileBlocks``
    are laid out by them straight from the file (``FileRun``)."""
    kind, statistics, factors = parts[0].kind, None, True
    if kernels is not None and not all(isinstance(part, FileBlocks) and part.tensor.type_name in GGML_NUMBERS for part in parts):
        kernels = None
    # From the file, the first run too is laid out as it is read: in the layout of its type's whole
    # range, or after a restart the one the statistics found so far want
    full_range = _full_range_layout(parts) if kernels is not None else None
    while True:
        layout: IntegerLayout | None = None

        def layout_of(run: Blocks | FileRun, into: torch.Tensor | None = None) -> torch.Tensor:
            nonlocal layout, statistics, factors
            laid_out, writing = None, layout or (full_range if statistics is None else integer_layout_of(kind, factors, *statistics))
            if writing is not None and isinstance(run, FileRun):  # in that layout, the statistics found on the way
                laid_out, found = run.by_lanes_and_statistics(lanes, writing, into)
            else:
                found = run.code_statistics()
            statistics = found if statistics is None else (statistics[0] or found[0], min(statistics[1], found[1]), max(statistics[2], found[2]))
            factors = factors and run.has_factors
            wanted = integer_layout_of(kind, factors, *statistics)
            if isinstance(wanted, str):
                raise NotImplementedError(wanted)
            if writing is not None and wanted != writing:
                raise _Relayout
            layout = wanted
            return laid_out if laid_out is not None else run.by_lanes(lanes, wanted)

        try:
            return by_runs(parts, lanes, layout_of, kernels), layout
        except _Relayout:
            continue  # again, from the first run, with what the runs so far need (kept in ``statistics``)
