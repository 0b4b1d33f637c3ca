"""Every environment variable strata_jax reads, in one place (as vLLM's envs.py): its name, what it
means, and the function that reads it. Nothing else in strata_jax reads os.environ
(tests/test_layers.py checks).

A variable changes a default or a test hook, never a setting behind the user's back:
EngineConfig()'s defaults are the same in every shell, and STRATA_BATCH_GRAPHS is the default of the
`--max-programs` flag.

The kernel package below strata_jax reads its own four: STRATA_CPU_ISA
(pallas_kernels/cpu/library.py: the instruction-set level of the C++ kernels to load, one of scalar,
avx2, avxvnni, avx512, avx512vnni, instead of the best one this CPU runs as cpuid says: to test or
benchmark a lower level on a wider CPU; a level the CPU cannot run or that was not built is an
error), STRATA_CPU_KERNELS_LIB (a build of the C++ kernels to load as is instead of the installed
ones), STRATA_CPU_THREADS (the C++ kernels' threads) and STRATA_CPU_POOL=xla (their helpers from
XLA's intra-op pool instead of their own spinning ones).
"""

from __future__ import annotations

import os
from pathlib import Path

# serve --api-key's default; never passed on to the engine process
API_KEY = "STRATA_API_KEY"
# --max-programs' default (live compiled window programs; 0: no bound)
BATCH_GRAPHS = "STRATA_BATCH_GRAPHS"
# the cache folder (models, compiled programs): ~/.cache/strata-jax
CACHE = "STRATA_JAX_CACHE"
# JAX's compilation cache folder, or 0/off (compile_cache.py)
COMPILE_CACHE = "STRATA_JAX_COMPILE_CACHE"
# set by the server for its engine process: 1, 2, ... at each restart
ENGINE_GENERATION = "STRATA_ENGINE_GENERATION"
# fault injection (engine/faults.py), for the fault tests
FAULT = "STRATA_FAULT"
# serve/worker/mock_worker.py: fail at start (the server's restart tests)
MOCK_START_FAIL = "STRATA_MOCK_START_FAIL"
MOCK_TOKEN_S = "STRATA_MOCK_TOKEN_S"            # serve/worker/mock_worker.py: seconds a token
# Ray's own: serve --replicas joins that cluster instead of starting one
RAY_ADDRESS = "RAY_ADDRESS"

MAX_PROGRAMS_DEFAULT = 64


class EnvError(ValueError):
    """A variable whose value cannot be used: names the variable and the value."""


def _get(name: str) -> str:
    return os.environ.get(name, "").strip()


def api_key() -> str | None:
    return _get(API_KEY) or None


def max_programs() -> int:
    raw = _get(BATCH_GRAPHS)
    if not raw:
        return MAX_PROGRAMS_DEFAULT
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{BATCH_GRAPHS}={raw!r} is not a whole number (0 = no bound)") from None


def cache_dir() -> Path:
    """Where models and compiled programs are kept: $STRATA_JAX_CACHE, else ~/.cache/strata-jax."""
    raw = _get(CACHE)
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "strata-jax"


def compile_cache() -> str:
    """The raw STRATA_JAX_COMPILE_CACHE ("" when unset): compile_cache.cache_path() reads it."""
    return _get(COMPILE_CACHE)


def engine_generation() -> int:
    raw = _get(ENGINE_GENERATION)
    return int(raw) if raw else 1


def fault_spec() -> str:
    return _get(FAULT)


def mock_start_fail() -> bool:
    return bool(_get(MOCK_START_FAIL))


def mock_token_s() -> float:
    return float(_get(MOCK_TOKEN_S) or 0.005)


def ray_address() -> str:
    """Ray's RAY_ADDRESS ("" when unset): set, ray.init joins that cluster
    (serve/replicas/ray_app.py)."""
    return _get(RAY_ADDRESS)


def environ_without(*names: str) -> dict[str, str]:
    """This process's environment less `names` (for a child process)."""
    return {k: v for k, v in os.environ.items() if k not in names}


def environ_with(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra` (for a child process)."""
    return {**os.environ, **extra}
