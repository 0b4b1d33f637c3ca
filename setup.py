"""Builds the C++ CPU kernels (pallas_kernels/cpu/*.cc) into
pallas_kernels/cpu/_strata_cpu_<level>*.so, one library per instruction-set level (LEVELS), compiled
at the same time.

Everything else about the package is in pyproject.toml. The libraries are XLA FFI handler libraries
loaded with ctypes (not Python extension modules): they need XLA's FFI headers, which ship with
jaxlib (jaxlib/include; `[build-system] requires` puts jaxlib in pip's isolated build environment).
pallas_kernels/cpu/library.py loads the base level, asks it which levels this CPU runs (cpuid),
and loads the best one that was built (STRATA_CPU_ISA forces one).

Optional: without a C++ compiler (or headers) the install still succeeds, prints why the kernels
were not built, and pallas_kernels' backend "auto" uses xla on a CPU. A wider level that does not
compile (an older compiler without -mavxvnni) is left out with a printed line; the others are kept.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = ["pallas_kernels/cpu/dequant.cc", "pallas_kernels/cpu/direct.cc",
           "pallas_kernels/cpu/matmul.cc", "pallas_kernels/cpu/ffi.cc",
           "pallas_kernels/cpu/attention.cc", "pallas_kernels/cpu/isa.cc",
           "pallas_kernels/cpu/int8.cc", "pallas_kernels/cpu/packed.cc",
           "pallas_kernels/cpu/packed_q4k.cc", "pallas_kernels/cpu/pick.cc"]
HEADERS = ["pallas_kernels/cpu/simd.h", "pallas_kernels/cpu/blocks.h",
           "pallas_kernels/cpu/dequant.h", "pallas_kernels/cpu/matmul.h",
           "pallas_kernels/cpu/parallel.h", "pallas_kernels/cpu/q8.h", "pallas_kernels/cpu/int8.h",
           "pallas_kernels/cpu/int8_blocks.h", "pallas_kernels/cpu/packed.h"]

# -ffp-contract=off keeps dequantization's (d * q) + m two roundings, as gguf.quants computes it;
# the accumulation uses explicit FMA instructions (simd.h).
FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fvisibility=hidden", "-w",
         "-Wno-psabi"]
# ELF linkers: a symbol no source defines fails the build (the level is left out, with the linker's
# message), not the library's load at run time.
LINK = ["-Wl,-z,defs"] if sys.platform.startswith("linux") else []

# The instruction-set levels, narrowest (always safe, built first in the list) to widest, with their
# -march flags. Not -march=native: a build (or a wheel) made on one machine must run on another;
# library.py picks a level by cpuid at load time. isa.cc checks at compile time that a level's flags
# match its name.
X86_LEVELS = {
    "scalar": ["-march=x86-64"],
    "avx2": ["-march=x86-64-v3"],                                       # AVX2, FMA, F16C, BMI2
    # + VEX dot products (Alder Lake, Zen 5)
    "avxvnni": ["-march=x86-64-v3", "-mavxvnni"],
    "avx512": ["-march=x86-64-v4"],                                     # AVX-512 F, BW, CD, DQ, VL
    # + dot products, byte permutes
    "avx512vnni": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi"],
}
# any other machine: the compiler's default
OTHER_LEVELS = {"generic": []}
# + level: pallas_kernels/cpu/library.py's names
MODULE = "pallas_kernels.cpu._strata_cpu_"


# STRATA_CPU_LEVELS=scalar,avx2 builds only those levels (the base level is always built): a
# quicker install for a machine that will only ever run those, and the clean-checkout test's build.
LEVELS_ENV = "STRATA_CPU_LEVELS"


def levels() -> dict[str, list[str]]:
    """The levels to build on this machine, base level first."""
    known = X86_LEVELS if platform.machine().lower() in ("x86_64", "amd64") else OTHER_LEVELS
    asked = [x.strip() for x in os.environ.get(LEVELS_ENV, "").split(",") if x.strip()]
    unknown = [x for x in asked if x not in known]
    if unknown:
        raise SystemExit(f"{LEVELS_ENV}={os.environ[LEVELS_ENV]!r}: unknown level(s) {unknown} "
                         f"(this machine builds {list(known)})")
    base = next(iter(known))
    return {k: v for k, v in known.items() if not asked or k == base or k in asked}


def ffi_include_dir() -> Path:
    """jaxlib's include folder (jax.ffi.include_dir() returns the same, without importing jax)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("jaxlib is not importable in the build environment (it provides XLA's "
                           "FFI headers)")
    inc = Path(next(iter(spec.submodule_search_locations))) / "include"
    if not (inc / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"jaxlib at {inc.parent} has no XLA FFI headers "
                           "(include/xla/ffi/api/ffi.h)")
    return inc


