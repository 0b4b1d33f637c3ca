"""Run-ahead decode (engine/execute/run_ahead.py): the next decode window is dispatched before this
one's tokens are applied, and taken only if the planned window is that one.

The same requests through an engine with it on and one with it off give the same tokens, greedy and
sampled, whatever ends the rows (length, stop strings and EOS, a row joining mid-decode); the
counters show windows ran ahead, that most were taken and that the ones a changed window or another
program on the KV cache made useless were dropped. Families whose windows change more than the KV
at the next position, --kv-resident's host part and the fault-injection runs never run ahead.
"""

from __future__ import annotations

import threading

import pytest

from strata_jax.config import EngineConfig
from strata_jax.engine import Engine
from strata_jax.engine.core import EngineCore
from strata_jax.gguf import GGUFModel

CFG = {"parallel": 4, "max_context": 96, "prefill": 16, "warmup": False}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module")
def engines(model):
    on = Engine.from_gguf(model, EngineConfig(**CFG))
    off = Engine.from_gguf(model, EngineConfig(**CFG, run_ahead=False))
    yield on, off
    on.close()
    off.close()


def _tokens(eng: Engine, prompt: list[int], **kw) -> tuple[list[int], str | None]:
    toks, reason = [], None
    for ev in eng.submit(prompt, **kw):
        if ev.kind == "token":
            toks.append(ev.token)
        elif ev.kind == "final":
            reason = ev.finish_reason
    return toks, reason


