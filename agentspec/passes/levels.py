"""The GGUF block kernels' instruction-set levels: which this CPU runs, and their libraries.

The kernels are C (``blocks.c``, its interface ``blocks.h``), one source compiled per instruction-set
level (``isa.LEVELS``: AVX-512 with VNNI and AMX tiles, with VNNI, without; AVX2 with and without
AVX-VNNI; ARM NEON with dot products) when the package is built (``setup.py``), into the package's
``kernels`` folder. A pass runs on the fastest level the CPU runs, told by its features
(``$AGENTSPEC_ISA`` caps it: ``AGENTSPEC_ISA=avx2`` runs an AVX-512 machine as an AVX2 one), and every
level gives the same bits: float arithmetic on 16 logical lanes summed by one fixed tree, integer dot
products exact.

Where the package's libraries were built from another ``blocks.c`` than the one beside them (an
editable checkout after an edit), or were not built at all, the machine's C compiler (``$CC``, else
``cc``) builds them on first use into ``$AGENTSPEC_CACHE_DIR/kernels``; ``$AGENTSPEC_KERNELS=compile``
does so always (a developer's override: tuned for this CPU), ``=packaged`` never.
``$AGENTSPEC_KERNELS_DIR`` names another folder of prebuilt libraries (a distributor's, the tests'). Where no level runs
there are no kernels, and ``kernels_or_reason`` says why. ``BlocksArg``, ``LayerArg`` and ``SegmentArg``
mirror ``blocks.h``'s structures; a library whose structures differ in size is refused.

The boundary: C cannot see how large a buffer is, so every caller passes its tensors through
``address``, which refuses (``ValueError``) one that is not contiguous on the CPU, of the dtype the
kernels read and at least as large as the counts it declares. The products and the layers check
their counts themselves and return a status instead of stopping the process: ``ValueError`` for
counts or a layout they do not take, ``MemoryError`` (naming the bytes asked for) where their working
memory could not be allocated; a refused call changed nothing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..model import cache_dir
from .isa import (
    KERNEL_HEADER, KERNEL_SOURCE, LEVEL_NAMES, LEVELS, MANIFEST, PACKAGED, Level, Variant, compile_library, compiler_version, file_digest, level_flags,
    machine, source_digest,
)

__all__ = [
    "KERNEL_SOURCE", "KERNEL_HEADER", "PRODUCT_SYMBOLS", "LEVELS", "LEVEL_NAMES", "ISA_VARIABLE", "KERNELS_VARIABLE", "FOLDER_VARIABLE", "INTEGER_KIND", "Level",
    "BlocksArg", "LayerArg", "SegmentArg", "block_kernels", "kernels_or_reason", "isa_levels", "kernel_flags", "address",
]

log = logging.getLogger("agentspec.engine")

# The products on float32 rows, per block type (x, M, K, blocks grouped for few rows, for many, y, N, threads)
PRODUCT_SYMBOLS = {"Q4_1": "agentspec_q4_1_product", "Q8_0": "agentspec_q8_0_product", "Q8_16": "agentspec_q8_16_product", "Q8_1": "agentspec_q8_1_product"}
INTEGER_KIND = 4  # blocks.c: agentspec_blocks.kind of the blocks of integer rows, plus their layout's number
ISA_VARIABLE = "AGENTSPEC_ISA"
KERNELS_VARIABLE = "AGENTSPEC_KERNELS"  # "compile": build them with $CC here; "packaged": only the package's
FOLDER_VARIABLE = "AGENTSPEC_KERNELS_DIR"  # the prebuilt libraries and their manifest, if not the package's
_compile_lock = threading.Lock()
# blocks.h: what the products and the layers return besides AGENTSPEC_OK (0)
BAD_ARGUMENT, UNKNOWN_LAYOUT, NO_MEMORY = -1, -2, -3
# the arguments of the functions that return a status, by name (the counts among them name a refused call)
_ARGUMENTS = {
    **{symbol: ("x", "M", "K", "few", "many", "y", "N", "threads") for symbol in PRODUCT_SYMBOLS.values()},
    "agentspec_int_product": ("layout", "x", "M", "K", "w", "y", "N", "threads"),
    "agentspec_layers": (
        "hidden", "T", "H", "heads", "kv_heads", "head_dim", "intermediate", "layers", "weights", "cos", "sin", "rotary_dim", "scaling",
        "residual_scale", "segments", "nseg", "key_half", "value_half", "threads",
    ),
}
_POINTERS = {"x", "few", "many", "y", "w", "hidden", "weights", "cos", "sin", "segments"}


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


def address(array: torch.Tensor | np.ndarray, count: int, dtypes: tuple[Any, ...], what: str) -> int:
    """The address of ``array``'s memory, which the kernels read as ``count`` elements of one of
    ``dtypes``: ``ValueError`` naming ``what`` (before anything is called) unless it is one contiguous
    run on the CPU of at least that many such elements."""
    if isinstance(array, np.ndarray):
        dtype, size, contiguous, device = array.dtype, array.size, array.flags.c_contiguous, "cpu"
    else:
        dtype, size, contiguous, device = array.dtype, array.numel(), array.is_contiguous(), array.device.type
    if dtype not in dtypes or not contiguous or device != "cpu" or size < count:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        found = f"{size} {str(dtype).removeprefix('torch.')} elements{'' if contiguous else ', not contiguous'} on {device}"
        raise ValueError(f"{what}: the kernels read {count} {wanted} elements in one contiguous run on the CPU from it, and it is {found}")
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data_ptr()


def _status(failed_bytes: Any, result: int, function: Any, arguments: tuple) -> int:
    """A product's or the layers' status as an exception (ctypes' ``errcheck``, called in the thread
    that made the call, so ``failed_bytes``, the library's ``agentspec_failed_bytes``, is that call's)."""
    if result == 0:
        return result
    name = function.__name__
    counts = ", ".join(f"{n}={a}" for n, a in zip(_ARGUMENTS[name], arguments) if n not in _POINTERS and not isinstance(a, float))
    if result == NO_MEMORY:
        asked = failed_bytes()
        raise MemoryError(f"{name}({counts}) could not allocate {asked:,} bytes of working memory; a call of fewer rows or tokens takes less")
    if result == UNKNOWN_LAYOUT:
        if name == "agentspec_layers":
            layers = arguments[8][: arguments[7]]
            kinds = sorted({getattr(layer, p).kind for layer in layers for p in ("qkv", "o", "gate_up", "down")})
            raise ValueError(f"{name}({counts}): a layer's blocks are of a kind the kernels do not have (kinds {kinds}; {INTEGER_KIND} + an integer layout's number)")
        raise ValueError(f"{name}: the kernels have no integer layout numbered {arguments[0]} (layouts.py: IntegerLayout.number)")
    raise ValueError(f"{name}({counts}): the kernels refused these counts (or a sequence, a chain of blocks or a pointer they describe)")


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """This CPU's flags (x86) or features (ARM) as Linux lists them (None where there is no
    /proc/cpuinfo: each library's own check of the CPU decides)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return None
    line = next((line for line in info.read_text().splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def kernel_flags(isa: str, native: bool = True) -> tuple[str, ...]:
    """The compiler flags ``blocks.c`` is built with for level ``isa``: for this CPU (``native``: its
    tuning, and the variant of the level it runs), or for any machine of the level's architecture
    (its first variant, untuned, as the package's build compiles it)."""
    level = LEVELS[LEVEL_NAMES.index(isa)]
    variant = _variant(level) if native else level.variants[0]
    if isinstance(variant, str):
        raise NotImplementedError(variant)
    return level_flags(level, variant, native=native)


def _variant(level: Level) -> Variant | str:
    """The variant of ``level`` this CPU runs, or what the CPU lacks for it."""
    flags = _cpu_flags()
    missing = [] if flags is None else [f for f in level.needs if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    for variant in level.variants:
        if flags is None or all(f in flags for f in variant.needs):
            return variant
    return f"this CPU lacks {' or '.join('+'.join(v.needs) for v in level.variants)}"


def _folder() -> Path:
    return Path(os.environ.get(FOLDER_VARIABLE) or PACKAGED)


@functools.cache
def _manifest(folder: Path) -> dict | str:
    """What the package's build compiled into ``folder`` (isa.build_all's manifest), or why it is not
    usable here."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return "the package carries no compiled kernels"
    except (OSError, ValueError) as exc:
        return f"the package's kernels manifest is unreadable ({exc})"
    if not isinstance(manifest, dict) or manifest.get("source") != source_digest():
        return "the package's kernels were built from another blocks.c"
    return manifest


def _packaged(level: Level, variant: Variant) -> Path | str:
    """The package's library of ``level`` in ``variant``, checked against the digest its build
    recorded, or why there is none."""
    folder = _folder()
    manifest = _manifest(folder)
    if isinstance(manifest, str):
        return manifest
    name = level.library(variant)
    recorded = manifest.get("libraries", {}).get(name)
    if recorded is None:
        return f"the package's kernels include no {name} (built for {manifest.get('arch')})"
    library = folder / name
    try:
        if file_digest(library) != recorded:
            return f"{library} is not the library the package's build wrote (its digest differs): reinstall agentspec-llm"
    except OSError as exc:
        return f"the package's {name} is unreadable ({exc})"
    if not manifest.get("openmp", True):
        log.warning("the GGUF block kernels were built without OpenMP (%s): they lay out a file's blocks on one thread", manifest.get("compiler"))
    return library


def _private(path: Path) -> bool:
    """Whether ``path`` is this user's and no one else may write it (a cached library is loaded only so)."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _compiled(level: Level, variant: Variant) -> Path | str:
    """``level``'s library built here with the machine's C compiler, tuned for this CPU, into the cache
    (reused by later processes), or why it cannot be."""
    compiler = _compiler()
    if compiler is None:
        return "no C compiler to build the GGUF block kernels (set CC, or install gcc)"
    version = compiler_version(compiler)
    if version is None:
        return f"the C compiler {compiler!r} does not run"
    flags = level_flags(level, variant, native=True)
    cpu = " ".join(sorted(_cpu_flags() or ()))
    key = hashlib.sha256("|".join([source_digest(), " ".join(flags), version, cpu]).encode()).hexdigest()[:16]
    folder = cache_dir("kernels")
    if folder is None:  # AGENTSPEC_CACHE_DIR=off: build in a folder of this process
        folder = Path(tempfile.mkdtemp(prefix="agentspec-kernels-"))
    library = folder / f"blocks-{level.name}-{key}.so"
    with _compile_lock:
        if library.exists() and not (_private(library) and _private(folder)):
            return f"{library} (or its folder) may be written by another user: remove it, or set AGENTSPEC_CACHE_DIR to a folder of your own"
        if not library.exists():
            try:
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                return f"could not build the GGUF block kernels in {folder} ({exc})"
            error = compile_library(compiler, flags, library)
            if error is not None:
                return f"{level.name}: the GGUF block kernels do not build here ({error})"  # a lower level may
            log.info("built the GGUF block kernels for %s: %s", level.name, library)
    return library


@functools.cache
def _build(name: str) -> ctypes.CDLL | str:
    """The kernels of level ``name``, or why there are none here."""
    level = LEVELS[LEVEL_NAMES.index(name)]
    if level.arch != machine():
        return f"{name}: the kernels of {level.arch} CPUs; this machine is {platform.machine()}"
    variant = _variant(level)
    if isinstance(variant, str):  # what the CPU lacks for it
        return f"{name}: {variant}"
    how = os.environ.get(KERNELS_VARIABLE, "")
    if how not in ("", "compile", "packaged"):
        return f"{KERNELS_VARIABLE}={how!r} is not one of 'compile' (build them here with $CC) and 'packaged' (only the package's)"
    library = _packaged(level, variant) if how != "compile" else "compiled as asked"
    if isinstance(library, str):
        if how == "packaged":
            return f"{name}: {library} ({KERNELS_VARIABLE}=packaged)"
        if how != "compile":
            log.info("%s: %s; building them with the C compiler", name, library)
        library = _compiled(level, variant)
        if isinstance(library, str):
            return library
    return _loaded(level, library)


def _loaded(level: Level, library: Path) -> ctypes.CDLL | str:
    """The library at ``library`` loaded, checked and typed, or why it cannot be used."""
    name = level.name
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
    kernels.agentspec_failed_bytes.argtypes, kernels.agentspec_failed_bytes.restype = [], ctypes.c_size_t
    for symbol in PRODUCT_SYMBOLS.values():  # (x, M, K, blocks grouped for few rows, for many, y, N, threads)
        getattr(kernels, symbol).argtypes = [pointer, integer, integer, pointer, pointer, pointer, integer, integer]
    # (layout, x, M, K, blocks by lanes, y, N, threads)
    kernels.agentspec_int_product.argtypes = [integer, pointer, integer, integer, pointer, pointer, integer, integer]
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
    for symbol in _ARGUMENTS:  # a status, raised as an exception
        function = getattr(kernels, symbol)
        function.restype, function.errcheck = integer, functools.partial(_status, kernels.agentspec_failed_bytes)
    kernels.isa = name
    kernels.path = library
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
        if LEVELS[LEVEL_NAMES.index(name)].arch != machine():
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