class BuildCpuKernels(build_ext):
    def run(self):
        # editable installs: build_ext.run() builds, then copies in place
        in_place = self.inplace
        levels_asked = list(self.extensions)
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - the kernels are optional: say why, install the rest
            msg = (f"strata-jax: the C++ CPU kernels were NOT built: {e}\n"
                   "pallas_kernels will use the xla backend on a CPU (backend='cpu' will raise).")
            print("\n" + "!" * 100 + "\n" + msg + "\n" + "!" * 100 + "\n", file=sys.stderr,
                  flush=True)
            self.extensions = []
        if in_place:
            for ext in levels_asked:
                if ext not in self.extensions:
                    self._remove_stale(ext)

    def build_extensions(self):
        """Every level at once (each is one ~15 s compiler run); the base level must build, a wider
        one may fail."""
        cxx = shlex.split(os.environ.get("CXX", "g++"))
        if not cxx or shutil.which(cxx[0]) is None:
            raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'g++')!r} is not on PATH "
                               "(install g++ or set CXX)")
        include = ffi_include_dir()
        workers = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else (os.cpu_count() or 1))
        with ThreadPoolExecutor(max(1, min(workers, len(self.extensions)))) as pool:
            errors = list(pool.map(lambda ext: self._compile(cxx, include, ext), self.extensions))
        base = self.extensions[0]
        failed = {ext.name: err for ext, err in zip(self.extensions, errors) if err}
        if base.name in failed:
            raise RuntimeError(f"the base level ({base.name}) did not compile: {failed[base.name]}")
        for ext in self.extensions:
            if ext.name in failed:
                print(f"strata-jax: the CPU kernels' level {_level(ext)} was left out (it did not "
                      "compile: an older compiler may not know its -m flags; the other levels are "
                      f"used): {failed[ext.name]}", file=sys.stderr, flush=True)
        self.extensions = [ext for ext in self.extensions if ext.name not in failed]

    def _compile(self, cxx: list[str], include: Path, ext: Extension) -> str | None:
        """Builds one level; returns why it failed, or None."""
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        # a failed level leaves no earlier build behind to be packed
        out.unlink(missing_ok=True)
        level = _level(ext)
        cmd = [*cxx, *FLAGS, *levels()[level], f'-DSTRATA_LEVEL="{level}"', "-I", str(include),
               *ext.sources, *LINK, "-o", str(out)]
        print(f"building the CPU kernels ({level}):", shlex.join(cmd), flush=True)
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode:
            return f"{cxx[0]} failed with exit code {done.returncode}:\n{done.stderr[-4000:]}"
        return None

    def _remove_stale(self, ext: Extension) -> None:
        """An editable install's library of a level not built this time, from an earlier build,
        would otherwise be loaded: built from other sources than the rest, or when the base level
        failed, instead of none."""
        inplace_file, _ = self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)
        if os.path.exists(inplace_file):
            os.remove(inplace_file)
            print(f"strata-jax: removed the earlier build {inplace_file}", file=sys.stderr,
                  flush=True)


def _level(ext: Extension) -> str:
    return ext.name.removeprefix(MODULE)


setup(
    # one Extension a level, so that editable installs copy each into pallas_kernels/cpu/
    ext_modules=[Extension(MODULE + level, sources=SOURCES, depends=HEADERS,
                           optional=i > 0) for i, level in enumerate(levels())],
    cmdclass={"build_ext": BuildCpuKernels},
)
