"""Expert tiers: a device cache of a few expert slots a layer (layer-stepped windows) gives the same
logits, bit for bit, and the same greedy tokens as every expert on the device; the host tier in RAM and
the file tier behind it; the eviction policies; the counters and Strata's log lines."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.engine.programs import MIN_PROGRAM_BYTES
from strata_jax.experts import ExpertCounters
from strata_jax.experts.policy import FreqLRUPolicy, LRUPolicy, make_policy

MOE = dict(arch="qwen3moe", layers=2, hidden=64, heads=4, kv_heads=2, experts=8, experts_used=2, expert_ffn=32)
QWEN2MOE = dict(MOE, arch="qwen2moe", shared_ffn=48)
BASE = dict(parallel=2, max_context=64, prefill=16, warmup=False)


def _prompts(n=2, seed=0, lengths=(21, 6)):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 500, lengths[i % len(lengths)])] for i in range(n)]


def _answers(eng, prompts, max_tokens=8):
    """Greedy tokens of every prompt, all submitted at once (so windows hold several rows)."""
    handles = [eng.submit(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    return [[ev.token for ev in h if ev.kind == "token"] for h in handles]


def _check_counters(st: dict, n_slots: int) -> None:
    assert st["device_slots"] == n_slots
    assert st["lookups"] == st["hits"] + st["misses_host"] + st["misses_file"] > 0
    assert st["exchanged"] == st["misses_host"] + st["misses_file"]
    assert st["bytes_moved"] > 0 and st["evictions"] > 0


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Logits and greedy answers with every expert on the device (--expert-cache auto on a CPU)."""
    out = {}
    for name, opts in (("qwen3moe", MOE), ("qwen2moe", QWEN2MOE)):
        path = tiny_model(**opts)
        with Engine.from_gguf(path, EngineConfig(**BASE)) as eng:
            assert eng.runner.expert_mode == "device" and eng.runner.stepper is None
            assert eng.stats()["experts"]["all_on_device"] == 1
            p = _prompts()
            out[name] = (path, eng.logits(p[0]), _answers(eng, p))
    return out


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_device_cache_gives_the_same_bits(reference, arch, caplog):
    path, logits, answers = reference[arch]
    with Engine.from_gguf(path, EngineConfig(**BASE, expert_cache=3)) as eng:
        assert eng.runner.expert_mode == "arena"
        if arch == "qwen2moe":
            assert "sh_gate" in eng.runner.stepper.moe_p[0]          # the shared expert runs in the experts stage
        got = eng.logits(_prompts()[0])
        assert np.array_equal(got, logits)                          # same kernels, same order: the same bits
        with caplog.at_level(logging.INFO, logger="strata_jax.engine"):
            assert _answers(eng, _prompts()) == answers
        st = eng.stats()["experts"]
        _check_counters(st, 3)
        assert st["passes"] > 0                                     # prompt chunks chose more than 3 experts a layer
        assert st["misses_file"] == 0 and st["resident_experts"] == 16
        programs = eng.stats()["programs"]["layouts"]
        assert any("attn" in lay for lay in programs) and any("experts" in lay for lay in programs)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("decode expert cache hit rate: ") and "lookups" in line for line in lines)
    assert any(line.startswith("resident RAM: ") and "blob reads from the file" in line for line in lines)


def test_file_tier_serves_what_ram_does_not_hold(reference):
    path, logits, answers = reference["qwen3moe"]
    budget_gib = 5 * _one_expert_bytes(path) / (1 << 30)              # 5 of the 16 experts in RAM
    cfg = EngineConfig(**BASE, expert_cache=4, resident_budget_gib=budget_gib, pool_workers=2)
    with Engine.from_gguf(path, cfg, expert_policy="lru") as eng:
        assert eng.stats()["experts"]["resident_experts"] == 5
        assert _answers(eng, _prompts()) == answers
        st = eng.stats()["experts"]
        _check_counters(st, 4)
        assert st["misses_file"] > 0 and st["file_reads"] >= st["misses_file"]
        assert st["misses_host"] > 0


