"""Builds the C++ CPU kernels (justapi/kernels/*.cpp) into justapi.kernels._C when the package is installed, with
torch's extension builder, as serving engines ship their kernels; everything else is in pyproject.toml.

The kernels are compiled for this machine's CPU; the instruction sets they were built for are saved beside them,
and justapi.kernels compiles them again on first use on a CPU that lacks any of those.
"""

import importlib.util
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

KERNELS = os.path.join("justapi", "kernels")
_spec = importlib.util.spec_from_file_location("build_spec", os.path.join(KERNELS, "build_spec.py"))
spec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spec)


class BuildKernels(BuildExtension):
    """torch's BuildExtension, which also records the instruction sets the kernels were compiled for."""

    def run(self):
        super().run()
        for ext in self.extensions:
            target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), spec.FLAGS_FILE)
            with open(target, "w") as f:
                f.write(" ".join(sorted(spec.cpu_flags())) + "\n")


setup(
    ext_modules=[CppExtension("justapi.kernels._C", [os.path.join(KERNELS, s) for s in spec.SOURCES],
                              extra_compile_args=list(spec.CFLAGS), extra_link_args=list(spec.LDFLAGS))],
    cmdclass={"build_ext": BuildKernels},
)
