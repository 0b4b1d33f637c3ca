"""--kv-resident N: a slot's KV past its first N positions lives in host RAM, and attention brings
it in block by block. Logits, greedy tokens and the KV itself are the same bits as with all KV on
the device; the device holds parallel x N positions, so a context the device could not hold for
every slot is served. Small N (32) and a small attention chunk (16) keep it cheap."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.config import ConfigError

LLAMA = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 0}
BASE = {"parallel": 2, "max_context": 128, "attn_chunk": 16, "prefill": 32, "warmup": False}
N = 32


def _ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model(**LLAMA)


@pytest.fixture(scope="module")
def engines(path):
    """(all KV on the device, KV past 32 positions in host RAM), f32 KV."""
    on_device = Engine.from_gguf(path, EngineConfig(**BASE))
    offload = Engine.from_gguf(path, EngineConfig(**BASE, kv_resident=N))
    yield on_device, offload
    on_device.close()
    offload.close()


def test_logits_equal_all_on_device(engines):
    on_device, offload = engines
    ids = _ids(100, 0)                          # read in windows of 32: three of them reach past N
    before = offload.stats()["kv_cache"]["host_kv_fetches"]
    ref, got = on_device.logits(ids), offload.logits(ids)
    assert np.array_equal(ref, got)
    kv = offload.stats()["kv_cache"]
    assert kv["device_positions"] == N and kv["host_kv_fetches"] > before
    assert offload.stats()["memory"]["kv_bytes"] * 3 < on_device.stats()["memory"]["kv_bytes"]


def test_two_slots_generate_the_same_tokens_and_kv(engines):
    """Two requests at once (one starts below N and crosses it while decoding, one's prompt is past
    N already: windows mix rows on both sides of N); the same tokens, and each slot's KV (device
    part + host part) equals the all-on-device cache bit for bit."""
    prompts = [_ids(20, 1), _ids(45, 2)]
    out = []
    for eng in engines:
        hs = [eng.submit(p, max_tokens=40, ignore_eos=True) for p in prompts]
        out.append([[ev.token for ev in h if ev.kind == "token"] for h in hs])
    assert out[0] == out[1]
    assert all(len(t) == 40 for t in out[0])
    on_device, offload = engines
    for slot, p in enumerate(prompts):
        n = len(p) + 40 - 1                     # the last token is never written
        ref, got = on_device.runner.slot_kv(slot, n), offload.runner.slot_kv(slot, n)
        assert set(ref) == set(got) == {"k", "v"}
        for name in ref:
            assert np.array_equal(ref[name], got[name]), name
            assert np.abs(got[name][:, N:]).sum() > 0          # the host part is really there
    assert offload.stats()["kv_cache"]["host_kv_bytes"] > 0


def test_generate_through_windows(engines):
    on_device, offload = engines
    ids = _ids(50, 3)
    a = on_device.generate(ids, max_tokens=30, ignore_eos=True).tokens
    b = offload.generate(ids, max_tokens=30, ignore_eos=True).tokens
    assert a == b and len(a) == 30


def test_int8_logits_equal_all_on_device(path):
    """int8 KV: the host part keeps the int8 values and their scales."""
    ids = _ids(70, 4)
    res = []
    for n in (None, N):
        with Engine.from_gguf(path, EngineConfig(**{**BASE, "parallel": 1}, kv="int8",
                                                 kv_resident=n)) as eng:
            res.append(eng.logits(ids))
            if n:
                assert eng.runner.kv_host.names == ("k", "v", "k_scale", "v_scale")
    assert np.array_equal(res[0], res[1])


def test_a_context_the_device_cannot_hold(path, engines):
    """--device-memory-mib below what parallel x max_context of KV needs: without --kv-resident the
    engine cannot start; with it, it starts and serves past N with the all-on-device tokens."""
    on_device, _ = engines
    big = dict(BASE, max_context=8192, vram_reserve_mib=0)
    probe = Engine.from_gguf(path, EngineConfig(**big, kv_resident=N))
    mem = probe.stats()["memory"]
    probe.close()
    # the same slots with every position on the device
    full_kv = mem["kv_bytes"] // (N + 1) * (8192 + 1)
    budget = (mem["weights_bytes"] + full_kv // 2) / 2**20
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED.*KV cache"):
        Engine.from_gguf(path, EngineConfig(**big, device_memory_mib=budget))
    with Engine.from_gguf(path,
                          EngineConfig(**big, kv_resident=N, device_memory_mib=budget)) as eng:
        ids = _ids(60, 5)
        got = eng.generate(ids, max_tokens=20, ignore_eos=True).tokens
        assert got == on_device.generate(ids, max_tokens=20, ignore_eos=True).tokens
        s = eng.stats()
        assert s["failed"] == 0 and s["kv_cache"]["host_kv_fetches"] > 0
        assert s["memory"]["kv_bytes"] < full_kv // 100


def test_bad_kv_resident_names_the_chunk():
    with pytest.raises(ConfigError, match=r"kv_resident = 40: must be a multiple of the attention "
                                          r"chunk, 16 keys"):
        EngineConfig(max_context=128, attn_chunk=16, kv_resident=40)
    with pytest.raises(ConfigError, match=r"kv_resident = 1000: .* 256 keys .* try 768"):
        EngineConfig(max_context=4096, kv_resident=1000)
    with pytest.raises(ConfigError, match="attn_chunk = 24"):
        EngineConfig(attn_chunk=24)
    with pytest.raises(ConfigError, match="kv_resident = 8"):
        EngineConfig(kv_resident=8)


def test_cli_flags():
    import argparse

    from strata_jax.cli_flags import add_engine_flags, engine_config

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    cfg = engine_config(p.parse_args(["--max-context", "131072", "--kv-resident", "32768",
                                      "--attn-chunk", "256"]))
    assert (cfg.max_context, cfg.kv_resident, cfg.attention_chunk()) == (131072, 32768, 256)


def test_host_store_pages_and_ends():
    """The numpy store alone: put/read across pages, fetch zeros past a row's end, int8 with
    scales."""
    from types import SimpleNamespace

    from strata_jax.engine.execute.kv_host import KVHostStore

    spec = SimpleNamespace(n_layers=2, n_kv_heads=2, head_dim=4, value_dim=4)
    store = KVHostStore(spec, resident=32, cache_len=32 + 16 * 16 * 3, chunk=16, kv_dtype=np.int8)
    assert store.names == ("k", "v", "k_scale", "v_scale") and store.page == 256
    rng = np.random.default_rng(0)
    n = 300                                                     # positions 32..331: two pages
    entries = {"k": rng.integers(-127, 127, (2, n, 2, 4)).astype(np.int8),
               "v": rng.integers(-127, 127, (2, n, 2, 4)).astype(np.int8),
               "k_scale": rng.random((2, n, 2), np.float32),
               "v_scale": rng.random((2, n, 2), np.float32)}
    store.put(1, 32, entries)
    back = store.read(1, 32, 32 + n)
    assert all(np.array_equal(back[k], entries[k]) for k in entries)
    # pos -1: not stored
    nothing_new = [np.zeros((3, 1, *a.shape[2:]), a.dtype) for a in entries.values()]
    k, _, ks, _ = store.fetch(64, 1, np.array([1, 1, 0]), np.array([32 + n, 300, 0]), 272,
                              np.full((3, 1), -1, np.int32), *nothing_new)
    # across two pages, to the last written
    assert np.array_equal(k[0, :60], entries["k"][1, 240:300])
    assert np.array_equal(ks[0, :60], entries["k_scale"][1, 240:300]) and not k[0, 60:].any()
    # stops at its end
    assert np.array_equal(k[1, :28], entries["k"][1, 240:268]) and not k[1, 28:].any()
    # a padding row: nothing copied
    assert not k[2].any()
    with pytest.raises(IndexError, match="past the slot's context"):
        store.put(0, 32 + 16 * 16 * 3, {name: a[:, :1] for name, a in entries.items()})
    assert store.block(rows=2, n_positions=96, chunk=16) in (16, 32, 48, 96)


def test_expert_tiers_with_kv_resident(tiny_model):
    """Layer-stepped windows (experts in a small device cache) take the host store too: the same
    logits as one program with every expert and all KV on the device."""
    path = tiny_model(arch="qwen3moe", layers=2, hidden=64, heads=4, kv_heads=2, experts=8,
                      experts_used=2, expert_ffn=32)
    ids = _ids(70, 6)
    cfg = dict(BASE, parallel=1)
    with Engine.from_gguf(path, EngineConfig(**cfg)) as eng:
        ref = eng.logits(ids)
    with Engine.from_gguf(path, EngineConfig(**cfg, expert_cache=3, kv_resident=N)) as eng:
        assert eng.runner.expert_mode == "arena"
        got = eng.logits(ids)
        assert eng.stats()["kv_cache"]["host_kv_fetches"] > 0
    assert np.array_equal(ref, got)


def test_prefix_reuse_across_the_host_part(path, engines):
    """A slot's kept KV includes its host part (a second turn reuses it), and the conversation cache
    stores and restores blocks that straddle N (blocks of 32 tokens, N = 48): the all-on-device
    tokens."""
    on_device, _ = engines
    cfg = EngineConfig(**dict(BASE, max_context=2048), kv_resident=48, conversation_cache_mib=1)
    rng = np.random.default_rng(7)
    with Engine.from_gguf(path, cfg) as eng:
        assert eng.prefix.block == 32
        p1 = _ids(45, 8)
        a1 = eng.generate(p1, max_tokens=6, ignore_eos=True)
        p2 = p1 + a1.tokens + _ids(10, 9)
        a2 = eng.generate(p2, max_tokens=6, ignore_eos=True)
        # past N: from the host part
        assert a2.stats["reused_tokens"] == len(p1) + 6 - 1
        assert a2.tokens == on_device.generate(p2, max_tokens=6, ignore_eos=True).tokens
        # both slots taken: stored to host RAM
        for _ in range(2):
            eng.generate([int(t) for t in rng.integers(3, 500, 20)], max_tokens=2, ignore_eos=True)
        p3 = p2 + a2.tokens + _ids(5, 10)
        a3 = eng.generate(p3, max_tokens=6, ignore_eos=True)
        # blocks [0, 32) and [32, 64), across N
        assert a3.stats["reused_tokens"] == 64
        assert eng.stats()["prefix_cache"]["conversation_cache"]["restored_tokens"] >= 64
        assert a3.tokens == on_device.generate(p3, max_tokens=6, ignore_eos=True).tokens
