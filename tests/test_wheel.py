"""The package as a user installs it: a wheel that carries its kernels, compiled when it was built.

The wheel is built from a copy of the sources (what an sdist holds), installed into a new virtual
environment outside the repository and run there with no C compiler on ``PATH``; the aarch64 wheel is
cross-built with Debian's cross compiler and its library checked under qemu-user; clang 14 (a
stand-in for Apple's compiler) and GCC 11, the oldest compilers it is said to build with, build every
level. The kernels' own numerics are tests/test_blocks.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from agentspec.passes.isa import KERNEL_SOURCE, LEVELS, MANIFEST, PACKAGED, Level, Variant, level_flags, machine
from agentspec.passes.levels import FOLDER_VARIABLE, KERNELS_VARIABLE, block_kernels, isa_levels

REPO = Path(__file__).parent.parent
CHECK_SOURCE = Path(__file__).with_name("kernels_check.c")
CROSS = {"aarch64": ("aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu")}  # compiler, emulator, its system's root
PROMPT = "Name three rivers of Europe."


def _sources(into: Path) -> Path:
    """What the package is built from (an sdist's files), copied without anything built in the checkout."""
    into.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, into / name)
    shutil.copytree(REPO / "agentspec", into / "agentspec", ignore=shutil.ignore_patterns("__pycache__", PACKAGED.name))
    return into


def _wheel(tmp: Path, env: dict[str, str], *options: str) -> Path:
    """The wheel of the sources built by pip (no isolation: the build needs setuptools only)."""
    sources = _sources(tmp / "src")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", *options, "-w", str(tmp / "dist"), str(sources)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=900,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("*.whl")
    return wheel


