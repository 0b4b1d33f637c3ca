"""Builds the C++ CPU kernels (pallas_kernels/cpu/*.cc) into pallas_kernels/cpu/_strata_cpu*.so.

Everything else about the package is in pyproject.toml. The library is an XLA FFI handler library
loaded with ctypes (not a Python extension module): it needs XLA's FFI headers, which ship with
jaxlib (jaxlib/include; `[build-system] requires` puts jaxlib in pip's isolated build environment).

Optional: without a C++ compiler (or headers) the install still succeeds, prints why the kernels
were not built, and pallas_kernels' backend "auto" uses xla on a CPU.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = ["pallas_kernels/cpu/dequant.cc", "pallas_kernels/cpu/direct.cc", "pallas_kernels/cpu/matmul.cc",
           "pallas_kernels/cpu/ffi.cc", "pallas_kernels/cpu/attention.cc"]
HEADERS = ["pallas_kernels/cpu/simd.h", "pallas_kernels/cpu/blocks.h", "pallas_kernels/cpu/dequant.h",
           "pallas_kernels/cpu/matmul.h", "pallas_kernels/cpu/parallel.h"]

# -march=native: the library is built on the machine that runs it (an editable or source install;
# no binary wheel of this package is published), so it uses that CPU's widest SIMD (AVX-512, else
# AVX2+FMA, else the scalar fallback: simd.h). -ffp-contract=off keeps dequantization's (d * q) + m
# two roundings, as gguf.quants computes it; the accumulation uses explicit FMA instructions.
# STRATA_CPU_CXXFLAGS replaces the -march flag (e.g. "-mavx2 -mfma" to build the AVX2 path).
FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fvisibility=hidden", "-w", "-Wno-psabi"]


def ffi_include_dir() -> Path:
    """jaxlib's include folder (jax.ffi.include_dir() returns the same, without importing jax)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("jaxlib is not importable in the build environment (it provides XLA's FFI headers)")
    inc = Path(next(iter(spec.submodule_search_locations))) / "include"
    if not (inc / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"jaxlib at {inc.parent} has no XLA FFI headers (include/xla/ffi/api/ffi.h)")
    return inc


class BuildCpuKernels(build_ext):
    def run(self):
        try:
            super().run()                            # builds each extension, then copies it in place if editable
        except Exception as e:  # noqa: BLE001 - the kernels are optional: say why, install the rest
            msg = (f"strata-jax: the C++ CPU kernels were NOT built: {e}\n"
                   "pallas_kernels will use the xla backend on a CPU (backend='cpu' will raise).")
            print("\n" + "!" * 100 + "\n" + msg + "\n" + "!" * 100 + "\n", file=sys.stderr, flush=True)
            self.extensions = []

    def build_extension(self, ext):
        cxx = shlex.split(os.environ.get("CXX", "g++"))
        if not cxx or shutil.which(cxx[0]) is None:
            raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'g++')!r} is not on PATH (install g++ or set CXX)")
        arch = shlex.split(os.environ.get("STRATA_CPU_CXXFLAGS", "-march=native"))
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*cxx, *FLAGS, *arch, "-I", str(ffi_include_dir()), *ext.sources, "-o", str(out)]
        print("building the CPU kernels:", shlex.join(cmd), flush=True)
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cxx[0]} failed with exit code {done.returncode}:\n{done.stderr[-4000:]}")


setup(
    ext_modules=[Extension("pallas_kernels.cpu._strata_cpu", sources=SOURCES, depends=HEADERS)],
    cmdclass={"build_ext": BuildCpuKernels},
)
