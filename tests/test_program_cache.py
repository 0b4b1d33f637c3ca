"""The program cache's memory path without XLA: a fake `build` whose executables report the bytes we
choose.

What the load ladder found (SmolLM2, --device-memory-mib 2000, a loaded 2-core CPU): a window
program that the ledger refused was compiled a second time after the older half was freed, and a
layout bigger than all the memory programs can have was compiled twice at every window that needed
it (a minute each), before the engine split the window anyway. Now the executable the ledger refused
is kept for the retry, and a layout that can never fit is refused at once until the room for
programs grows.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest

from strata_jax.engine.execute.memory import MemoryLedger, MiB, is_resource_exhausted
from strata_jax.engine.execute.programs import Layout, ProgramCache


class FakeCompiled:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def memory_analysis(self):
        return SimpleNamespace(temp_size_in_bytes=self.nbytes, generated_code_size_in_bytes=0,
                               output_size_in_bytes=0, alias_size_in_bytes=0)


def cache_of(sizes_mib: dict[int, float], budget_mib: float, fixed_mib: float = 0.0):
    """A cache over layouts keyed by rows (1 x rows decode windows), each of the given MiB;
    `fixed_mib` of the budget taken by weights. Returns (cache, list of the rows compiled, in
    order)."""
    ledger = MemoryLedger(budget_mib, 0)
    ledger.reserve_bytes("weights", int(fixed_mib * MiB), "weights")
    compiled: list[int] = []

    def build(layout: Layout):
        compiled.append(layout.rows)
        return FakeCompiled(int(sizes_mib[layout.rows] * MiB))

    return ProgramCache(build, ledger, max_programs=0, wait_for_device=lambda: None), compiled


def lay(rows: int) -> Layout:
    return Layout(((rows, 1, False, 0),), 256)


def test_a_refused_program_is_not_compiled_again_after_freeing():
    cache, compiled = cache_of({1: 4, 2: 4, 3: 4, 4: 6}, budget_mib=13)
    for r in (1, 2, 3):
        cache.get(lay(r))
    assert cache.ledger.used["programs"] == 12 * MiB
    # 6 MiB: refused, the older half (1, 2) freed, the same executable kept
    cache.get(lay(4))
    assert compiled == [1, 2, 3, 4] and cache.stats.compiles == 4 and cache.stats.built == 4
    assert list(cache.programs) == [lay(3), lay(4)] and cache.stats.oom_recoveries == 1
    assert cache.ledger.used["programs"] == 10 * MiB and not cache.too_big


def test_a_layout_that_can_never_fit_is_refused_without_compiling():
    # 15 MiB for programs
    cache, compiled = cache_of({1: 2, 2: 2, 8: 20}, budget_mib=30, fixed_mib=15)
    cache.get(lay(1))
    cache.get(lay(2))
    with pytest.raises(jax.errors.JaxRuntimeError) as first:
        cache.get(lay(8))
    assert is_resource_exhausted(first.value) and compiled == [1, 2, 8]
    assert cache.too_big == {lay(8): 20 * MiB}
    # every later window of that layout: refused at once, nothing compiled
    for _ in range(3):
        with pytest.raises(jax.errors.JaxRuntimeError) as again:
            cache.get(lay(8))
        assert is_resource_exhausted(again.value) and "not compiled again" in str(again.value)
    assert compiled == [1, 2, 8] and cache.stats.compiles == 3
    # nothing freed for a hopeless layout
    assert lay(1) in cache.programs and lay(2) in cache.programs
    # with more room (the weights gone) the layout is compiled again and fits
    cache.ledger.release("weights", 15 * MiB)
    cache.get(lay(8))
    assert compiled == [1, 2, 8, 8] and lay(8) in cache.programs


def test_a_refused_program_with_nothing_to_free_goes_up_and_is_compiled_next_time():
    # 6 MiB free, nothing else to free
    cache, compiled = cache_of({1: 8}, budget_mib=10, fixed_mib=4)
    with pytest.raises(jax.errors.JaxRuntimeError):
        cache.get(lay(1))
    assert cache._pending is None and compiled == [1] and cache.too_big == {lay(1): 8 * MiB}
    cache.ledger.release("weights", 4 * MiB)
    cache.get(lay(1))
    assert compiled == [1, 1] and cache.ledger.used["programs"] == 8 * MiB


def test_a_mixed_window_does_not_copy_the_kv_cache(tiny_model):
    """A window of decode rows and a prompt chunk updates the donated KV cache in place: its
    temporary memory is its own work, not a copy of the cache (the load ladder found 452 MiB for a
    450 MiB cache: every mixed window split on a small device; transformer.attention now writes
    every group's keys and values before one read)."""
    from strata_jax import Engine, EngineConfig

    path = tiny_model(arch="llama", layers=4, hidden=64, heads=4, kv_heads=2)
    with Engine.from_gguf(path, EngineConfig(parallel=8, max_context=4096, prefill=64,
                                             warmup=False)) as eng:
        r = eng.runner
        kv = sum(a.nbytes for a in r.cache.values())                       # 32 MiB
        temp = {lay: r.executor.build(lay).memory_analysis().temp_size_in_bytes
                for lay in (Layout(((4, 1, False, 0),), 1024), Layout(((1, 64, False, 0),), 1024),
                            Layout(((4, 1, False, 0), (1, 64, False, 0)), 1024))}
    decode, chunk, mixed = temp.values()
    assert mixed <= 1.5 * (decode + chunk) < kv / 4, (temp, kv)


def built_off_thread(cache: ProgramCache, layout: Layout) -> None:
    cache.build_later(layout)
    cache._wait_built(layout)


def test_a_program_built_off_the_engine_thread_gets_room_as_one_built_on_it():
    """The load ladder with the warm-up on and --device-memory-mib too small for every program: a
    program the builder thread finished was dropped when the ledger refused it, its windows stayed
    narrowed all run, and each of them queued it again to be compiled and dropped again. Now the
    older half is freed for it."""
    cache, compiled = cache_of({1: 4, 2: 4, 3: 4, 4: 6}, budget_mib=13)
    for r in (1, 2, 3):
        cache.get(lay(r))
    built_off_thread(cache, lay(4))
    assert cache.ready(lay(4)) and compiled == [1, 2, 3, 4] and cache.stats.compiles == 4
    assert list(cache.programs) == [lay(3), lay(4)] and cache.stats.oom_recoveries == 1
    assert cache.ledger.used["programs"] == 10 * MiB and cache._pending is None
    cache.build_later(lay(4))          # built: nothing queued, nothing compiled
    assert cache.pending == 0 and compiled == [1, 2, 3, 4]
    cache.close()


def test_a_program_built_off_the_engine_thread_that_can_never_fit_is_not_built_again():
    # 15 MiB for programs
    cache, compiled = cache_of({1: 2, 8: 20}, budget_mib=30, fixed_mib=15)
    cache.get(lay(1))
    built_off_thread(cache, lay(8))
    assert not cache.ready(lay(8)) and cache.refused(lay(8)) and lay(1) in cache.programs
    for _ in range(3):                 # every window that meets it: not queued, not compiled
        cache.build_later(lay(8))
        assert cache.pending == 0
    assert compiled == [1, 8]
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        cache.get(lay(8))              # the engine's window is refused at once, and split
    assert is_resource_exhausted(refused.value) and compiled == [1, 8]
    cache.ledger.release("weights", 15 * MiB)
    assert not cache.refused(lay(8))   # room grew: it may be built again
    built_off_thread(cache, lay(8))
    assert cache.ready(lay(8)) and compiled == [1, 8, 8]
    cache.close()
