"""The build of agentspec-llm: pure Python, plus the GGUF block kernels compiled once per
instruction-set level of the architecture built for (``agentspec/passes/isa.py``) into the package's
``agentspec/passes/kernels`` folder. They are loaded with ctypes, not imported, so the wheel is tagged
``py3-none-<platform>``: one wheel per platform serves every Python 3.11+.

``CC`` picks the compiler (a cross compiler too: ``CC=aarch64-linux-gnu-gcc AGENTSPEC_BUILD_ARCH=aarch64``
with ``--plat-name``); ``AGENTSPEC_BUILD_LEVELS=avx2,avx512`` builds only those levels. An editable
install builds the kernels in place.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build
from setuptools.dist import Distribution

HERE = Path(__file__).parent
PACKAGE = HERE / "agentspec" / "passes"


def _isa():
    """agentspec/passes/isa.py, loaded by its path: nothing else of the package imports at build time."""
    spec = importlib.util.spec_from_file_location("agentspec_build_isa", PACKAGE / "isa.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class build_kernels(Command):
    """Compile the GGUF block kernels for every level of the target architecture."""

    description = "compile the GGUF block kernels (blocks.c) once per instruction-set level"
    user_options = []
    editable_mode = False  # set by an editable install: build in the source tree

    def initialize_options(self):
        self.build_lib = None
        self.outputs = []

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def _folder(self) -> Path:
        if self.editable_mode:
            return PACKAGE / "kernels"
        return Path(self.build_lib, "agentspec", "passes", "kernels")

    def run(self):
        isa = _isa()
        folder = self._folder()
        only = tuple(filter(None, os.environ.get("AGENTSPEC_BUILD_LEVELS", "").split(",")))  # a smaller build (the tests')
        manifest = isa.build_all(folder, arch=os.environ.get("AGENTSPEC_BUILD_ARCH") or None, only=only)
        names = [*manifest["libraries"], *([isa.MANIFEST] if manifest["libraries"] else [])]
        self.outputs = [str(folder / name) for name in names]
        if not self.outputs:
            self.announce(f"no GGUF block kernels for {manifest['arch']}: the package runs without them", level=3)

    def get_outputs(self):
        return [] if self.editable_mode else self.outputs

    def get_output_mapping(self):
        return {}


class build_with_kernels(build):
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class bdist_wheel_any_python(bdist_wheel):
    """A platform wheel for any Python 3: the kernels are shared libraries loaded with ctypes."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


class DistributionWithKernels(Distribution):
    def has_ext_modules(self):
        return True  # platform-specific: the kernels


setup(
    distclass=DistributionWithKernels,
    cmdclass={"build": build_with_kernels, "build_kernels": build_kernels, "bdist_wheel": bdist_wheel_any_python},
)
