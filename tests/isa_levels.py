"""Running one snippet on every ISA level of the cpu kernels that pip built and this CPU runs, each
in a fresh process (STRATA_CPU_KERNELS_LIB loads that level's library as is): shared by the tests
that check every level gives the same bits (tests/test_cpu_int8.py, tests/test_cpu_packed.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

from pallas_kernels import cpu
from pallas_kernels.cpu import library


def outputs_by_level(code: str) -> dict[str, list[str]]:
    """{level: the words `code` printed}, for every built level this CPU runs (at least two, else a
    failure)."""
    supported = library.supported_levels(ctypes.CDLL(str(library.level_path(library.LEVELS[0]))))
    runnable = [lv for lv in library.built_levels() if lv in supported]
    assert len(runnable) >= 2, (f"only {runnable} of the built levels {library.built_levels()} run "
                                "here")
    out = {}
    for level in runnable:
        env = {**os.environ, cpu.LIB_ENV: str(library.level_path(level))}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              check=False)
        assert done.returncode == 0, f"{level}: {done.stderr[-2000:]}"
        out[level] = done.stdout.split()
    return out