def _together(eng: Engine, jobs: list[tuple[list[int], dict]]) -> list:
    """The jobs as concurrent requests (one thread each) -> each one's (tokens, finish reason)."""
    out: list = [None] * len(jobs)

    def run(i):
        out[i] = _tokens(eng, jobs[i][0], **jobs[i][1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


JOBS = [
    ([5, 6, 7, 8, 9], {"max_tokens": 30, "ignore_eos": True}),
    (list(range(10, 30)), {"max_tokens": 9, "ignore_eos": True}),
    ([40, 41, 42], {"max_tokens": 17, "temperature": 0.9, "seed": 7, "ignore_eos": True}),
    ([3, 1, 4, 1, 5, 9, 2, 6], {"max_tokens": 24, "temperature": 0.7, "top_k": 20, "seed": 3,
                                    "ignore_eos": True}),
]


def test_the_engine_runs_ahead_only_where_it_is_on(engines):
    on, off = engines
    assert on.runner.ahead is not None and off.runner.ahead is None


def test_a_lone_request_takes_every_window_run_ahead_and_the_same_tokens(engines):
    on, off = engines
    before = on.stats()
    got = _tokens(on, [5, 6, 7, 8, 9], max_tokens=40, ignore_eos=True)
    assert got == _tokens(off, [5, 6, 7, 8, 9], max_tokens=40, ignore_eos=True)
    assert got[1] == "length" and len(got[0]) == 40
    after = on.stats()
    ran = after["windows_ahead"] - before["windows_ahead"]
    taken = after["windows_ahead_taken"] - before["windows_ahead_taken"]
    # 40 tokens: the prompt's window gives the first, 39 decode windows the rest; every decode
    # window but the one whose token ends the request by length dispatched its next one
    assert ran == 38 and taken == 38


def test_concurrent_greedy_and_sampled_requests_get_the_same_tokens(engines):
    on, off = engines
    before = on.stats()
    a, b = _together(on, JOBS), _together(off, JOBS)
    assert a == b
    assert [len(t) for t, _ in a] == [30, 9, 17, 24]
    after = on.stats()
    ran = after["windows_ahead"] - before["windows_ahead"]
    taken = after["windows_ahead_taken"] - before["windows_ahead_taken"]
    assert taken > 10 and taken <= ran


def test_stop_strings_and_eos_end_rows_as_without_it(engines, model):
    """A stop string or EOS ends a row in a window that already dispatched the next one: that one is
    dropped (the other rows' next window differs), and the answers are the same."""
    on, off = engines
    free = _tokens(off, [7, 8, 9], max_tokens=24, ignore_eos=True)[0]
    text = on.tokenizer.decode(free[5:8])
    jobs = [([7, 8, 9], {"max_tokens": 24, "stop": [text] if text.strip() else None}),
            ([11, 12, 13, 14], {"max_tokens": 20}),
            ([2, 3], {"max_tokens": 28, "ignore_eos": True})]
    before = on.stats()
    assert _together(on, jobs) == _together(off, jobs)
    after = on.stats()
    assert after["windows_ahead"] - before["windows_ahead"] >= after["windows_ahead_taken"] \
        - before["windows_ahead_taken"] > 0


def test_a_request_joining_mid_decode_drops_the_window_run_ahead(model):
    """Window by window (EngineCore.step): a request comes in while another decodes; the window
    dispatched ahead is dropped (the planned one reads the newcomer's prompt too) and both requests
    get the tokens they get with run-ahead off."""
    outs = {}
    for ahead in (True, False):
        core = EngineCore(GGUFModel.open(model), EngineConfig(**CFG, run_ahead=ahead))
        try:
            a = core.make_request([5, 6, 7, 8, 9], max_tokens=12, ignore_eos=True)
            core.add(a)
            for _ in range(4):
                core.step()
            ran_before = core.runner.stats()["windows_ahead"]
            b = core.make_request(list(range(20, 40)), max_tokens=6, ignore_eos=True)
            core.add(b)
            events = []
            while any(not s.free for s in core.slots) or not core.inbox.empty():
                events += core.step()
            stats = core.runner.stats()
            outs[ahead] = [[e.token for e in events if e.request == r.id and e.kind == "token"]
                           for r in (a, b)]
            if ahead:
                assert ran_before == 3 and stats["windows_ahead_taken"] >= 3
                assert stats["windows_ahead"] > stats["windows_ahead_taken"]
            else:
                assert stats["windows_ahead"] == 0
        finally:
            core.runner.close()
    assert outs[True] == outs[False]
    assert [len(t) for t in outs[True]] == [8, 6]


def test_anything_else_run_on_the_kv_cache_drops_the_window_run_ahead(model):
    """A program run on the cache between two windows (a prefix-cache copy, a restored slot, a
    scratch cache: here one that changes nothing) drops the window dispatched ahead, though the
    planned window is the same: positions it read may hold other tokens by then."""
    core = EngineCore(GGUFModel.open(model), EngineConfig(**CFG))
    try:
        core.add(core.make_request([5, 6, 7, 8, 9], max_tokens=10, ignore_eos=True))
        core.step()                  # the prompt's window: its first token
        core.step()                  # a decode window, which dispatches the next one
        assert core.runner.stats()["windows_ahead"] == 1
        core.runner.kv.through(lambda cache: (cache,))
        core.step()                  # the same window planned: dropped, run again, next dispatched
        stats = core.runner.stats()
        assert stats["windows_ahead_taken"] == 0 and stats["windows_ahead"] == 2
        core.step()                  # taken
        assert core.runner.stats()["windows_ahead_taken"] == 1
    finally:
        core.runner.close()


MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}


def test_expert_tiers_one_program_windows_run_ahead_with_the_same_tokens_and_counts(tiny_model):
    """The expert tiers with the host tier's blocks read in the window's one program (--layer-step
    auto, host experts on: stepped.py's resident window) run ahead too: the same tokens, greedy and
    sampled, as with run-ahead off, and the same expert counters (a window run ahead is counted when
    it is taken, a dropped one nowhere: a lone request drops none). Layer-stepped windows (which
    move experts between layers) never run ahead."""
    path = tiny_model(**MOE)
    tiers = dict(CFG, host_experts="on", layer_step="auto", expert_cache=3)
    got, experts = {}, {}
    for ahead in (True, False):
        with Engine.from_gguf(path, EngineConfig(**tiers, run_ahead=ahead)) as eng:
            assert (eng.runner.ahead is not None) == ahead
            got[ahead] = [_tokens(eng, [5, 6, 7, 8, 9], max_tokens=24, ignore_eos=True)]
            stats = eng.stats()
            experts[ahead] = stats["experts"]
            if ahead:
                # the prompt's window, then 23 decode windows: all but the last dispatched the
                # next, and every one was taken
                assert stats["windows_ahead"] == stats["windows_ahead_taken"] == 22
            got[ahead].append(_together(eng, JOBS))
            if ahead:
                after = eng.stats()
                assert after["windows_ahead_taken"] - stats["windows_ahead_taken"] > 10
    assert got[True] == got[False]
    assert experts[True]["lookups"] > 0 and experts[True]["one_program"] == 24
    for st in experts.values():
        st.pop("copy_seconds")           # a time, not a count
    assert experts[True] == experts[False]
    with Engine.from_gguf(path, EngineConfig(**dict(tiers, layer_step="always"))) as eng:
        assert eng.runner.ahead is None


def test_no_run_ahead_for_a_state_kv_in_host_ram_or_faults(tiny_model, monkeypatch):
    hybrid = tiny_model(arch="qwen3next", layers=4, hidden=64)
    core = EngineCore(GGUFModel.open(hybrid), EngineConfig(**CFG))
    try:
        assert core.runner.ahead is None
    finally:
        core.runner.close()
    core = EngineCore(GGUFModel.open(tiny_model(arch="qwen3", layers=2, hidden=64)),
                      EngineConfig(**dict(CFG, max_context=128), kv_resident=64, attn_chunk=32))
    try:
        assert core.runner.ahead is None
    finally:
        core.runner.close()
    monkeypatch.setenv("STRATA_FAULT", "slow:1")
    core = EngineCore(GGUFModel.open(tiny_model(arch="qwen3", layers=2, hidden=64)),
                      EngineConfig(**CFG))
    try:
        assert core.runner.ahead is None
    finally:
        core.runner.close()
