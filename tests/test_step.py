"""Engine.step() driven window by window, without the engine thread: the exact events of each
window.

Two slots, a 16-token prompt chunk, three requests: A (5 prompt tokens, 3 to generate), B (20 prompt
tokens, read in two chunks, 2 to generate) and C (3 prompt tokens, 1 to generate), which waits for a
slot. Each token is checked against the argmax of the all-logits path (engine/research.py) over the
same sequence, a program of its own: the sampling window and the logits agree on every greedy token.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.config import EngineConfig
from strata_jax.engine import research
from strata_jax.engine.core import EngineCore
from strata_jax.gguf import GGUFModel


@pytest.fixture(scope="module")
def core(tiny_model):
    path = tiny_model(arch="qwen3", layers=2, hidden=64)
    core = EngineCore(GGUFModel.open(path),
                      EngineConfig(parallel=2, max_context=64, prefill=16, warmup=False))
    yield core
    core.runner.close()


def _shown(events):
    return [(e.request, e.kind, e.finish_reason) for e in events]


def _greedy_next(core, seq: list[int]) -> int:
    return int(np.argmax(research.logits_on_scratch(core, seq)[-1]))


def test_step_by_step_events(core):
    a = core.make_request([5, 6, 7, 8, 9], max_tokens=3, ignore_eos=True)
    b = core.make_request(list(range(10, 30)), max_tokens=2, ignore_eos=True)
    c = core.make_request([40, 41, 42], max_tokens=1, ignore_eos=True)
    for req in (a, b, c):
        core.add(req)
    before = dict(core.counters)
    A, B, C = a.id, b.id, c.id

    # 1: A and B take the two slots (C waits); one window reads A's prompt and B's first chunk: A's
    # first token
    s1 = core.step()
    assert core.stepped and _shown(s1) == [(A, "token", None)]
    assert [s.request for s in core.slots] == [a, b] and list(core.admission.waiting) == [c]
    assert [s.n_past for s in core.slots] == [5, 16]
    assert core.counters["multi_prompt_windows"] - before["multi_prompt_windows"] == 1
    # 2: A decodes; B reads its last 4 prompt tokens, which give its first token
    s2 = core.step()
    assert _shown(s2) == [(A, "token", None), (B, "token", None)]
    # 3: both decode to their max_tokens and finish, A first (its row comes first)
    s3 = core.step()
    assert (_shown(s3) == [(A, "token", None), (A, "final", "length"), (B, "token", None),
                           (B, "final", "length")])
    assert all(s.free for s in core.slots) and list(core.admission.waiting) == [c]
    # 4: C gets a freed slot, reads its prompt, and its one token ends it
    s4 = core.step()
    assert _shown(s4) == [(C, "token", None), (C, "final", "length")]
    # 5: nothing to do: no window, no events
    assert core.step() == [] and not core.stepped
    assert core.counters["windows"] - before["windows"] == 4
    assert core.counters["finished"] - before["finished"] == 3

    # every event is also on its request's queue, in the same order
    for req in (a, b, c):
        queued = [req.events.get_nowait() for _ in range(req.events.qsize())]
        assert queued == [e for e in s1 + s2 + s3 + s4 if e.request == req.id]
    # and each token is the greedy token of the all-logits path over the same sequence
    for req, events in ((a, s1 + s2 + s3), (b, s2 + s3), (c, s4)):
        tokens = [e.token for e in events if e.request == req.id and e.kind == "token"]
        assert len(tokens) == req.params.max_tokens
        for k, tok in enumerate(tokens):
            assert tok == _greedy_next(core, req.prompt + tokens[:k]), (req.id, k)


def test_a_cancelled_request_ends_at_the_next_step(core):
    a = core.make_request([7, 8, 9], max_tokens=20, ignore_eos=True)
    core.add(a)
    assert _shown(core.step()) == [(a.id, "token", None)]
    a.cancelled.set()
    events = core.step()
    assert _shown(events) == [(a.id, "final", "cancelled")] and events[0].text == ""
    assert all(s.free for s in core.slots) and core.step() == []


def test_a_bad_request_is_refused_before_it_reaches_a_step(core):
    from strata_jax.engine import ContextOverflowError, RequestError

    with pytest.raises(ContextOverflowError, match="3 prompt tokens \\+ 62"):
        core.make_request([1, 2, 3], max_tokens=62)
    with pytest.raises(RequestError, match="top_p = 0"):
        core.make_request([1, 2, 3], top_p=0.0)
    assert core.inbox.empty() and core.step() == []
