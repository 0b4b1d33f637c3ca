"""The mtp drafter (issue 8): a made glm4moe model with a NextN layer drafts with it.

Greedy output with --spec 4 --drafter mtp equals plain greedy output (all experts on the device, and
with the expert tiers); every draft the engine proposed is the one the NextN layer gives when run
from scratch over the whole sequence (so the layer's KV is kept in sync across prompt chunks, decode
and verify windows, and a reused prefix); the counters count. The weights are random, so few drafts
are accepted: that the accepted path gives the plain tokens is shown by the other drafters' tests
(tests/test_spec.py), which share the verify group and the accept rule.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.model import (
    Group,
    forward,
    mtp_forward,
    new_kv_cache,
)
from strata_jax.testing.requests import run_all as _run_all

GLM = {"arch": "glm4moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128,
           "expert_ffn": 32, "shared_ffn": 32, "experts": 4, "experts_used": 2, "nextn": 1,
           "quant": "F32"}
BASE = {"parallel": 2, "max_context": 128, "prefill": 16, "warmup": False}
MTP = {"spec": 4, "drafter": "mtp", "spec_min_p": 0.0}
# the offline reference runs every sequence padded to this length (one program)
PAD = 128


def _prompts():
    rng = np.random.default_rng(3)
    a = [int(t) for t in rng.integers(3, 500, 10)]
    return [a * 3, [int(t) for t in rng.integers(3, 500, 23)], a[:4] * 5]


@pytest.fixture(scope="module")
def glm(tiny_model):
    return tiny_model(**GLM)


@pytest.fixture(scope="module")
def reference(glm):
    with Engine.from_gguf(glm, EngineConfig(**BASE)) as eng:
        return [t for t, _ in _run_all(eng, _prompts(), max_tokens=24, ignore_eos=True)]


@pytest.mark.parametrize("tiers", [False, True], ids=["all-experts-on-device", "expert-tiers"])
def test_mtp_greedy_equals_plain(glm, reference, tiers):
    cfg = EngineConfig(**BASE, **MTP, **({"expert_cache": "2"} if tiers else {}))
    with Engine.from_gguf(glm, cfg) as eng:
        assert (eng.runner.stepper is not None) == tiers
        got = _run_all(eng, _prompts(), max_tokens=24, ignore_eos=True)
        st = eng.stats()["spec"]
    assert [t for t, _ in got] == reference
    assert st["drafter"] == "mtp" and st["draft_n"] > 0 and st["verify_windows"] > 0
    assert st["draft_n"] == sum(s["draft_n"] for _, s in got)
    # every prompt position and every committed token went through the layer; chained drafts were
    # made
    assert (st["mtp_synced_positions"] >= sum(len(p) for p in _prompts())
            and st["mtp_chained_drafts"] > 0)


@partial(jax.jit, static_argnums=(1, 2))
def _hidden(params, spec, opts, tokens, pos):
    cache = new_kv_cache(spec, 1, PAD, jnp.float32)
    res = forward(params, spec, opts, (Group(tokens, pos, jnp.zeros(1, jnp.int32), True),), cache,
                  PAD, with_hidden=True)
    return res.hiddens[0], res.cache


@partial(jax.jit, static_argnums=(1, 2))
def _mtp(params, spec, opts, hidden, tokens, pos, cache):
    logits, out, cache = mtp_forward(params, spec, opts, hidden, tokens, pos,
                                     jnp.zeros(1, jnp.int32), cache, PAD, last_only=True)
    return jax.nn.softmax(logits[0]), out, cache


def _layer_drafts(params, spec, opts, seq: list[int], n: int):
    """From scratch: the main model over seq[:-1], the NextN layer over every position (hidden at p,
    token p+1), then n - 1 chained steps -> (drafts, their probabilities, each step's top-2
    margin)."""
    T = len(seq) - 1
    tokens = np.zeros((1, PAD), np.int32)
    pos = np.full((1, PAD), -1, np.int32)
    tokens[0, :T], pos[0, :T] = seq[:T], np.arange(T)
    hid, cache = _hidden(params, spec, opts, tokens, pos)
    nxt = np.zeros((1, PAD), np.int32)
    nxt[0, :T] = seq[1:]
    p, out, cache = _mtp(params, spec, opts, hid, nxt, pos, cache)
    drafts, probs, margins = [], [], []
    for k in range(n):
        if k:
            p, out, cache = _mtp(params, spec, opts, out[:, None],
                                 np.array([[drafts[-1]]], np.int32),
                                 np.array([[T - 1 + k]], np.int32), cache)
        top = np.sort(np.asarray(p))[-2:]
        drafts.append(int(np.argmax(p)))
        probs.append(float(top[1]))
        margins.append(float(top[1] - top[0]))
    return drafts, probs, margins


def test_mtp_drafts_are_the_layers_own(glm):
    """Each proposal equals the NextN layer run from scratch over the slot's sequence: after prompt
    chunks (a 40-token prompt in chunks of 16), decode and verify windows, and for a second request
    that reuses the first one's prefix up to a different token (the prefix cache reads the last
    reused token again, so the layer's entry there is made from this request's next token)."""
    rng = np.random.default_rng(5)
    first = [int(t) for t in rng.integers(3, 500, 40)]
    second = first[:30] + [int(t) for t in rng.integers(3, 500, 6)]
    with Engine.from_gguf(glm, EngineConfig(**dict(BASE, parallel=1), **MTP)) as eng:
        drafter = eng.speculator.drafter
        drafter.record = []
        a = eng.generate(first, max_tokens=12, ignore_eos=True)
        b = eng.generate(second, max_tokens=12, ignore_eos=True)
        records = drafter.record
        params, spec, opts = eng.runner.params, eng.spec, eng.runner.opts
    # 30 shared tokens, the last one read again
    assert b.stats["reused_tokens"] == 29
    assert a.stats["draft_n"] > 0 and b.stats["draft_n"] > 0
    assert len(records) >= 6 and any(len(d) > 1 for _, d, _ in records)
    for seq, drafts, probs in records:
        want, want_p, margins = _layer_drafts(params, spec, opts, seq, len(drafts))
        np.testing.assert_allclose(probs, want_p, rtol=0, atol=1e-4)
        for k, (got, exp, gap) in enumerate(zip(drafts, want, margins)):
            if gap > 1e-4:                                       # a near tie may go either way
                assert got == exp, (len(seq), k)
            if got != exp:
                # later steps chain on a different token
                break


def test_mtp_on_a_model_without_nextn_says_so(tiny_model):
    from strata_jax.config import ConfigError

    with pytest.raises(ConfigError, match="no next-token-prediction"):
        Engine.from_gguf(tiny_model(**dict(GLM, nextn=0)), EngineConfig(**BASE, **MTP))


def test_a_failing_drafter_costs_drafts_not_requests(glm, reference, caplog):
    """The drafter fails in propose (before a window) and in its sync (after one): the requests
    still get the plain greedy tokens, and the log says what happened."""
    with Engine.from_gguf(glm, EngineConfig(**BASE, **MTP)) as eng:
        drafter = eng.speculator.drafter
        calls = {"propose": 0, "sync": 0}
        propose, sync = drafter.propose, drafter.after_window

        def failing(real, name):
            def call(*a, **kw):
                calls[name] += 1
                if calls[name] in (2, 5):
                    raise RuntimeError(f"injected {name} failure")
                return real(*a, **kw)
            return call

        drafter.propose, drafter.after_window = failing(propose, "propose"), failing(sync, "sync")
        with caplog.at_level("WARNING", logger="strata_jax.engine"):
            got = _run_all(eng, _prompts(), max_tokens=24, ignore_eos=True)
    assert [t for t, _ in got] == reference
    assert calls["propose"] > 5 and calls["sync"] > 5
    text = caplog.text
    assert "the drafter failed (injected propose failure)" in text
    assert "the drafter failed after window" in text and "injected sync failure" in text


def test_mtp_with_kv_in_host_ram(glm):
    """--kv-resident 32 with a 16-key attention chunk: the NextN layer's KV past 32 positions lives
    in host RAM too. Greedy --spec 4 --drafter mtp gives the tokens of the same engine without
    speculation."""
    cfg = dict(BASE, attn_chunk=16, kv_resident=32)
    # 30 and 23 tokens, then 24 generated: past 32
    prompts = _prompts()[:2]
    with Engine.from_gguf(glm, EngineConfig(**cfg)) as eng:
        plain = [t for t, _ in _run_all(eng, prompts, max_tokens=24, ignore_eos=True)]
    with Engine.from_gguf(glm, EngineConfig(**cfg, **MTP)) as eng:
        got = _run_all(eng, prompts, max_tokens=24, ignore_eos=True)
        st = eng.stats()
    assert [t for t, _ in got] == plain
    assert st["spec"]["draft_n"] > 0 and st["kv_cache"]["device_positions"] == 32