def _kernels_check(library: Path, out: Path, compiler: str = "cc", runner: tuple[str, ...] = ()) -> list[str]:
    """tests/kernels_check.c linked against ``library`` (not blocks.c: the built library is what is
    checked), run; its lines of hashes."""
    built = subprocess.run(
        [compiler, "-O2", str(CHECK_SOURCE), str(library), f"-Wl,-rpath,{library.parent}", "-fopenmp", "-lm", "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    done = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def levels() -> list[str]:
    found = isa_levels()
    assert found, "no level of the kernels runs here"
    return found


@pytest.fixture(scope="module")
def packaged_lines(levels, tmp_path_factory) -> list[str]:
    """The checks' lines from the installed package's library of this CPU's best level."""
    return _kernels_check(block_kernels(levels[0]).path, tmp_path_factory.mktemp("check") / "check")


def test_the_installed_package_carries_every_level_of_its_architecture(levels):
    """The editable install (``make``) built every level of this machine's architecture into the
    package, recorded with its digest, and "auto" loads the package's library, not a compiled one."""
    rebuild = "blocks.c changed since the install built the kernels: `make test` (pip install -e .) rebuilds them"
    manifest = json.loads((PACKAGED / MANIFEST).read_text())
    expected = {level.library(variant) for level in LEVELS if level.arch == machine() for variant in level.variants}
    assert set(manifest["libraries"]) == expected
    assert block_kernels(levels[0]).path.parent == PACKAGED, rebuild


async def test_the_wheel_runs_on_its_own_kernels_without_a_compiler(levels, client, tmp_path):
    """A wheel of this CPU's best level, installed into a new environment outside the repository (its
    dependencies from this one's site-packages, never its sources), runs the default model on the
    wheel's kernels with no C compiler on PATH, and generates what this checkout generates."""
    wheel = _wheel(tmp_path, {"AGENTSPEC_BUILD_LEVELS": levels[0]})
    assert wheel.name.endswith(f"-py3-none-linux_{machine()}.whl"), wheel.name  # any Python 3, this platform
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert f"agentspec/passes/kernels/{block_kernels(levels[0]).path.name}" in names  # the library this CPU runs
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    environment = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True, timeout=120)
    site = Path(subprocess.run([environment / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch & co.; its .pth files (this checkout) are not read
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(environment / "bin" / "python"), "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    probe = (
        "import asyncio, agentspec\n"
        "from agentspec.passes.levels import block_kernels\n"
        "async def main():\n"
        "    async with agentspec.Client() as client:\n"
        f"        done = await client.generate([{{'role': 'user', 'content': {PROMPT!r}}}], max_tokens=12, temperature=0)\n"
        "        print(agentspec.__file__, block_kernels().path, client.engine.weights.name, client.engine.weights.isa, done.token_ids, sep='\\n')\n"
        "asyncio.run(main())\n"
    )
    env = {"PATH": str(environment / "bin"), "HOME": str(tmp_path), "AGENTSPEC_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    assert shutil.which("cc", path=env["PATH"]) is None and shutil.which("gcc", path=env["PATH"]) is None
    ran = subprocess.run([environment / "bin" / "python", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    package, library, weights, isa, tokens = ran.stdout.strip().splitlines()[-5:]
    assert Path(package).is_relative_to(site) and Path(library).is_relative_to(site), (package, library)
    assert (weights, isa) == ("gguf-q16", levels[0])
    assert not (tmp_path / "cache" / "kernels").exists()  # nothing compiled
    here = await client.generate([{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0)
    assert tokens == str(here.token_ids)


def _variant_of(level: Level) -> Variant:
    """The variant of ``level`` this CPU runs (its /proc/cpuinfo flags)."""
    line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features")))
    cpu = set(line.partition(":")[2].split())
    return next(variant for variant in level.variants if all(need in cpu for need in variant.needs))


def test_the_aarch64_wheel_passes_the_kernels_checks_under_qemu(packaged_lines, tmp_path):
    """The aarch64 wheel, cross-built with Debian's cross compiler (``CC``, ``AGENTSPEC_BUILD_ARCH``,
    the platform tag from ``--plat-name``), carries NEON kernels that pass their checks under
    qemu-user and print what this CPU's print: NEON computes what x86 computes."""
    compiler, emulator, root = CROSS["aarch64"]
    if machine() == "aarch64":
        pytest.skip("an aarch64 machine builds its own wheel: test_the_wheel_runs_on_its_own_kernels_without_a_compiler")
    if not (shutil.which(compiler) and shutil.which(emulator)):
        pytest.skip(f"checked with {compiler} and {emulator}: install gcc-aarch64-linux-gnu and qemu-user (make test does, as root)")
    wheel = _wheel(tmp_path, {"CC": compiler, "AGENTSPEC_BUILD_ARCH": "aarch64"}, "-C--build-option=--plat-name=manylinux_2_17_aarch64")
    assert wheel.name.endswith("-py3-none-manylinux_2_17_aarch64.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "unpacked", [name for name in archive.namelist() if "/kernels/" in name])
    folder = tmp_path / "unpacked" / "agentspec" / "passes" / "kernels"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["arch"] == "aarch64" and set(manifest["libraries"]) == {"blocks-neon-dotprod.so"}
    lines = _kernels_check(folder / "blocks-neon-dotprod.so", tmp_path / "check", compiler, runner=(emulator, "-L", root))
    assert lines == packaged_lines


# The oldest compilers blocks.c is said to build with (CHANGELOG, docs/kernels.md): Debian's clang 14
# without OpenMP (a stand-in for Apple's compiler, which builds it so: one thread) and GCC 11 with it
OLDEST_COMPILERS = {"clang": False, "gcc-11": True}


@pytest.mark.parametrize("compiler", list(OLDEST_COMPILERS))
def test_the_oldest_compilers_build_every_level_and_compute_the_same_bits(compiler, levels, packaged_lines, tmp_path):
    """clang 14 and GCC 11 build every level, and those this CPU runs print the same checks as the
    packaged library (GCC 12's); clang builds the aarch64 levels too (compiled, not run)."""
    if shutil.which(compiler) is None:
        pytest.skip(f"the kernels' builds with {compiler} are checked with Debian's {compiler} (make test installs it, as root)")
    for level in LEVELS:
        variant = _variant_of(level) if level.name in levels else level.variants[0]
        flags = level_flags(level, variant, openmp=OLDEST_COMPILERS[compiler])
        if level.name in levels:
            out = tmp_path / level.name
            built = subprocess.run([compiler, *flags, str(KERNEL_SOURCE), str(CHECK_SOURCE), "-lm", "-o", str(out)], capture_output=True, text=True, timeout=600)
            assert built.returncode == 0, built.stderr[-2000:]
            done = subprocess.run([str(out)], capture_output=True, text=True, timeout=600)
            assert done.stdout.splitlines() == packaged_lines, level.name
        elif level.arch == "aarch64" and compiler != "clang":
            continue  # GCC builds aarch64 as another compiler (test_the_aarch64_wheel_passes_the_kernels_checks_under_qemu)
        else:  # another CPU's or architecture's: compiled, not run
            target = ["--target=aarch64-linux-gnu", f"--sysroot={CROSS['aarch64'][2]}"] if level.arch == "aarch64" else []
            built = subprocess.run([compiler, *target, *flags, "-c", str(KERNEL_SOURCE), "-o", str(tmp_path / f"{level.name}.o")], capture_output=True, text=True, timeout=600)
            assert built.returncode == 0, (level.name, built.stderr[-2000:])


def test_the_packaged_kernels_are_checked_before_they_are_loaded(levels, tmp_path):
    """A library whose bytes differ from what the build recorded is never loaded: with
    ``AGENTSPEC_KERNELS=packaged`` the level is refused saying so; a folder without kernels says
    that; and where the package has none and no compiler runs, no kernels, with the reason."""
    copy = tmp_path / "kernels"
    shutil.copytree(PACKAGED, copy)
    library = block_kernels(levels[0]).path.name
    data = bytearray((copy / library).read_bytes())
    data[-1] ^= 1
    (copy / library).write_bytes(bytes(data))
    probe = f"from agentspec.passes.levels import kernels_or_reason; k = kernels_or_reason({levels[0]!r}); print(k if isinstance(k, str) else k.path)"
    cases = {
        (str(copy), "packaged"): "is not the library the package's build wrote",
        (str(tmp_path / "empty"), "packaged"): "the package carries no compiled kernels",
        (str(tmp_path / "empty"), ""): "no C compiler",
    }
    for (folder, how), expected in cases.items():
        env = {**os.environ, FOLDER_VARIABLE: folder, KERNELS_VARIABLE: how, "CC": "", "PATH": str(Path(sys.executable).parent), "AGENTSPEC_CACHE_DIR": str(tmp_path / "cache")}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert expected in done.stdout, (folder, how, done.stdout + done.stderr[-1000:])


def test_without_kernels_a_gguf_file_is_refused_or_its_float_pass_said_at_warning(tmp_path):
    """Where no level of the kernels runs (here: a package that carries none, and no compiler), the
    default GGUF file read as the model is refused with a typed error naming why and the float
    pass's memory; read through transformers instead, "auto" may take a float32 pass, but says so
    at WARNING with the reason — never silently slow."""
    probe = (
        "import logging\n"
        "from agentspec.errors import ModelLoadError\n"
        "from agentspec.engine.kv import KVLayout\n"
        "from agentspec.model import load_model\n"
        "from agentspec.passes.weights import select_weights\n"
        "loaded = load_model(None)\n"
        "try:\n"
        "    select_weights(loaded.module, KVLayout.of(loaded.module), 'auto', loaded.gguf_file)\n"
        "except ModelLoadError as exc:\n"
        "    print('refused:', exc)\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "chosen = select_weights(loaded.model, KVLayout.of(loaded.model), 'auto', loaded.gguf_file)\n"
        "print('chosen:', chosen.name)\n"
    )
    env = {**os.environ, FOLDER_VARIABLE: str(tmp_path / "empty"), KERNELS_VARIABLE: "packaged", "AGENTSPEC_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    refused = next(line for line in done.stdout.splitlines() if line.startswith("refused:"))
    assert "the package carries no compiled kernels" in refused and "weights='fused'" in refused and "GB of memory" in refused
    chosen = next(line for line in done.stdout.splitlines() if line.startswith("chosen:")).split()[-1]
    assert chosen not in ("gguf", "gguf-q16", "gguf-q8")
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING target pass:")]
    assert len(warnings) == 1 and "the package carries no compiled kernels" in warnings[0], done.stderr[-2000:]
