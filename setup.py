"""Builds the C of engine/native/csrc once per instruction-set variant (engine/native/build.py) at install time.

A variant the compiler cannot build (an old compiler, another architecture) is left out with a warning; a
machine where none builds installs anyway and runs torch's operations (engine.native says so at start-up).
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, LinkError

_spec = importlib.util.spec_from_file_location("native_build", Path(__file__).parent / "engine/native/build.py")
native_build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = native_build  # dataclasses look their module up
_spec.loader.exec_module(native_build)


class BuildVariants(build_ext):
    """Each variant compiles the same C with its own flags, so each gets its own object folder. A variant that
    does not build leaves no library behind: one an earlier build left was compiled from other C, and
    engine.native would refuse it (its source hash) and run torch's operations instead of the next variant."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.left_out: list[Extension] = []

    def build_extension(self, ext: Extension) -> None:
        shared = self.build_temp
        self.build_temp = os.path.join(shared, ext.name)
        try:
            super().build_extension(ext)
        except (CCompilerError, CompileError, LinkError, OSError) as e:
            self.left_out.append(ext)
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            self.warn(f"engine.native: cannot build {ext.name} ({e}); it is left out")
        finally:
            self.build_temp = shared

    def copy_extensions_to_source(self) -> None:
        """--inplace (and pip install -e): copy the variants that built, remove the others' old copies."""
        for ext in self.left_out:
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
        built, self.extensions = self.extensions, [e for e in self.extensions if e not in self.left_out]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = built

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # a library of C functions for ctypes, not a Python module


_CSRC = Path(__file__).parent / "engine/native/csrc"
setup(
    ext_modules=[
        Extension(f"engine.native.{v.module}", sources=[f"engine/native/csrc/{p.name}" for p in native_build.sources(_CSRC)],
                  depends=[f"engine/native/csrc/{p.name}" for p in native_build.headers(_CSRC)],
                  extra_compile_args=native_build.compile_args(v, _CSRC), extra_link_args=["-fopenmp"], libraries=["m"])
        for v in native_build.VARIANTS if v.builds_here()
    ],
    cmdclass={"build_ext": BuildVariants},
)
