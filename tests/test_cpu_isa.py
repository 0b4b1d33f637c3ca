"""The C++ kernels' instruction-set levels (setup.py builds one library a level;
pallas_kernels/cpu/library.py loads the best one this CPU runs, or the one STRATA_CPU_ISA forces):
the choice, its refusals, the cpuid check of the base build against /proc/cpuinfo, each level loaded
in a process of its own, and `inspect --system`."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels.cpu import library
from pallas_kernels.cpu.library import (
    ISA_ENV,
    LEVELS,
    LIB_ENV,
    X86_LEVELS,
    LevelError,
    choose_level,
)

ROOT = Path(__file__).resolve().parents[1]
ALL = set(X86_LEVELS)
x86_only = pytest.mark.skipif(LEVELS != X86_LEVELS,
                              reason="the x86-64 levels exist only on an x86-64 machine")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (ISA_ENV, LIB_ENV)}
    return {**env, **extra}


def _cpu_runs() -> set[str]:
    """The levels this CPU runs, as the base build's cpuid check says (the base level must be
    built)."""
    base = library.level_path(LEVELS[0])
    assert base is not None, f"the base level {LEVELS[0]} is not built: run `pip install -e .`"
    return library.supported_levels(ctypes.CDLL(str(base)))


@pytest.fixture
def fresh_load():
    """load() reads the environment once; these tests change it, then leave a fresh cache behind."""
    library.load.cache_clear()
    yield library.load
    library.load.cache_clear()


# ---- choose_level: pure --------------------------------------------------------------------------

def test_choose_level_picks_the_best_level_the_cpu_runs_and_that_was_built():
    assert choose_level(None, ALL, ALL, X86_LEVELS) == "avx512vnni"
    # Zen 5 as this VM shows it: AVX-512 with VNNI, no AVX-VNNI
    assert choose_level(None, ALL - {"avxvnni"}, ALL, X86_LEVELS) == "avx512vnni"
    # Alder Lake: AVX-VNNI, no AVX-512
    assert choose_level(None, {"scalar", "avx2", "avxvnni"}, ALL, X86_LEVELS) == "avxvnni"
    # Zen 3: AVX2 only
    assert choose_level(None, {"scalar", "avx2"}, ALL, X86_LEVELS) == "avx2"
    # an old compiler left avx512vnni out: the next level down this CPU runs
    assert choose_level(None, ALL, ALL - {"avx512vnni"}, X86_LEVELS) == "avx512"
    assert choose_level(None, {"scalar"}, ALL, X86_LEVELS) == "scalar"
    assert choose_level(None, {"generic"}, {"generic"}, ("generic",)) == "generic"


def test_a_forced_lower_level_is_used():
    for lv in X86_LEVELS:
        assert choose_level(lv, ALL, ALL, X86_LEVELS) == lv
    assert choose_level("avx2", {"scalar", "avx2", "avx512"}, ALL, X86_LEVELS) == "avx2"


def test_a_forced_level_above_the_cpu_is_refused_with_its_best_level():
    with pytest.raises(LevelError) as e:
        choose_level("avx512", {"scalar", "avx2"}, ALL, X86_LEVELS)
    msg = str(e.value)
    assert msg.startswith(f"{ISA_ENV}=avx512: this CPU cannot run that level's instructions (its "
                          "best level is avx2)")
    assert "one of scalar, avx2," in msg
    with pytest.raises(LevelError, match="its best level is avx512vnni"):
        choose_level("avxvnni", ALL - {"avxvnni"}, ALL, X86_LEVELS)


def test_an_unknown_level_is_refused_with_the_levels():
    with pytest.raises(LevelError) as e:
        choose_level("avx3", ALL, ALL, X86_LEVELS)
    assert str(e.value) == (f"{ISA_ENV}='avx3' is not a level of this machine's kernels: use one "
                            "of scalar, avx2, avxvnni, avx512, avx512vnni (best last), or unset it")
    with pytest.raises(LevelError, match="'avx2' is not a level"):
        choose_level("avx2", {"generic"}, {"generic"}, ("generic",))


def test_a_level_not_built_is_refused():
    with pytest.raises(LevelError) as e:
        choose_level("avxvnni", ALL, {"scalar", "avx2", "avx512"}, X86_LEVELS)
    assert str(e.value).startswith(f"{ISA_ENV}=avxvnni: that level was not built (built: scalar, "
                                   "avx2, avx512)")
    with pytest.raises(LevelError, match="no built level of the kernels runs on this CPU"):
        choose_level(None, {"scalar", "avx2"}, set(), X86_LEVELS)


# ---- the builds and the cpuid check of this machine ----------------------------------------------

def test_every_level_is_built_here():
    """setup.py builds every level (gcc 12 knows every -m flag they use); a level left out would
    fail here."""
    assert library.built_levels() == list(LEVELS)
    # a level this CPU cannot run is never loaded (its initializers may not run)
    for lv in sorted(_cpu_runs()):
        lib = ctypes.CDLL(str(library.level_path(lv)))
        lib.strata_cpu_level.restype = ctypes.c_char_p
        assert lib.strata_cpu_level().decode() == lv


@x86_only
def test_the_cpuid_check_agrees_with_proc_cpuinfo():
    flags = set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("flags"))
                .partition(":")[2].split())
    v3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"} <= flags       # abm: LZCNT
    v4 = v3 and {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags
    expected = {lv for lv, runs in (("scalar", True), ("avx2", v3),
                                    ("avxvnni", v3 and "avx_vnni" in flags),
                                    ("avx512", v4),
                                    ("avx512vnni", v4 and {"avx512_vnni", "avx512vbmi"} <= flags))
                if runs}
    assert _cpu_runs() == expected
    base = ctypes.CDLL(str(library.level_path("scalar")))
    assert base.strata_cpu_supports(b"generic") == -1 and base.strata_cpu_supports(b"avx3") == -1


@x86_only
@pytest.mark.parametrize(("level", "flags", "compiles"), [
    ("avx2", ["-march=x86-64-v3"], True),
    # the label would pass cpuid on an AVX2 CPU, the code would not run
    ("avx2", ["-march=x86-64-v4"], False),
    ("avx512", ["-march=x86-64-v3"], False),
    ("avxvnni", ["-march=x86-64-v3"], False),
    ("avx512vnni", ["-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi"], True),
    ("scalar", ["-march=x86-64-v3"], False),
])
def test_a_level_whose_flags_do_not_match_its_name_does_not_compile(level, flags, compiles):
    cxx = os.environ.get("CXX", "g++")
    assert shutil.which(cxx), f"no C++ compiler ({cxx})"
    done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", *flags, f'-DSTRATA_LEVEL="{level}"',
                           str(ROOT / "pallas_kernels/cpu/isa.cc")], capture_output=True, text=True,
                          check=False)
    assert (done.returncode == 0) == compiles, done.stderr
    if not compiles:
        assert "static assertion failed" in done.stderr and level in done.stderr


# ---- load(): in this process, the environment changed --------------------------------------------

def test_load_refuses_a_forced_level_above_the_cpu(fresh_load, monkeypatch):
    """What a forced level above an AVX2-only CPU gives: no kernels, and the reason backend='cpu'
    raises with."""
    monkeypatch.delenv(LIB_ENV, raising=False)
    monkeypatch.setenv(ISA_ENV, LEVELS[-1])
    monkeypatch.setattr(library, "supported_levels", lambda base: set(LEVELS[:2]))
    lib, why = fresh_load()
    assert lib is None and library.level() is None
    assert why.startswith(f"{ISA_ENV}={LEVELS[-1]}: this CPU cannot run that level's instructions "
                          f"(its best level is {LEVELS[1]})"), why


def test_load_refuses_a_forced_level_not_built(fresh_load, monkeypatch):
    """(on a CPU that runs every level: on an AVX2-only one the CPU's refusal would come first)"""
    monkeypatch.delenv(LIB_ENV, raising=False)
    monkeypatch.setenv(ISA_ENV, LEVELS[-1])
    monkeypatch.setattr(library, "supported_levels", lambda base: set(LEVELS))
    monkeypatch.setattr(library, "built_levels", lambda: list(LEVELS[:-1]))
    lib, why = fresh_load()
    assert lib is None and why.startswith(f"{ISA_ENV}={LEVELS[-1]}: that level was not built"), why


def test_a_wider_level_that_does_not_load_gives_way_to_the_next(fresh_load, monkeypatch, tmp_path):
    """A broken file for the best level (a stale or cut-off build) costs speed, not the kernels."""
    monkeypatch.delenv(LIB_ENV, raising=False)
    monkeypatch.delenv(ISA_ENV, raising=False)
    runs = [lv for lv in LEVELS if lv in _cpu_runs()]
    assert len(runs) >= 2, f"this test needs a CPU that runs two levels; this one runs {runs}"
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a library")
    real = library.level_path
    monkeypatch.setattr(library, "level_path", lambda lv: broken if lv == runs[-1] else real(lv))
    lib, why = fresh_load()
    assert why is None and lib.level == runs[-2], (lib and lib.level, why)
    assert (lib.how.startswith("chosen by cpuid")
            and f"passed over: the C++ kernels' level {runs[-1]}" in lib.how)


def test_the_kernels_lib_variable_loads_that_file_as_is(fresh_load, monkeypatch):
    path = library.level_path("avx2" if "avx2" in LEVELS else LEVELS[0])
    monkeypatch.setenv(LIB_ENV, str(path))
    monkeypatch.setenv(ISA_ENV, LEVELS[0])                   # does not apply, and the line says so
    lib, why = fresh_load()
    assert why is None and lib.path == path and library.library_path() == path
    assert lib.level == path.name.split(".")[0].removeprefix(library.STEM)
    assert lib.how == f"{LIB_ENV}={path} (used as is; {ISA_ENV} does not apply)"
    monkeypatch.setenv(LIB_ENV, "/nonexistent/lib.so")
    library.load.cache_clear()
    assert fresh_load() == (None, f"{LIB_ENV}=/nonexistent/lib.so does not exist")


# ---- each level in a process of its own ----------------------------------------------------------

_LEVEL_SCRIPT = """
import ctypes, hashlib, json, re
from pathlib import Path
import numpy as np, jax.numpy as jnp
from gguf import quants as gq
import pallas_kernels as pk
from pallas_kernels import cpu
from pallas_kernels.cpu import library
from pallas_kernels.layout import layout_for
lib, why = library.load()
out = {"level": library.level(), "why": why, "how": lib and lib.how}
if lib is not None:
    lib.strata_cpu_isa.restype = ctypes.c_char_p
    out["isa"] = lib.strata_cpu_isa().decode()
    # a Q4_1 product (SmolLM2's type) through the loaded level, both maths; 576: a group of 8 blocks cut short
    b = pk.random_blocks("Q4_1", (37, 576), np.random.default_rng(1))
    x = np.random.default_rng(2).standard_normal((5, 576)).astype(np.float32)
    ref = x.astype(np.float64) @ gq.dequantize(b, pk.as_qtype("Q4_1")).astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(gq.dequantize(b, pk.as_qtype("Q4_1"))).astype(np.float64).T
    for math in cpu.MATHS:
        y = np.asarray(cpu.qmatmul(jnp.asarray(x), jnp.asarray(b), layout_for("Q4_1", b.shape[1]), math=math))
        out[math] = hashlib.sha1(y.tobytes()).hexdigest()
        out[math + "_err"] = float((np.abs(y - ref) / scale).max())
maps = sorted({Path(m).name for m in re.findall(r"\\S*_strata_cpu_\\S+", Path("/proc/self/maps").read_text())})
print(json.dumps({**out, "mapped": maps}))
"""  # noqa: E501

# the SIMD path (simd.h's kIsa) each level's code takes: what the library's strata_cpu_isa says
_SIMD = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2", "avx512": "avx512",
         "avx512vnni": "avx512", "generic": "scalar"}


