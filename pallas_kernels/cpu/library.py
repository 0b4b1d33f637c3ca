"""Finding and loading the C++ kernels: setup.py builds one library per instruction-set level
(`_strata_cpu_<level>*.so` in this folder); the best level this CPU runs is chosen when it loads.

    lib, why = load()      # (the library, None), or (None, why the kernels are unavailable); cached
    level()                # "avx512vnni", "avx2", ...: the level in use (None when unavailable)

load() first loads the base level (scalar on x86-64, generic elsewhere: safe on any CPU of the
architecture, and it runs nothing but cpuid when asked), asks it which levels this CPU and OS run
(isa.cc: strata_cpu_supports), and loads the best of those that was built. A library built on an
AVX-512 machine thus runs on an AVX2 one, at its AVX2 level, instead of dying on an illegal
instruction.

Environment (read here, not in strata_jax/envs.py: this package is below strata_jax):
- STRATA_CPU_ISA=<level>: use that level (to test or benchmark a lower level on a wider CPU). A name
  that is not a level, a level this CPU cannot run, or one that was not built is an error: load()
  gives it as the reason the kernels are unavailable.
- STRATA_CPU_KERNELS_LIB=<path>: load that file as is (a build with other flags); no level is
  chosen.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import platform
from collections.abc import Sequence
from functools import cache
from pathlib import Path

LIB_ENV = "STRATA_CPU_KERNELS_LIB"
ISA_ENV = "STRATA_CPU_ISA"

# Best last. The names and their -march flags are setup.py's X86_LEVELS / OTHER_LEVELS.
X86_LEVELS = ("scalar", "avx2", "avxvnni", "avx512", "avx512vnni")
OTHER_LEVELS = ("generic",)
LEVELS = X86_LEVELS if platform.machine().lower() in ("x86_64", "amd64") else OTHER_LEVELS

STEM = "_strata_cpu_"
HERE = Path(__file__).parent

# The CPU features the levels are made of: the name `inspect --system` shows -> /proc/cpuinfo's
# name.
FLAGS = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avxvnni": "avx_vnni", "avx512f": "avx512f",
         "avx512bw": "avx512bw", "avx512vnni": "avx512_vnni", "avx512vbmi": "avx512vbmi"}


class LevelError(ValueError):
    """STRATA_CPU_ISA names a level that cannot be used here; the message says why and what to
    set."""


class Kernels(ctypes.CDLL):
    """The loaded library, with the level it was built for, its path, and how it was chosen."""

    def __init__(self, path: Path, level: str, how: str):
        super().__init__(str(path))
        self.path, self.level, self.how = path, level, how


def choose_level(forced: str | None, supported: set[str], built: set[str],
                 levels: Sequence[str] = LEVELS) -> str:
    """The level to load: `forced` (STRATA_CPU_ISA) if it can be used, else the best of `levels`
    that this CPU runs (`supported`) and that was built. Raises LevelError saying what is wrong and
    what to do."""
    runs = [lv for lv in levels if lv in supported]
    best = runs[-1] if runs else None
    if forced:
        if forced not in levels:
            raise LevelError(f"{ISA_ENV}={forced!r} is not a level of this machine's kernels: "
                             f"use one of {', '.join(levels)} (best last), or unset it")
        if forced not in supported:
            raise LevelError(f"{ISA_ENV}={forced}: this CPU cannot run that level's instructions "
                             f"(its best level is {best}); set {ISA_ENV} to one of "
                             f"{', '.join(runs)}, or unset it")
        if forced not in built:
            raise LevelError(f"{ISA_ENV}={forced}: that level was not built (built: "
                             f"{', '.join(_ordered(built, levels))}); the build leaves out a level "
                             "its compiler cannot make (pip's output says why): build with a newer "
                             "compiler (`pip install -e .`), or choose a built level")
        return forced
    usable = [lv for lv in runs if lv in built]
    if not usable:
        raise LevelError("no built level of the kernels runs on this CPU (built: "
                         f"{', '.join(_ordered(built, levels))}; this CPU runs: "
                         f"{', '.join(runs)}): run `pip install -e .` again")
    return usable[-1]


def _ordered(names: set[str], levels: Sequence[str]) -> list[str]:
    return [lv for lv in levels if lv in names] + sorted(names - set(levels)) or ["none"]


def level_path(level: str) -> Path | None:
    """The built library of `level` in this folder, or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (HERE / f"{STEM}{level}{suffix}").exists():
            return HERE / f"{STEM}{level}{suffix}"
    return None


def built_levels() -> list[str]:
    """The levels whose library is in this folder, best last."""
    return [lv for lv in LEVELS if level_path(lv) is not None]