def _one_expert_bytes(path) -> int:
    from strata_jax.gguf import GGUFModel

    t = GGUFModel.open(path).tensors
    return sum(int(t[f"blk.0.ffn_{n}_exps.weight"].data[0].nbytes) for n in ("gate", "up", "down"))


def test_auto_uses_the_device_cache_when_the_experts_do_not_fit(tiny_model):
    """With a device-memory budget below weights + KV + every expert, auto picks a device cache that fits,
    and the logits stay the same bits."""
    path = tiny_model(**dict(MOE, hidden=128, experts=16, expert_ffn=256))      # 12 MiB of float experts
    with Engine.from_gguf(path, EngineConfig(**BASE)) as eng:
        assert eng.runner.expert_mode == "device"
        mem = eng.stats()["memory"]
        room = max(eng.runner._largest_window_temp_bytes(), 16 * MIN_PROGRAM_BYTES)
        logits = eng.logits(_prompts()[0])
    budget = mem["weights_bytes"] + mem["kv_bytes"] + room + mem["experts_bytes"] // 2
    cfg = EngineConfig(**BASE, device_memory_mib=budget / 2**20, vram_reserve_mib=0)
    with Engine.from_gguf(path, cfg) as eng:
        assert eng.runner.expert_mode == "arena"
        assert eng.stats()["experts"]["device_slots"] == 8
        assert np.array_equal(eng.logits(_prompts()[0]), logits)


def test_policies():
    lru, freq = LRUPolicy(8), FreqLRUPolicy(8, half_life=100)
    for p in (lru, freq):
        for now in range(1, 6):
            p.access([0], now)                  # expert 0 is hot
        p.access([1], 6)
        p.access([2], 7)
    resident = [0, 1, 2]
    assert lru.victim(resident, set(), 8) == 0          # plain LRU drops the hot expert: least recent
    assert freq.victim(resident, set(), 8) == 1         # frequency-aware: the one-off, least recent of equals
    assert freq.victim(resident, {1}, 8) == 2
    aged = FreqLRUPolicy(4, half_life=1)                # with fast aging, old heat fades
    aged.access([0], 1)
    aged.access([0], 2)
    aged.access([1], 50)
    assert aged.victim([0, 1], set(), 51) == 0
    with pytest.raises(RuntimeError):
        lru.victim([0], {0}, 9)
    with pytest.raises(ValueError, match="lfu"):
        make_policy("lfu", 4)


def test_counter_lines():
    c = ExpertCounters(decode_lookups=468, decode_hits=271, decode_misses=197)
    assert c.hit_line().startswith("decode expert cache hit rate: 57.9% (271 hits / 468 lookups); 197 more read")
    total = ExpertCounters()
    total.add(c)
    total.add(c)
    assert total.as_dict()["decode_hits"] == 542


def test_upcycled_smollm2_device_cache(tmp_path):
    """A real model (SmolLM2 upcycled to 8 experts, top-2) through 2 expert slots a layer, experts in
    GGUF blocks: the same logits, bit for bit, and the same greedy tokens as every expert on the device."""
    from strata_jax.testing import smollm2_path
    from strata_jax.testing.upcycle import upcycle

    path = upcycle(smollm2_path(), tmp_path / "smollm2-8x2.gguf", experts=8, top_k=2)
    base = dict(parallel=1, max_context=32, prefill=16, warmup=False, weights="blocks")
    with Engine.from_gguf(path, EngineConfig(**base)) as eng:
        assert eng.stats()["experts"].get("all_on_device") == 1
        ids = eng.prompt_ids("The capital of France is")
        ref_logits = eng.logits(ids)
        ref_tokens = []                      # greedy by whole-prompt logits: one program (a 16-token layout)
        for _ in range(3):
            ref_tokens.append(int(np.argmax(eng.logits(ids + ref_tokens)[-1])))
    with Engine.from_gguf(path, EngineConfig(**base, expert_cache=2)) as eng:
        logits = eng.logits(ids)
        tokens = eng.generate(ids, max_tokens=3).tokens
        st = eng.stats()["experts"]
    assert st["device_slots"] == 2
    assert np.array_equal(logits, ref_logits) and tokens == ref_tokens
    assert st["hits"] > 0 and st["evictions"] > 0
