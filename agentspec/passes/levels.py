"""The GGUF block kernels' instruction-set levels and their build.

The kernels are C (``blocks.c``, its interface ``blocks.h``), one source built per instruction-set
level (``LEVELS``: AVX-512 with VNNI and AMX tiles, with VNNI, without; AVX2 with and without
AVX-VNNI; ARM NEON), compiled on first use with the machine's C compiler (``$CC``, else ``cc``) and
cached under ``$AGENTSPEC_CACHE_DIR/kernels``. A pass runs on the fastest level the CPU runs
(``$AGENTSPEC_ISA`` caps it: ``AGENTSPEC_ISA=avx2`` runs an AVX-512 machine as an AVX2 one), and every
level gives the same bits: float arithmetic on 16 logical lanes summed by one fixed tree, integer
dot products exact. Where there is no compiler or no AVX2 there are no kernels, and
``kernels_or_reason`` says why. ``BlocksArg``, ``LayerArg`` and ``SegmentArg`` mirror ``blocks.h``'s
structures; a build whose structures differ in size is refused.
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

from ..model import cache_dir

__all__ = [
    "KERNEL_SOURCE", "KERNEL_HEADER", "PRODUCT_SYMBOLS", "LEVELS", "LEVEL_NAMES", "ISA_VARIABLE", "INTEGER_KIND", "Level", "BlocksArg", "LayerArg", "SegmentArg",
    "block_kernels", "kernels_or_reason", "isa_levels", "kernel_flags",
]

log = logging.getLogger("agentspec.engine")

KERNEL_SOURCE = Path(__file__).with_name("blocks.c")
KERNEL_HEADER = Path(__file__).with_name("blocks.h")  # its interface: the structures BlocksArg, LayerArg and SegmentArg mirror
FLAGS = ("-O3", "-mtune=native", "-ffp-contract=off", "-fopenmp")
LIBRARY = ("-shared", "-fPIC")  # _build's: the kernels as a library (tests link blocks.c into a program)
# The products on float32 rows, per block type (x, M, K, blocks grouped for few rows, for many, y, N, threads)
PRODUCT_SYMBOLS = {"Q4_1": "agentspec_q4_1_product", "Q8_0": "agentspec_q8_0_product", "Q8_16": "agentspec_q8_16_product", "Q8_1": "agentspec_q8_1_product"}
INTEGER_KIND = 4  # blocks.c: agentspec_blocks.kind of the blocks of integer rows, plus their layout's number


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
class BlocksArg(ctypes.Structure):
    pass


BlocksArg._fields_ = [
    ("kind", ctypes.c_int), ("few", ctypes.c_void_p), ("many", ctypes.c_void_p), ("outputs", ctypes.c_int), ("next", ctypes.POINTER(BlocksArg)),
]


class LayerArg(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
        ("qkv", BlocksArg), ("o", BlocksArg), ("gate_up", BlocksArg), ("down", BlocksArg),
        ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float),
        ("window", ctypes.c_int), ("rotary", ctypes.c_int), ("post_attention", ctypes.c_void_p), ("post_mlp", ctypes.c_void_p),
        ("post_eps", ctypes.c_float), ("gelu", ctypes.c_int), ("softcap", ctypes.c_float),
    ]


class SegmentArg(ctypes.Structure):
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
    sizes, mirrored = (ctypes.c_size_t * 3)(), (ctypes.sizeof(BlocksArg), ctypes.sizeof(LayerArg), ctypes.sizeof(SegmentArg))
    kernels.agentspec_struct_sizes.argtypes, kernels.agentspec_struct_sizes.restype = [ctypes.POINTER(ctypes.c_size_t)], None
    kernels.agentspec_struct_sizes(sizes)
    if tuple(sizes) != mirrored:  # never pass structures the library would read past
        return f"{name}: the kernels' structures (blocks.h: {tuple(sizes)} bytes) are not levels.py's ({mirrored}); rebuild them from this version"
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    for symbol in PRODUCT_SYMBOLS.values():  # (x, M, K, blocks grouped for few rows, for many, y, N, threads)
        getattr(kernels, symbol).argtypes = [pointer, integer, integer, pointer, pointer, pointer, integer, integer]
        getattr(kernels, symbol).restype = None
    # (layout, x, M, K, blocks by lanes, y, N, threads)
    kernels.agentspec_int_product.argtypes = [integer, pointer, integer, integer, pointer, pointer, integer, integer]
    kernels.agentspec_int_product.restype = None
    # (row addresses, ggml types, outputs, inputs, [codes, mins, factored, halves,] threads, [out,] stats or NULL): 0, or -1 for a type it does not read
    kernels.agentspec_gguf_statistics.argtypes = [pointer, pointer, integer, integer, integer, pointer]
    kernels.agentspec_gguf_by_lanes.argtypes = [pointer, pointer, integer, integer, integer, integer, integer, integer, integer, pointer, pointer]
    kernels.agentspec_gguf_statistics.restype = kernels.agentspec_gguf_by_lanes.restype = integer
    # (hidden, T, H, heads, kv_heads, head_dim, intermediate, layers, weights, cos, sin, rotary_dim, scaling, residual_scale, segments, nseg,
    #  key_half, value_half, threads)
    kernels.agentspec_layers.argtypes = [
        pointer, *[integer] * 7, ctypes.POINTER(LayerArg), pointer, pointer, integer, ctypes.c_float, ctypes.c_float,
        ctypes.POINTER(SegmentArg), integer, integer, integer, integer,
    ]
    kernels.agentspec_layers.restype = None
    kernels.isa = name
    kernels.lanes = ctypes.c_int.in_dll(kernels, "agentspec_lanes").value
    return kernels


def kernels_or_reason(isa: str | None = None) -> ctypes.CDLL | str:
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
    kernels = kernels_or_reason(isa)
    if isinstance(kernels, str):
        raise NotImplementedError(kernels)
    return kernels
