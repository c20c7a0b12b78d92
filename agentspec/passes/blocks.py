"""The target pass on a GGUF file's own weight blocks (``weights="gguf"``): the loaded weights, in
a fifth of the bytes.

A pass of a small model on a CPU streams every weight once per token, so the bytes it reads set its
time. The default model's file stores its linear weights as Q4_1 blocks (32 weights share a float16
scale and minimum: 0.625 bytes a weight) and its embedding — the tied LM head — as Q8_0 (1.06 bytes
a weight): 98 MB for what the float32 model reads as 540 MB. ``blocks.c`` multiplies float32 rows
by those blocks directly, rounding each weight exactly as the GGUF reader dequantises it, so its
products are those of the loaded float32 weights (the sums in another order: within float32
rounding of the model's own logits, like oneDNN's). It is row-invariant by construction (each
output is one accumulator taking the same operations whatever shares the call), which verification
needs. ``BlockPass`` runs the decoder layers around them in one compiled call as well.

The blocks are stored grouped (``Blocks.grouped``): a group of outputs' blocks side by side, so a
product of one row streams one run of memory per tile of outputs instead of three per output (codes,
scales, minimums). From a few rows on, float32 products are bound by multiply-adds, not bytes; that
is why the same blocks also multiply rows rounded to integers per block of 32 (``activations``:
``"q8"``, ``"q16"``; ``weights="gguf-q8"``, ``"gguf-q16"``): exact integer dot products do several
times a float FMA's multiply-adds per instruction, and 16-bit rows keep the logits within ~0.01 of
float32's (``blocks.c``, ``weights.py``).

The kernels are C, one source built per instruction-set level (``LEVELS``: AVX-512 with VNNI and AMX
tiles, with VNNI, without; AVX2 with and without AVX-VNNI; ARM NEON), compiled on first use with the
machine's C compiler (``$CC``, else ``cc``) and cached under ``$AGENTSPEC_CACHE_DIR/kernels``. A pass runs on the fastest level the
CPU runs (``$AGENTSPEC_ISA`` caps it: ``AGENTSPEC_ISA=avx2`` runs an AVX-512 machine as an AVX2 one),
and every level gives the same bits: float arithmetic on 16 logical lanes summed by one fixed tree,
integer dot products exact. Where there is no compiler or no AVX2 the pass is not a candidate and
says why. Weights whose blocks are of another type (or float) take oneDNN-packed float32 products
instead; every matrix's blocks are checked at start-up to dequantise to the loaded weight, bit for
bit, on 8 rows spread over it (``read_blocks``), or the pass is refused.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..gguf import GGUFFile, GGUFTensor, read_gguf
from ..gguf.modules import weights_on_meta
from ..model import cache_dir
from .arch import GGUF_PROJECTIONS, describe
from .fused import FusedPass, Linear, LinearFactory, fused_unsupported
from .packed import Segment

__all__ = [
    "GGUFBlocks", "read_blocks", "BlockPass", "BlockProduct", "Blocks", "BLOCK_TYPES", "GGUF_TYPES", "tensor_blocks", "ACTIVATIONS", "KERNEL_SOURCE", "block_kernels", "block_product",
    "blocks_unsupported", "LEVELS", "LEVEL_NAMES", "ISA_VARIABLE", "isa_levels", "kernel_flags", "KEY_BIAS_LIMIT",
]

log = logging.getLogger("agentspec.engine")

KERNEL_SOURCE = Path(__file__).with_name("blocks.c")
KERNEL_HEADER = Path(__file__).with_name("blocks.h")  # its interface: the structures _BlocksArg, _LayerArg and _SegmentArg mirror
FLAGS = ("-O3", "-mtune=native", "-ffp-contract=off", "-fopenmp")
LIBRARY = ("-shared", "-fPIC")  # _build's: the kernels as a library (tests link blocks.c into a program)
BLOCK = 32  # weights per block, both types
GROUPS = (8, 4)  # outputs whose blocks are stored together: for products of 1-2 rows, of more (FEW, MANY in blocks.c)
# The kernels' blocks of 32 weights (blocks.c): Q4_1 (4-bit codes, a scale and a minimum), Q8_0
# (signed bytes, a scale), Q8_16 (signed bytes, a scale per 16) and Q8_1 (unsigned bytes, a scale and
# a minimum). The integer products take each in as many bits as its codes need (IntegerLayout).
BLOCK_TYPES = ("Q4_1", "Q8_0", "Q8_16", "Q8_1")
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
FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF tensors of plain floats: the products take them as float32
# Keys of a pass on integer rows are cached as float32 where a layer's key bias reaches this, else
# as float16 (values always float16 there). float16 rounds a key relative to its size: the real
# Qwen2.5 files' key biases of |145|-|158| (layers 0-1) put keys at |160|, each ~0.06 off, and moved
# the logits by 0.25 where float32 keys move them by 0.002 (docs/kernels.md). Without such a bias a
# key is a normed row times the projection, and float16 keeps it to the values' error.
KEY_BIAS_LIMIT = 16.0
# The products on float32 rows, per block type (x, M, K, blocks grouped for few rows, for many, y, N, threads)
_SYMBOLS = {"Q4_1": "agentspec_q4_1_product", "Q8_0": "agentspec_q8_0_product", "Q8_16": "agentspec_q8_16_product", "Q8_1": "agentspec_q8_1_product"}
# The integer products' codes (blocks.c: CODES_*), as many bytes a weight as the file's: signed bytes
# (Q8_0's, stored + 128), 4-bit codes two to a byte as the file packs them (Q4_0's, Q4_1's, Q4_K's),
# 5-bit ones (Q5_0's, Q5_1's, Q5_K's: the 4-bit registers, then one register of the fifth bits) and
# 6-bit ones (Q6_K's: the 5-bit registers, then one of the sixth bits). Blocks without minimums store
# their codes offset to unsigned ones: by 128, 8, 16 and 32.
INTEGER_CODES = ("bytes", "4-bit", "5-bit", "6-bit")
INTEGER_OFFSETS = {"bytes": 128, "4-bit": 8, "5-bit": 16, "6-bit": 32}
INTEGER_KIND = 4  # blocks.c: agentspec_blocks.kind of the blocks of integer rows, plus their layout's number
SUPER = 8  # blocks of a K-quant super-block (256 weights): their scales share a float16 one (blocks.c: SUPER)


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


@dataclass(frozen=True)
class Level:
    """An instruction-set level the kernels are built for: ``blocks.c`` once per level, with the
    vector width and integer dot product as macros. Every level computes the same bits."""

    name: str
    arch: str  # platform.machine() of the CPUs it is for
    width: int  # AGENTSPEC_WIDTH: 512 (AVX-512), 256 (AVX2, FMA, F16C) or 128 (NEON)
    vnni: bool  # AGENTSPEC_VNNI: integer products with byte dot products (vpdpbusd, sdot; else vpmaddwd)
    needs: tuple[str, ...]  # /proc/cpuinfo flags (x86) or features (ARM) the level needs
    # compiler flags, the first whose needs this CPU has (AVX-VNNI's vpdpbusd on ymm is also an
    # AVX512-VNNI + VL instruction: a CPU with those runs the same code, EVEX-encoded)
    variants: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
    # AGENTSPEC_AMX: integer products of 5 or more rows on AMX-INT8 tiles (tdpbsud), the same sums as
    # vpdpbusd, so the same bits (fewer rows, and Q6_K's scales per half block, keep vpdpbusd)
    amx: bool = False


_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
# Fastest first, per architecture. AGENTSPEC_ISA=<name> caps the level at <name> (tests build every
# level a CPU runs). NEON is built and checked under qemu-user here (tests/kernels_check.c); its speed
# is unmeasured until someone runs it on an ARM CPU.
LEVELS: tuple[Level, ...] = (
    Level(
        "avx512-amx", "x86_64", 512, True, (*_V4, "avx512_vnni", "amx_tile", "amx_int8"),
        ((("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8"), ()),), amx=True,
    ),
    Level("avx512-vnni", "x86_64", 512, True, (*_V4, "avx512_vnni"), ((("-march=x86-64-v4", "-mavx512vnni"), ()),)),
    Level("avx512", "x86_64", 512, False, _V4, ((("-march=x86-64-v4",), ()),)),
    Level(
        "avx2-vnni", "x86_64", 256, True, _V3,
        ((("-march=x86-64-v3", "-mavxvnni"), ("avx_vnni",)), (("-march=x86-64-v3", "-mavx512vnni", "-mavx512vl"), ("avx512_vnni", "avx512vl"))),
    ),
    Level("avx2", "x86_64", 256, False, _V3, ((("-march=x86-64-v3",), ()),)),
    Level("neon-dotprod", "aarch64", 128, True, ("asimddp",), ((("-march=armv8.2-a+dotprod",), ()),)),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)
ISA_VARIABLE = "AGENTSPEC_ISA"
_compile_lock = threading.Lock()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# The C side's structs (blocks.c): one product's blocks, one layer, one sequence's part of a pass.
class _BlocksArg(ctypes.Structure):
    pass


_BlocksArg._fields_ = [
    ("kind", ctypes.c_int), ("few", ctypes.c_void_p), ("many", ctypes.c_void_p), ("outputs", ctypes.c_int), ("next", ctypes.POINTER(_BlocksArg)),
]


class _LayerArg(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
        ("qkv", _BlocksArg), ("o", _BlocksArg), ("gate_up", _BlocksArg), ("down", _BlocksArg),
        ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float),
        ("window", ctypes.c_int), ("rotary", ctypes.c_int), ("post_attention", ctypes.c_void_p), ("post_mlp", ctypes.c_void_p),
        ("post_eps", ctypes.c_float), ("gelu", ctypes.c_int), ("softcap", ctypes.c_float),
    ]


class _SegmentArg(ctypes.Structure):
    _fields_ = [
        ("start", ctypes.c_int), ("stop", ctypes.c_int), ("past", ctypes.c_int), ("capacity", ctypes.c_int),
        ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
    ]


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """This CPU's flags (x86) or features (ARM) as Linux lists them (None where there is no
    /proc/cpuinfo: the built library is asked instead)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return None
    line = next((line for line in info.read_text().splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def kernel_flags(isa: str, native: bool = True) -> tuple[str, ...]:
    """The compiler flags ``blocks.c`` is built with for level ``isa``: for this CPU (``native``: its
    tuning, and the variant of the level it runs), or for another machine of the level's
    architecture (a cross compiler's build, as tests/test_blocks.py makes of NEON)."""
    level = LEVELS[LEVEL_NAMES.index(isa)]
    variant = _variant(level) if native else level.variants[0][0]
    if isinstance(variant, str):
        raise NotImplementedError(variant)
    flags = FLAGS if native else tuple(f for f in FLAGS if f != "-mtune=native")
    return (*flags, *variant, f"-DAGENTSPEC_WIDTH={level.width}", f"-DAGENTSPEC_VNNI={int(level.vnni)}", f"-DAGENTSPEC_AMX={int(level.amx)}")


def _variant(level: Level) -> tuple[str, ...] | str:
    """The compiler flags of ``level`` for this CPU, or what the CPU lacks for it."""
    flags = _cpu_flags()
    missing = [] if flags is None else [f for f in level.needs if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    for variant, needs in level.variants:
        if flags is None or all(f in flags for f in needs):
            return variant
    return f"this CPU lacks {' or '.join('+'.join(needs) for _, needs in level.variants)}"


@functools.cache
def _build(name: str) -> ctypes.CDLL | str:
    """The kernels built for level ``name``, or why there are none here."""
    level = LEVELS[LEVEL_NAMES.index(name)]
    if level.arch != _machine():
        return f"{name}: the kernels of {level.arch} CPUs; this machine is {platform.machine()}"
    try:
        flags = (*kernel_flags(name), *LIBRARY)
    except NotImplementedError as exc:  # what the CPU lacks for it
        return f"{name}: {exc}"
    compiler = _compiler()
    if compiler is None:
        return "no C compiler to build the GGUF block kernels (set CC, or install gcc)"
    source = KERNEL_SOURCE.read_bytes() + KERNEL_HEADER.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the C compiler {compiler!r} does not run ({exc})"
    cpu = " ".join(sorted(_cpu_flags() or ()))
    key = hashlib.sha256(b"|".join([source, " ".join(flags).encode(), version.encode(), cpu.encode()])).hexdigest()[:16]
    folder = cache_dir("kernels")
    if folder is None:  # AGENTSPEC_CACHE_DIR=off: build in a folder of this process
        folder = Path(tempfile.mkdtemp(prefix="agentspec-kernels-"))
    library = folder / f"blocks-{name}-{key}.so"
    with _compile_lock:
        if not library.exists():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                partial = folder / f".{library.name}.{os.getpid()}"
                done = subprocess.run([compiler, *flags, str(KERNEL_SOURCE), "-o", str(partial)], capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as exc:
                return f"could not build the GGUF block kernels in {folder} ({exc})"
            if done.returncode != 0:
                error = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
                return f"{name}: the GGUF block kernels do not build here ({error.strip()})"  # a lower level may
            os.replace(partial, library)  # atomic: a concurrent builder's copy is the same
            log.info("built the GGUF block kernels for %s: %s", name, library)
    kernels = ctypes.CDLL(str(library))
    if not kernels.agentspec_cpu_runs_this():
        granted = " (or the system did not grant its AMX tiles: Linux 5.16 or later does)" if level.amx else ""
        return f"{name}: this CPU does not run the kernels built for it{granted}"
    sizes, mirrored = (ctypes.c_size_t * 3)(), (ctypes.sizeof(_BlocksArg), ctypes.sizeof(_LayerArg), ctypes.sizeof(_SegmentArg))
    kernels.agentspec_struct_sizes.argtypes, kernels.agentspec_struct_sizes.restype = [ctypes.POINTER(ctypes.c_size_t)], None
    kernels.agentspec_struct_sizes(sizes)
    if tuple(sizes) != mirrored:  # never pass structures the library would read past
        return f"{name}: the kernels' structures (blocks.h: {tuple(sizes)} bytes) are not blocks.py's ({mirrored}); rebuild them from this version"
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    for symbol in _SYMBOLS.values():  # (x, M, K, blocks grouped for few rows, for many, y, N, threads)
        getattr(kernels, symbol).argtypes = [pointer, integer, integer, pointer, pointer, pointer, integer, integer]
        getattr(kernels, symbol).restype = None
    # (layout, x, M, K, blocks by lanes, y, N, threads)
    kernels.agentspec_int_product.argtypes = [integer, pointer, integer, integer, pointer, pointer, integer, integer]
    kernels.agentspec_int_product.restype = None
    # (hidden, T, H, heads, kv_heads, head_dim, intermediate, layers, weights, cos, sin, rotary_dim, scaling, residual_scale, segments, nseg,
    #  key_half, value_half, threads)
    kernels.agentspec_layers.argtypes = [
        pointer, *[integer] * 7, ctypes.POINTER(_LayerArg), pointer, pointer, integer, ctypes.c_float, ctypes.c_float,
        ctypes.POINTER(_SegmentArg), integer, integer, integer, integer,
    ]
    kernels.agentspec_layers.restype = None
    kernels.isa = name
    kernels.lanes = ctypes.c_int.in_dll(kernels, "agentspec_lanes").value
    return kernels


def _kernels(isa: str | None = None) -> ctypes.CDLL | str:
    """The kernels of level ``isa`` (default: the fastest level this CPU runs, at most
    ``$AGENTSPEC_ISA``), or why there are none here."""
    if isa is not None:
        if isa not in LEVEL_NAMES:
            return f"unknown instruction-set level {isa!r}; use one of {', '.join(LEVEL_NAMES)}"
        return _build(isa)
    cap = os.environ.get(ISA_VARIABLE) or LEVEL_NAMES[0]
    if cap not in LEVEL_NAMES:
        return f"{ISA_VARIABLE}={cap!r} is not a level; use one of {', '.join(LEVEL_NAMES)}"
    reasons = []
    for name in LEVEL_NAMES[LEVEL_NAMES.index(cap) :]:
        if LEVELS[LEVEL_NAMES.index(name)].arch != _machine():
            continue
        kernels = _build(name)
        if not isinstance(kernels, str):
            return kernels
        reasons.append(kernels)
        if not kernels.startswith(f"{name}: "):  # not about this level: no level builds here
            return kernels
    if not reasons:
        return f"the GGUF block kernels are for x86-64 (AVX2, AVX-512) and ARM (NEON with dotprod); this machine is {platform.machine()}"
    return "no instruction-set level of the GGUF block kernels runs here (" + "; ".join(reasons) + ")"


def isa_levels() -> list[str]:
    """The instruction-set levels whose kernels build and run on this machine, fastest first."""
    return [name for name in LEVEL_NAMES if not isinstance(_build(name), str)]


def block_kernels(isa: str | None = None) -> ctypes.CDLL:
    """The compiled block kernels of level ``isa`` (default: the fastest here, capped by
    ``$AGENTSPEC_ISA``), built on first call; ``NotImplementedError`` where they cannot be."""
    kernels = _kernels(isa)
    if isinstance(kernels, str):
        raise NotImplementedError(kernels)
    return kernels


def blocks_unsupported(model: Any, gguf_file: Path | None, activations: str = "float32", isa: str | None = None) -> str | None:
    """Why ``model`` cannot run on its GGUF file's blocks here (times ``activations``, one of
    ``ACTIVATIONS``; on level ``isa``, default the fastest here), or None when it may (the blocks
    themselves are checked when they are read). Every level runs every activation."""
    if activations not in ACTIVATIONS:
        return f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}"
    if gguf_file is None:
        return "the model was not read from a GGUF file"
    reason = fused_unsupported(model)
    if reason is not None:
        return reason
    weight = model.get_output_embeddings().weight
    if weight.device.type not in ("cpu", "meta") or weight.dtype != torch.float32:  # meta: a module tree of the file (gguf/modules.py)
        return f"the GGUF block kernels take float32 rows on a CPU (the model is {weight.dtype} on {weight.device})"
    kernels = _kernels(isa)
    return kernels if isinstance(kernels, str) else None


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
        return integer_layout_of(self.kind, self.factors is not None, *self.code_statistics())

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


def _read(tensor: GGUFTensor) -> Blocks | None:
    """A GGUF tensor's blocks (None for other types)."""
    return tensor_blocks(tensor.type_name, tensor.data)


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
            blocks = _unpermuted(tensor_blocks(kind, data[first:last]), (last - first) // per).slice(start - first, stop - first)
        self.tensor.file.release(self.tensor, slice(start, stop))  # converted: the file's pages may go
        return blocks

    def dequantised_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 weights (an embedding's: its rows in the file's order), read from
        the file (``GGUFFile.read_rows``) without mapping its pages."""
        return tensor_blocks(self.tensor.type_name, self.tensor.file.read_rows(self.tensor, ids.cpu().numpy())).dequantised()

    def release(self) -> None:
        """Let go of the matrix's pages of the file (a product built on it no longer reads them)."""
        self.tensor.file.release(self.tensor)


Part = Blocks | FileBlocks


def _run(parts: Sequence[Part], first: int, last: int) -> Blocks:
    """Outputs ``first`` .. ``last - 1`` of the outputs of ``parts`` in turn (one kind), as blocks."""
    pieces, start = [], 0
    for part in parts:
        stop = start + part.shape[0]
        if start < last and stop > first:
            pieces.append(part.slice(max(first, start) - start, min(last, stop) - start))
        start = stop
    return pieces[0] if len(pieces) == 1 else Blocks.stack(pieces)


def _run_rows(inputs: int) -> int:
    return max(RUN_ALIGN, RUN_WEIGHTS // inputs // RUN_ALIGN * RUN_ALIGN)


class _Relayout(Exception):
    """A run's blocks need another integer layout than the runs before them took."""


def _by_runs(parts: Sequence[Part], group: int, layout_of: Callable[[Blocks], torch.Tensor]) -> torch.Tensor:
    """``layout_of`` (a layout in groups of ``group`` outputs, ``[groups, ...]``) of the outputs of
    ``parts`` in turn, built in runs of rows into one tensor."""
    outputs = sum(part.shape[0] for part in parts)
    rows = _run_rows(parts[0].shape[1])
    out, group_at = None, 0
    for first in range(0, outputs, rows):
        piece = layout_of(_run(parts, first, min(first + rows, outputs)))
        if out is None:
            out = torch.empty(-(-outputs // group), *piece.shape[1:], dtype=piece.dtype)
        out[group_at : group_at + piece.shape[0]] = piece
        group_at += piece.shape[0]
    return out


def _by_lanes_of_runs(parts: Sequence[Part], lanes: int) -> tuple[torch.Tensor, IntegerLayout]:
    """``Blocks.by_lanes`` of the outputs of ``parts`` in turn, built in runs of rows, and the layout:
    the one their codes and scales take together (``integer_layout_of``). Each run is written in the
    layout of the runs so far; a run that needs a wider one (larger codes, scales that are not
    float16 values) starts the build again in it — the layouts only widen, and a matrix's runs
    nearly always agree, so the file is nearly always read once. ``NotImplementedError`` where the
    integer products cannot take them."""
    kind, statistics, factors = parts[0].kind, None, True
    while True:
        layout: IntegerLayout | None = None

        def layout_of(run: Blocks) -> torch.Tensor:
            nonlocal layout, statistics, factors
            found = run.code_statistics()
            statistics = found if statistics is None else (statistics[0] or found[0], min(statistics[1], found[1]), max(statistics[2], found[2]))
            factors = factors and run.factors is not None
            wanted = integer_layout_of(kind, factors, *statistics)
            if isinstance(wanted, str):
                raise NotImplementedError(wanted)
            if layout is not None and wanted != layout:
                raise _Relayout
            layout = wanted
            return run.by_lanes(lanes, wanted)

        try:
            return _by_runs(parts, lanes, layout_of), layout
        except _Relayout:
            continue  # again, from the first run, with what the runs so far need (kept in ``statistics``)


def _gguf_names(model: Any) -> list[tuple[str, torch.Tensor, int | None]]:
    """(GGUF tensor name, the loaded weight, heads whose rows llama.cpp's converter may have
    interleaved) of each projection the family's block has (``arch.py``), and of the input embedding
    where the module tree has none (its rows are read from the blocks: ``GGUFBlocks.embedding``)."""
    arch = describe(model)
    family = arch.family
    names = []
    if weights_on_meta(model):
        names.append(("token_embd.weight", model.get_input_embeddings().weight, None))
    for i, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        modules = [(name, getattr(attention, name)) for name in (*family.qkv, "o_proj")]
        modules += [(name, getattr(mlp, name)) for name in (*family.gate_up, "down_proj")]
        for name, module in modules:
            heads = {"q_proj": arch.heads, "k_proj": arch.kv_heads}.get(name) if family.gguf_permuted else None
            names.append((f"blk.{i}.{GGUF_PROJECTIONS[name]}.weight", module.weight, heads))
    names.append(("output.weight", model.get_output_embeddings().weight, None))
    return names


def _unpermuted(blocks: Blocks, heads: int) -> Blocks:
    """Undo llama.cpp's converter, which stores each head's query/key rows with the two rotary halves
    interleaved (transformers' GGUF reader undoes it the same way)."""
    outputs = blocks.shape[0]
    order = torch.arange(outputs).reshape(heads, outputs // heads // 2, 2).transpose(1, 2).reshape(outputs)
    return blocks.rows(order)


def _agrees(blocks: Blocks, weight: torch.Tensor) -> bool:
    """Whether ``blocks`` dequantise to ``weight`` bit for bit on a few rows spread over it — the
    first four (they tell the rotary halves' interleaving apart), the middle and the last ones — so
    that the check reads a few pages of a loaded weight, not all of it (a snapshot's weights are
    mapped: a pass on the blocks never reads them)."""
    outputs = weight.shape[0]
    rows = torch.unique(torch.tensor([0, 1, 2, 3, outputs // 3, outputs // 2, outputs - 2, outputs - 1]).clamp(0, outputs - 1))
    return blocks.shape == tuple(weight.shape) and torch.equal(blocks.rows(rows).dequantised(), weight.detach()[rows])


def read_blocks(model: Any, gguf_file: Path | GGUFFile) -> dict[int, Part]:
    """``model``'s linear weights as ``gguf_file`` (a path, or the file read) stores them, by id of
    the loaded weight, each checked to dequantise to it bit for bit on a sample of rows (``_agrees``;
    ``NotImplementedError`` where one does not, or where none has blocks). A module tree's weights
    (on the meta device: nothing to check against) take llama.cpp's layout by rule: a family whose
    rows the converter interleaves (``Family.gguf_permuted``) has them un-interleaved, as
    transformers' reader does, and they are read from the file as their products are built
    (``FileBlocks``). ``GGUFBlocks`` takes them, so that passes built together read the file once."""
    gguf = gguf_file if isinstance(gguf_file, GGUFFile) else read_gguf(gguf_file)
    gguf_file, tensors = gguf.path, gguf.tensors
    found: dict[int, Part] = {}
    unread: dict[str, list[str]] = {}  # matrices of types the kernels do not read, by type
    for name, weight, heads in _gguf_names(model):
        tensor = tensors.get(name) or (tensors.get("token_embd.weight") if name == "output.weight" else None)
        if id(weight) in found:
            continue  # the LM head tied to the input embedding
        if tensor is None:
            raise NotImplementedError(f"{gguf_file.name} has no tensor {name}")
        if tensor.type_name not in GGUF_TYPES:  # float or another block type: oneDNN takes this weight, as float32
            if tensor.type_name not in FLOAT_TYPES:
                unread.setdefault(tensor.type_name, []).append(tensor.name)
            continue
        if weight.device.type == "meta":  # a module tree's: read when its product is built
            if tensor.shape != tuple(weight.shape):
                raise NotImplementedError(f"{gguf_file.name}'s {name} has shape {tensor.shape}, the model's {tuple(weight.shape)}")
            found[id(weight)] = FileBlocks(tensor, heads)
            continue
        blocks = _read(tensor)
        with torch.no_grad():
            candidates = [blocks] if heads is None else [_unpermuted(blocks, heads), blocks]
            match = next((b for b in candidates if _agrees(b, weight)), None)
        if match is None:
            raise NotImplementedError(f"{gguf_file.name}'s {name} does not dequantise to the loaded weight")
        found[id(weight)] = match
    if not found:
        raise NotImplementedError(f"{gguf_file.name} has no weights of the types the kernels read ({', '.join(GGUF_TYPES)})")
    if unread:
        shown = "; ".join(f"{kind}: {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" for kind, names in sorted(unread.items()))
        log.warning(
            "%s: matrices of types the block kernels do not read run on float32 weights (4-8x the bytes a token reads): %s; "
            "requantise the file to one of %s for the fast pass on all of them", gguf_file.name, shown, ", ".join(GGUF_TYPES),
        )
    return found


class GGUFBlocks:
    """A loaded model's linear weights as its GGUF file stores them, checked against the model.

    ``linear`` makes the fused pass's products (``FusedPass(model, blocks.linear)``): on the
    blocks where every stacked weight has them of one kind (times float32 rows, or rows quantised to 8
    or 16 bits with ``activations="q8"`` or ``"q16"`` — float32 rows for blocks the integer products do
    not take: ``Blocks.integer_layout`` says why), else with ``fallback`` (oneDNN-packed float32).
    ``blocks``: what ``read_blocks(model, gguf_file)`` gave, where it was read already. ``isa``: the
    kernels' instruction-set level (``LEVEL_NAMES``; default the fastest here, capped by
    ``$AGENTSPEC_ISA``): every level gives the same bits, at its own speed."""

    def __init__(
        self, model: Any, gguf_file: Path, fallback: LinearFactory, activations: str = "float32", blocks: dict[int, Blocks] | None = None,
        isa: str | None = None,
    ) -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
        reason = blocks_unsupported(model, gguf_file, activations, isa)
        if reason is not None:
            raise NotImplementedError(reason)
        self.kernels = block_kernels(isa)
        self.fallback, self.activations = fallback, activations
        self.blocks = read_blocks(model, gguf_file) if blocks is None else blocks  # id(loaded weight) -> its blocks
        self.kinds = sorted({b.kind for b in self.blocks.values()})
        embedding = self.blocks.get(id(model.get_input_embeddings().weight)) if weights_on_meta(model) else None
        # A module tree's input embedding: the rows a pass needs, dequantised from the file's blocks
        # (as transformers' reader dequantises them: the same float32 bits)
        self.embedding: Callable[[torch.Tensor], torch.Tensor] | None = None
        if isinstance(embedding, FileBlocks):
            self.embedding = embedding.dequantised_rows
        elif embedding is not None:
            self.embedding = lambda ids: embedding.rows(ids).dequantised()

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks as read (codes, float32 scales and minimums; a matrix still in the file:
        its bytes there)."""
        return sum(b.tensor.nbytes if isinstance(b, FileBlocks) else b.codes.nbytes + b.scales.nbytes + (b.mins.nbytes if b.has_mins else 0) for b in self.blocks.values())

    def linear(self, weights: Sequence[torch.Tensor]) -> Linear:
        """``x @ W.T`` for ``weights`` stacked along their outputs (a matrix still in the file is read
        in runs of rows, and its pages of the file let go once the product has its layout)."""
        parts = [self.blocks.get(id(w)) for w in weights]
        if any(p is None for p in parts):
            return self.fallback(weights)
        if len({p.kind for p in parts}) != 1:  # e.g. Q4_K_M's q, k (Q4_K) and v (Q6_K): a product per run of one kind
            runs: list[list[Part]] = []
            for part in parts:
                if runs and runs[-1][0].kind == part.kind:
                    runs[-1].append(part)
                else:
                    runs.append([part])
            return StackedProduct([self._product(run) for run in runs])
        return self._product(parts)

    def _product(self, parts: Sequence[Part]) -> "BlockProduct":
        try:
            product = BlockProduct(parts, self.kernels, self.activations)
        except NotImplementedError:  # blocks the integer products do not take (Blocks.integer_layout says why): float32 rows
            if self.activations not in INTEGER_ACTIVATIONS:
                raise
            product = BlockProduct(parts, self.kernels, "float32")
        for part in parts:
            if isinstance(part, FileBlocks):
                part.release()
        return product


class BlockProduct:
    """``x @ W.T`` ([rows, in] float32 → [rows, out]) on ``blocks``, with the compiled kernels; with
    ``activations="q8"`` (``"q16"``), on the rows quantised to 8 (16) bits per block of 32 (``blocks.c``).
    ``kernels``: ``block_kernels(isa)`` of the level to run on (default: the fastest here)."""

    def __init__(self, blocks: Blocks | Sequence[Part], kernels: ctypes.CDLL | None = None, activations: str = "float32") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
        parts = [blocks] if isinstance(blocks, Blocks) else list(blocks)  # several: their outputs in turn
        kernels = kernels or block_kernels()
        self.kind, self.activations, self.isa = parts[0].kind, activations, kernels.isa
        self.layout: IntegerLayout | None = None  # how the integer products read the blocks
        if activations in INTEGER_ACTIVATIONS:  # one layout: every row count reads a register's outputs' blocks as one run of memory
            self.few, self.layout = _by_lanes_of_runs(parts, kernels.lanes)  # NotImplementedError where integer_layout_of says why not
            self.many = None
            self.function = functools.partial(kernels.agentspec_int_product, self.layout.number(activations))
        else:
            # Two copies of the blocks, grouped for products of one or two rows and for more: one row
            # streams its tile of 8 outputs' blocks as one run of memory (about twice the bandwidth of
            # three runs per output), but the 2- and 4-output tiles of more rows read groups of 8 slower.
            self.few, self.many = (_by_runs(parts, group, lambda run, group=group: run.grouped(group)) for group in GROUPS)
            self.function = getattr(kernels, _SYMBOLS[self.kind])
        self.outputs, self.inputs = sum(part.shape[0] for part in parts), parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes a product of one row streams: its blocks as the kernels read them (``few``)."""
        return self.few.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        inputs, outputs = self.inputs, self.outputs
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != inputs:
            raise ValueError(f"the block product takes float32 CPU rows of {inputs}, not {x.dtype} {tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, inputs).contiguous()
        out = torch.empty(rows.shape[0], outputs)
        blocks = (self.few.data_ptr(),) if self.many is None else (self.few.data_ptr(), self.many.data_ptr())
        self.function(rows.data_ptr(), rows.shape[0], inputs, *blocks, out.data_ptr(), outputs, torch.get_num_threads())
        return out.reshape(*x.shape[:-1], outputs)


class StackedProduct:
    """``x @ W.T`` where W's outputs are parts of different kinds of blocks, one ``BlockProduct`` each
    (their outputs in turn): row-invariant as each is. The compiled layers take it as a chain of
    parts (blocks.h: agentspec_blocks.next)."""

    def __init__(self, products: Sequence[BlockProduct]) -> None:
        self.products = list(products)
        self.outputs, self.inputs = sum(p.outputs for p in self.products), self.products[0].inputs
        self.isa = self.products[0].isa

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.products)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([product(x) for product in self.products], dim=-1)


def block_product(blocks: Blocks, kernels: ctypes.CDLL | None = None, activations: str = "float32") -> Linear:
    """``x @ W.T`` ([rows, in] float32 → [rows, out]) on ``blocks``, with the compiled kernels."""
    return BlockProduct(blocks, kernels, activations)


def _blocks_arg(product: BlockProduct | StackedProduct, keep: list[_BlocksArg]) -> _BlocksArg:
    """blocks.h's agentspec_blocks of ``product``; a stacked one's later parts are appended to
    ``keep``, which must outlive the call that reads them."""
    if isinstance(product, StackedProduct):
        first, *rest = (_blocks_arg(part, keep) for part in product.products)
        keep.extend(rest)
        for arg, following in zip([first, *rest], rest):
            arg.next = ctypes.pointer(following)
        return first
    kind = BLOCK_TYPES.index(product.kind) if product.layout is None else INTEGER_KIND + product.layout.number(product.activations)
    return _BlocksArg(kind, product.few.data_ptr(), None if product.many is None else product.many.data_ptr(), product.outputs, None)


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
        self._chains: list[_BlocksArg] = []  # the later parts of stacked products, which the layers' arguments point at

        self.layer_args = (_LayerArg * len(self.layers))(
            *(
                _LayerArg(
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
        args = (_SegmentArg * len(segments))(
            *(_SegmentArg(s.start, s.stop, s.past, s.block.capacity, s.block.keys.data_ptr(), s.block.values.data_ptr()) for s in segments)
        )
        self.function(
            hidden.data_ptr(), hidden.shape[0], hidden.shape[1], self.heads, self.kv_heads, self.head_dim, self.intermediate,
            len(self.layers), self.layer_args, cos.data_ptr(), sin.data_ptr(), cos.shape[-1], self.scaling, self.residual_scale,
            args, len(segments), key_dtype == torch.float16, value_dtype == torch.float16, torch.get_num_threads(),
        )
        return hidden
