"""The instruction-set levels of the GGUF block kernels, and how ``blocks.c`` is compiled for each.

Plain Python with nothing but the standard library: the package's build (``setup.py``) loads this
file by its path, before agentspec's dependencies exist, and compiles one library per level (and
per variant of a level) into the package (``PACKAGED``), so that no compiler is needed where the
package runs; ``levels.py`` chooses among them at run time by the CPU's features, and compiles them
itself only as a developer's override (``$AGENTSPEC_KERNELS=compile``) or where ``blocks.c`` changed
since they were built (an editable checkout).

Every level computes the same bits (``blocks.c``): the levels differ in speed only.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KERNEL_SOURCE", "KERNEL_HEADER", "LEVELS", "LEVEL_NAMES", "MANIFEST", "PACKAGED", "Level", "Variant",
    "build_all", "compile_library", "compiler_version", "level_flags", "machine", "source_digest",
]

KERNEL_SOURCE = Path(__file__).with_name("blocks.c")
KERNEL_HEADER = Path(__file__).with_name("blocks.h")  # its interface: the structures levels.py mirrors
PACKAGED = Path(__file__).with_name("kernels")  # the libraries the package's build compiled
MANIFEST = "manifest.json"  # in PACKAGED: the source they were built from, and each library's digest
FLAGS = ("-O3", "-ffp-contract=off")
OPENMP = ("-fopenmp",)  # threads for laying out a file's blocks; a compiler without OpenMP lays them out on one thread
LIBRARY = ("-shared", "-fPIC", "-pthread")  # a pass's threads are the kernels' own (blocks.c: run_threads)


@dataclass(frozen=True)
class Variant:
    """One way to compile a level: the compiler flags, and the CPU features (Linux's /proc/cpuinfo
    names) a CPU needs for them beyond the level's own."""

    tag: str  # in the library's file name ("" for a level's only variant)
    flags: tuple[str, ...]
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Level:
    """An instruction-set level the kernels are built for: ``blocks.c`` once per level, with the
    vector width and integer dot product as macros. Every level computes the same bits."""

    name: str
    arch: str  # machine() of the CPUs it is for
    width: int  # AGENTSPEC_WIDTH: 512 (AVX-512), 256 (AVX2, FMA, F16C) or 128 (NEON)
    vnni: bool  # AGENTSPEC_VNNI: integer products with byte dot products (vpdpbusd, sdot; else vpmaddwd)
    needs: tuple[str, ...]  # /proc/cpuinfo flags (x86) or features (ARM) the level needs
    # the first whose needs this CPU has is the one it runs (AVX-VNNI's vpdpbusd on ymm is also an
    # AVX512-VNNI + VL instruction: a CPU with those runs the same code, EVEX-encoded)
    variants: tuple[Variant, ...]
    # AGENTSPEC_AMX: integer products of 5 or more rows on AMX-INT8 tiles (tdpbsud), the same sums as
    # vpdpbusd, so the same bits (fewer rows, and Q6_K's scales per half block, keep vpdpbusd)
    amx: bool = False

    def macros(self) -> tuple[str, ...]:
        return (f"-DAGENTSPEC_WIDTH={self.width}", f"-DAGENTSPEC_VNNI={int(self.vnni)}", f"-DAGENTSPEC_AMX={int(self.amx)}")

    def library(self, variant: Variant) -> str:
        """The file name of this level's library in ``variant``."""
        return f"blocks-{self.name}{'-' + variant.tag if variant.tag else ''}.so"