def supported_levels(base: ctypes.CDLL) -> set[str]:
    """The levels this CPU runs, as the base build's cpuid check says."""
    base.strata_cpu_supports.argtypes = [ctypes.c_char_p]
    base.strata_cpu_supports.restype = ctypes.c_int
    return {lv for lv in LEVELS if base.strata_cpu_supports(lv.encode()) == 1}


def _library_level(lib: ctypes.CDLL) -> str | None:
    try:
        fn = lib.strata_cpu_level
    except AttributeError:        # a build from before the levels
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


@cache
def load() -> tuple[Kernels | None, str | None]:
    """(the library, None), or (None, why the kernels are unavailable). Reads the environment
    once."""
    if os.environ.get(LIB_ENV):
        path = Path(os.environ[LIB_ENV])
        if not path.exists():
            return None, f"{LIB_ENV}={path} does not exist"
        try:
            lib = Kernels(path, "?", f"{LIB_ENV}={path} (used as is; {ISA_ENV} does not apply)")
        except OSError as e:
            return None, f"the C++ kernels at {path} ({LIB_ENV}) do not load: {e}"
        lib.level = _library_level(lib) or "unknown"
        return lib, None
    base = LEVELS[0]
    base_path = level_path(base)
    if base_path is None:
        return None, (f"the C++ kernels are not built (no {STEM}{base}*.so in {HERE}); "
                      "install a C++ compiler (g++) and run `pip install -e .` again")
    try:
        probe = ctypes.CDLL(str(base_path))
        supported = supported_levels(probe)
    except (OSError, AttributeError) as e:
        return (None,
                f"the C++ kernels at {base_path} do not load ({e}): run `pip install -e .` again")
    forced = os.environ.get(ISA_ENV, "").strip() or None
    built = set(built_levels())
    try:
        chosen = choose_level(forced, supported, built)
    except LevelError as e:
        return None, str(e)
    if forced:
        return _open(chosen, f"forced by {ISA_ENV}={forced}")
    how = ("chosen by cpuid: the best level this CPU runs "
           f"({', '.join(_ordered(supported, LEVELS))}) of those built "
           f"({', '.join(_ordered(built, LEVELS))})")
    failures = []
    # A wider level that does not load (a broken or stale file) costs speed, not the kernels: the
    # next one down.
    for lv in reversed(LEVELS[: LEVELS.index(chosen) + 1]):
        if lv not in supported or lv not in built:
            continue
        lib, why = _open(lv, how + "".join(f"; passed over: {f}" for f in failures))
        if lib is not None:
            if failures:
                logging.getLogger("pallas_kernels").warning("the C++ kernels: %s", lib.how)
            return lib, None
        failures.append(why)
    return None, "; ".join(failures)


def _open(lv: str, how: str) -> tuple[Kernels | None, str | None]:
    path = level_path(lv)
    try:
        lib = Kernels(path, lv, how)
    except OSError as e:
        return (None, (f"the C++ kernels' level {lv} ({path}) does not load: {e}; run `pip install "
                       "-e .` again"))
    # a file left from another build: its code is not that level's
    if _library_level(lib) != lv:
        return (None, (f"{path} says it is level {_library_level(lib)!r}, not {lv!r}: a stale "
                       "build; run `pip install -e .` again"))
    return lib, None


def level() -> str | None:
    """The level in use ("unknown" for a STRATA_CPU_KERNELS_LIB build without one), or None when
    unavailable."""
    lib = load()[0]
    return lib.level if lib is not None else None


def library_path() -> Path | None:
    """The file load() loaded (or would load, with STRATA_CPU_KERNELS_LIB), or None."""
    lib = load()[0]
    if lib is not None:
        return lib.path
    return Path(os.environ[LIB_ENV]) if os.environ.get(LIB_ENV) else None


def cpu_flags() -> dict[str, bool] | None:
    """FLAGS -> whether this CPU has it, from /proc/cpuinfo (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    have = set(line.partition(":")[2].split())
    return {name: cpuinfo in have for name, cpuinfo in FLAGS.items()}


def describe() -> dict:
    """What `strata-jax inspect --system` prints about the kernels."""
    lib, why = load()
    base = level_path(LEVELS[0])
    supported = None
    if base is not None:
        try:
            supported = [lv for lv in LEVELS if lv in supported_levels(ctypes.CDLL(str(base)))]
        except (OSError, AttributeError):
            pass
    return {"levels": list(LEVELS), "built": built_levels(), "cpu_runs": supported,
            "level": lib.level if lib is not None else None,
            "path": str(lib.path) if lib is not None else None,
            "how": lib.how if lib is not None else None, "unavailable": why,
            "cpu_flags": cpu_flags()}
