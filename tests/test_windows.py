"""Windows that read several prompts within --batch-tokens (packed on the cpu backend), the layouts
they make, and no compile while serving: programs met for the first time are built off the engine
thread while smaller windows whose programs exist run."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.engine import SamplingParams
from strata_jax.engine.schedule.scheduler import Scheduler, bucket
from strata_jax.engine.schedule.slots import Slot

MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}
BASE = {"max_context": 128, "prefill": 32, "batch_tokens": 128}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 500, int(rng.integers(3, 80)))] for _ in range(n)]


def _together(eng, prompts, **kw) -> list[list[int]]:
    handles = [eng.submit(p, **kw) for p in prompts]
    return [[ev.token for ev in h if ev.kind == "token"] for h in handles]


@pytest.fixture(scope="module")
def moe(tiny_model):
    return tiny_model(**MOE)


@pytest.fixture(scope="module")
def alone(moe):
    """Each prompt alone: its greedy tokens."""
    with Engine.from_gguf(moe, EngineConfig(parallel=1, warmup=False, **BASE)) as eng:
        return [eng.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True).tokens
                for p in _prompts(16)]


def test_sixteen_prompts_at_once_give_what_each_gives_alone(moe, alone):
    with Engine.from_gguf(moe, EngineConfig(parallel=16, warmup=False, **BASE)) as eng:
        assert eng.runner.packed                     # the cpu backend: one packed group a window
        got = _together(eng, _prompts(16), max_tokens=6, temperature=0.0, ignore_eos=True)
        st = eng.stats()
    assert got == alone
    # windows read several prompts: 16 arriving prompts took far fewer windows than prompt chunks
    assert st["multi_prompt_windows"] > 0 and st["prompt_rows"] > st["multi_prompt_windows"]
    assert st["prompt_rows"] >= 16 and st["failed"] == 0


def test_grouped_windows_read_several_prompts_too(moe, alone):
    """The other backends' windows (prompt rows of one group; forced here): the same tokens."""
    with Engine.from_gguf(moe, EngineConfig(parallel=16, warmup=False, **BASE)) as eng:
        eng.scheduler.packed = False
        got = _together(eng, _prompts(16), max_tokens=6, temperature=0.0, ignore_eos=True)
        st = eng.stats()
        layouts = st["programs"]["layouts"]
    assert got == alone
    assert st["multi_prompt_windows"] > 0
    groups = [(int(r), int(n)) for lay in layouts for r, n in re.findall(r"(\d+)x(\d+)", lay)]
    assert any(r > 1 and n > 1 for r, n in groups)      # a prompt group of several rows


def test_the_budget_bounds_a_window_and_chunks_keep_their_boundaries():
    sched = Scheduler(max_chunk=32, min_rows=1, batch_tokens=64, packed=True)
    slots = []
    for i, n in enumerate([50, 10, 40, 7, 90]):
        s = Slot(i)
        s.tokens, s.n_past = list(range(3, 3 + n)), 0
        s.request = _Req(n)
        slots.append(s)
    seen = []
    for _ in range(12):
        w = sched.plan(slots)
        if w is None:
            break
        (g,) = w.groups
        assert g.tokens.shape[0] <= 64                   # padded tokens within --batch-tokens
        assert g.tokens.shape[0] == bucket(sum(w.chunks), 1)
        for s, c in zip(w.prefills, w.chunks):
            # cut at multiples of --prefill
            assert c == min(32 - s.n_past % 32, len(s.tokens) - s.n_past)
            seen.append((s.index, s.n_past, c))
            s.n_past += c
            if s.n_past == len(s.tokens):
                s.request = None                         # read: out of the scheduler's hands here
        assert sum(g.picks >= 0) == len(g.picks)
    assert all(s.n_past == len(s.tokens) for s in slots)                  # every prompt was read
    assert len({i for i, _, _ in seen}) == 5


class _Req:
    def __init__(self, n):
        self.prompt = list(range(n))
        self.id = n
        self.params = SamplingParams()                  # greedy, no controls
        self.constraint = None                          # no grammar
        self.checkpoint_at = None                       # no hybrid state kept mid-prompt


def test_no_compile_while_serving_the_same_burst_twice(moe):
    """With the warm-up (decode programs now, the rest on the builder thread), once the builds are
    done no burst compiles anything, fresh prompts or prefix hits; the programs stay within
    base_layouts()."""
    with Engine.from_gguf(moe, EngineConfig(parallel=8, **BASE)) as eng:
        assert eng.wait_for_programs(timeout=300)
        base = {str(lay) for lay in eng.runner.base_layouts()}
        before = eng.stats()["programs"]["compiles"]
        prompts = _prompts(8, seed=3)
        first = _together(eng, prompts, max_tokens=5, temperature=0.0, ignore_eos=True)
        again = _together(eng, prompts, max_tokens=5, temperature=0.0, ignore_eos=True)
        st = eng.stats()
    assert first == again
    assert st["programs"]["compiles"] == before
    assert set(st["programs"]["layouts"]) <= base


def test_a_layout_being_built_runs_smaller_windows_meanwhile(moe, alone):
    """A window whose program is still being built (slowed down here) runs as smaller windows whose
    programs exist, without waiting: decode rows go on, and every request gets the tokens it gets
    alone."""
    with Engine.from_gguf(moe, EngineConfig(parallel=16, **BASE)) as eng:
        eng.wait_for_programs(timeout=300)
        progs = eng.runner.programs
        progs.clear()                                   # only the decode programs come back at once
        for lay in eng.runner.base_layouts():
            if all(e == r for r, _, _, e in lay.groups):
                progs.get(lay)
        build = progs._build
        gate = threading.Event()

        def slow(layout):
            # held until the first requests are decoding
            gate.wait(timeout=60)
            return build(layout)

        progs._build = slow
        prompts = _prompts(16)
        handles = [eng.submit(p, max_tokens=6, temperature=0.0, ignore_eos=True)
                   for p in prompts[:2]]
        time.sleep(0.5)
        handles += [eng.submit(p, max_tokens=6, temperature=0.0, ignore_eos=True)
                    for p in prompts[2:]]
        time.sleep(0.5)
        gate.set()
        got = [[ev.token for ev in h if ev.kind == "token"] for h in handles]
        st = eng.stats()
    assert got == alone
    assert st["narrowed_windows"] > 0 and st["failed"] == 0