_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
# Fastest first, per architecture. AGENTSPEC_ISA=<name> caps the level at <name> (tests run every
# level a CPU runs). NEON is built and checked under qemu-user here (tests/kernels_check.c); its speed
# is unmeasured until someone runs it on an ARM CPU.
LEVELS: tuple[Level, ...] = (
    Level(
        "avx512-amx", "x86_64", 512, True, (*_V4, "avx512_vnni", "amx_tile", "amx_int8"),
        (Variant("", ("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8")),), amx=True,
    ),
    Level("avx512-vnni", "x86_64", 512, True, (*_V4, "avx512_vnni"), (Variant("", ("-march=x86-64-v4", "-mavx512vnni")),)),
    Level("avx512", "x86_64", 512, False, _V4, (Variant("", ("-march=x86-64-v4",)),)),
    Level(
        "avx2-vnni", "x86_64", 256, True, _V3,
        (
            Variant("", ("-march=x86-64-v3", "-mavxvnni"), ("avx_vnni",)),
            Variant("evex", ("-march=x86-64-v3", "-mavx512vnni", "-mavx512vl"), ("avx512_vnni", "avx512vl")),
        ),
    ),
    Level("avx2", "x86_64", 256, False, _V3, (Variant("", ("-march=x86-64-v3",)),)),
    Level("neon-dotprod", "aarch64", 128, True, ("asimddp",), (Variant("", ("-march=armv8.2-a+dotprod",)),)),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


def machine() -> str:
    """This machine's architecture as the levels name it (x86_64, aarch64)."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def level_flags(level: Level, variant: Variant, *, native: bool = False, openmp: bool = True) -> tuple[str, ...]:
    """The flags ``blocks.c`` is compiled with for ``level`` in ``variant``: for any CPU of the level
    (the package's build), or tuned for this one (``native``: a developer's build)."""
    tuning = ("-mtune=native",) if native else ()
    return (*FLAGS, *tuning, *(OPENMP if openmp else ()), *variant.flags, *level.macros())


def source_digest() -> str:
    """What the libraries are built from: ``blocks.c`` and ``blocks.h``."""
    return hashlib.sha256(KERNEL_SOURCE.read_bytes() + b"\0" + KERNEL_HEADER.read_bytes()).hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compiler_version(compiler: str) -> str | None:
    """The compiler's first line of ``--version``, or None where it does not run."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.split("\n")[0].strip() if done.returncode == 0 else None


def compile_library(compiler: str, flags: tuple[str, ...], out: Path) -> str | None:
    """``blocks.c`` built with ``flags`` as a shared library at ``out`` (written whole or not at all);
    None, or the compiler's first error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        done = subprocess.run([compiler, *flags, *LIBRARY, str(KERNEL_SOURCE), "-o", str(partial)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        error = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:300])
        return error.strip()
    os.replace(partial, out)  # atomic: a concurrent builder's copy is the same
    return None


def _takes_openmp(compiler: str) -> bool:
    """Whether ``compiler`` builds and links an OpenMP library (Apple's clang does not)."""
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder, "probe.c")
        probe.write_text("#include <omp.h>\nint agentspec_probe(void) { return omp_get_max_threads(); }\n")
        try:
            done = subprocess.run([compiler, *OPENMP, *LIBRARY, str(probe), "-o", str(Path(folder, "probe.so"))], capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0


def build_all(out: Path, compiler: str | None = None, arch: str | None = None, only: tuple[str, ...] = ()) -> dict:
    """Every level (and variant) of ``arch`` (default: this machine's; ``only``: these levels) built
    with ``compiler`` (default: ``$CC``, else cc) into ``out``, with a manifest of what was built;
    raises ``RuntimeError`` naming the level and the compiler's error where one does not build. An
    architecture without levels builds nothing (the package then runs without kernels)."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    arch = arch or machine()
    unknown = [name for name in only if name not in LEVEL_NAMES]
    if unknown:
        raise RuntimeError(f"no level {', '.join(unknown)}; the levels are {', '.join(LEVEL_NAMES)}")
    levels = [level for level in LEVELS if level.arch == arch and (not only or level.name in only)]
    manifest: dict = {"source": source_digest(), "arch": arch, "libraries": {}}
    if not levels:
        return manifest
    version = compiler_version(compiler) if compiler else None
    if version is None:
        raise RuntimeError(f"no C compiler runs here ({compiler or 'set CC'}): the GGUF block kernels are compiled when the package is built")
    built = _up_to_date(out, manifest, version, [level.library(variant) for level in levels for variant in level.variants])
    if built is not None:  # an editable install's second build, or a build with nothing changed
        return built
    openmp = _takes_openmp(compiler)
    manifest.update(compiler=version, openmp=openmp)
    builds = [(level, out / level.library(variant), level_flags(level, variant, openmp=openmp)) for level in levels for variant in level.variants]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # a compiler process each
        errors = list(pool.map(lambda build: compile_library(compiler, build[2], build[1]), builds))
    for (level, library, _), error in zip(builds, errors):
        if error is not None:
            raise RuntimeError(f"the GGUF block kernels for {level.name} do not build with {version}: {error}")
        manifest["libraries"][library.name] = file_digest(library)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _up_to_date(out: Path, manifest: dict, version: str, names: list[str]) -> dict | None:
    """The manifest in ``out`` where it records these libraries built from this source by this
    compiler, and each is still the file it records; else None (build them)."""
    try:
        built = json.loads((out / MANIFEST).read_text())
        same = {key: built.get(key) for key in ("source", "arch", "compiler")} == {**{key: manifest[key] for key in ("source", "arch")}, "compiler": version}
        if same and sorted(built["libraries"]) == sorted(names) and all(file_digest(out / name) == built["libraries"][name] for name in names):
            return built
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None