def _run_level(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _LEVEL_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unforced() -> dict:
    return _run_level(_env())


@pytest.mark.parametrize("level", LEVELS)
def test_a_forced_level_loads_that_build_or_is_refused(level, unforced):
    """Every level on this machine: one the CPU runs is loaded (its code: strata_cpu_isa, and no
    wider library is in the process) and gives the bits of the level cpuid chose, in both maths; one
    it cannot run is refused with the CPU's best level."""
    got = _run_level(_env(**{ISA_ENV: level}))
    runs = [lv for lv in LEVELS if lv in _cpu_runs()]
    if level in runs:
        assert got["why"] is None, got
        assert got["level"] == level and got["how"] == f"forced by {ISA_ENV}={level}"
        assert got["isa"] == _SIMD[level]
        # the base level answered cpuid; nothing wider than the forced level was ever loaded
        assert ({m.split(".")[0].removeprefix("_strata_cpu_") for m in got["mapped"]}
                == {LEVELS[0], level})
        # error / (|x| @ |w|^T): exact, float32 summation (4 eps sqrt(k)); int8, x rounded to 1/254
        # of its block's largest |x| (here ~1e-3; 0.02 leaves room for blocks whose largest |x| is
        # far above their mean)
        assert got["exact_err"] < 4 * 2.0**-23 * 576**0.5 and got["int8_err"] < 0.02, got
        assert (got["exact"], got["int8"]) == (unforced["exact"], unforced["int8"]), \
            f"level {level} gives other bits than {unforced['level']}"
    else:
        assert got["level"] is None
        assert got["why"].startswith(f"{ISA_ENV}={level}: this CPU cannot run that level's "
                                     f"instructions (its best level is {runs[-1]})"), got


def test_a_bogus_level_is_a_clear_error():
    got = _run_level(_env(**{ISA_ENV: "bogus"}))
    assert got["level"] is None
    assert got["why"] == (f"{ISA_ENV}='bogus' is not a level of this machine's kernels: use one of "
                          f"{', '.join(LEVELS)} (best last), or unset it")


def test_unforced_the_best_level_the_cpu_runs_is_loaded(unforced):
    got = unforced
    best = [lv for lv in LEVELS if lv in _cpu_runs()][-1]
    assert got["why"] is None and got["level"] == best, got
    assert got["how"].startswith("chosen by cpuid") and "passed over" not in got["how"]
    assert got["isa"] == _SIMD[best]


# ---- strata-jax inspect --system -----------------------------------------------------------------

def _inspect(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_jax", "inspect", *args],
                          capture_output=True, text=True, env=_env(**env), timeout=300, check=False)


def test_inspect_system_prints_the_level_in_use_and_why():
    runs = [lv for lv in LEVELS if lv in _cpu_runs()]
    done = _inspect("--system")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"CPU kernel levels (best last): {', '.join(LEVELS)}" in out
    assert f"  built: {', '.join(LEVELS)}" in out
    assert f"  this CPU runs: {', '.join(runs)}" in out
    assert re.search(rf"^  in use: {runs[-1]} \(chosen by cpuid", out, re.MULTILINE), out
    if LEVELS == X86_LEVELS:
        assert re.search(r"^SIMD flags: avx2 (yes|no), fma (yes|no), f16c (yes|no), avxvnni "
                         r"(yes|no), avx512f (yes|no), avx512bw (yes|no), avx512vnni (yes|no), "
                         r"avx512vbmi (yes|no)$", out, re.MULTILINE)

    forced = _inspect("--system", "--json", **{ISA_ENV: LEVELS[0]})
    assert forced.returncode == 0, forced.stderr
    info = json.loads(forced.stdout)["system"]
    assert info["level"] == LEVELS[0] and info["how"] == f"forced by {ISA_ENV}={LEVELS[0]}"
    assert info["built"] == list(LEVELS) and info["cpu_runs"] == runs

    bogus = _inspect("--system", **{ISA_ENV: "bogus"})
    assert bogus.returncode == 0, bogus.stderr
    assert f"  in use: none: {ISA_ENV}='bogus' is not a level" in bogus.stdout


def test_inspect_without_a_model_or_system_says_what_to_give():
    done = _inspect()
    assert done.returncode == 2
    assert "give a model file (a .gguf) or --system" in done.stderr
