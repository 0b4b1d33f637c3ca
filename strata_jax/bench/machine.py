"""The machine a bench ran on (CPU, cores, versions, date, load), its memory bandwidth, and the
cores the run may use."""

from __future__ import annotations

import datetime
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_kernels() -> tuple[str | None, str]:
    """The C++ kernels' instruction-set level in use (pallas_kernels/cpu/library.py: chosen by
    cpuid, or forced by STRATA_CPU_ISA) and how it was chosen; or None and why they are
    unavailable."""
    from pallas_kernels.cpu import library

    lib, why = library.load()
    return (lib.level, lib.how) if lib is not None else (None, f"unavailable: {why}")


def machine_info(threads: int) -> dict:
    import jax

    level, how = cpu_kernels()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        # AVX2 and AVX-512 figures differ by more than runs do: a figure is only comparable with its
        # level.
        "cpu_kernels_level": level,
        "cpu_kernels_how": how,
        "llama_cpp_python": _version("llama_cpp_python"),
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        # Other work on the machine slows every figure: the 1-minute load average says whether there
        # was some.
        "load_average_at_start": load_average(),
    }


def limit_threads(threads: int) -> bool:
    """Pin every thread of this process (and those it starts later) to the first `threads` cores, so
    that XLA's thread pool uses as many cores as llama.cpp's --threads. Returns whether anything was
    pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    cores = sorted(os.sched_getaffinity(0))
    if threads >= len(cores):
        return False
    keep = set(cores[:threads])
    tasks = Path("/proc/self/task")
    for tid in (int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else [0]:
        try:
            os.sched_setaffinity(tid, keep)
        except OSError:   # a thread that ended meanwhile
            pass
    return True


def memory_bandwidth(gib: float = 1.0, threads: int = 1, tries: int = 5) -> dict:
    """Bytes a second this machine reads from memory: numpy sums a `gib` GiB float64 array (far
    larger than any cache), on 1 and on `threads` threads (numpy releases the GIL in a sum), best of
    `tries`. A decode step reads its weights once, so read bandwidth (not copy bandwidth) is what
    bounds it."""
    import numpy as np

    n = int(gib * (1 << 30)) // 8
    a = np.ones(n, np.float64)                 # written once, so every page is really there
    parts = np.array_split(a, threads)
    best: dict[int, float] = {}
    with ThreadPoolExecutor(threads) as pool:
        for k in sorted({1, threads}):
            times = []
            for _ in range(tries):
                t = time.perf_counter()
                if k == 1:
                    a.sum()
                else:
                    list(pool.map(np.sum, parts))
                times.append(time.perf_counter() - t)
            best[k] = a.nbytes / min(times)
    k_best = max(best, key=best.get)
    return {"bytes_per_second": best[k_best], "threads": k_best,
            "by_threads": {str(k): v for k, v in best.items()},
            "method": f"numpy sum of a {gib:g} GiB float64 array, best of {tries}, on "
                      f"{' and '.join(map(str, best))} thread(s)"}


def rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory in MiB (Linux /proc; NaN where there is none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
