"""Expert tiers: a device cache of a few expert slots a layer (layer-stepped windows) gives the same
logits, bit for bit, and the same greedy tokens as every expert on the device; the host tier in RAM
and the file tier behind it; the eviction policies; the counters and Strata's log lines."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.engine.execute.placement import largest_window_temp_bytes
from strata_jax.engine.execute.programs import MIN_PROGRAM_BYTES
from strata_jax.experts import ExpertCounters
from strata_jax.experts.policy import FreqLRUPolicy, LRUPolicy, make_policy

MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}
QWEN2MOE = dict(MOE, arch="qwen2moe", shared_ffn=48)
# the arena itself, every window layer by layer (the one-program window has tests of its own)
BASE = {"parallel": 2, "max_context": 64, "prefill": 16, "warmup": False, "host_experts": "off",
        "layer_step": "always"}


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
            # the shared expert runs in the experts stage
            assert eng.runner.stepper.moe_p[0] is not None
        got = eng.logits(_prompts()[0])
        # same kernels, same order: the same bits
        assert np.array_equal(got, logits)
        with caplog.at_level(logging.INFO, logger="strata_jax.engine"):
            assert _answers(eng, _prompts()) == answers
        st = eng.stats()["experts"]
        _check_counters(st, 3)
        # prompt chunks chose more than 3 experts a layer
        assert st["passes"] > 0
        assert st["misses_file"] == 0 and st["resident_experts"] == 16
        programs = eng.stats()["programs"]["layouts"]
        assert any("attn" in lay for lay in programs) and any("experts" in lay for lay in programs)
        # uniform layers: one program a stage, under the plain stage names (no "attn.1" kinds)
        assert _stages(eng) == ["embed", "attn", "experts", "head"]
        assert ({lay.stage for lay in eng.runner.programs.programs}
                == {"embed", "attn", "experts", "head"})
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("decode expert cache hit rate: ") and "lookups" in line
               for line in lines)
    assert any(line.startswith("resident RAM: ") and "blob reads from the file" in line
               for line in lines)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_host_experts_give_the_same_bits_as_arena_experts(reference, arch):
    """--host-experts on (the CPU default, auto): a layer whose experts miss the device cache
    computes them from the host tier's blocks (the GGUF file's own pages) with the same kernel: the
    logits and answers are the bits of every expert on the device and of the arena, and nothing is
    copied into the arena."""
    path, logits, answers = reference[arch]
    base = dict(BASE, host_experts="on")
    with Engine.from_gguf(path, EngineConfig(**base, expert_cache=3)) as eng:
        assert eng.runner.expert_mode == "arena" and eng.runner.stepper.host_trees is not None
        assert np.array_equal(eng.logits(_prompts()[0]), logits)
        assert _answers(eng, _prompts()) == answers
        st = eng.stats()["experts"]
        assert "hexperts" in _stages(eng)
    assert st["host_computed"] > 0 and st["host_layers"] > 0
    assert st["lookups"] == st["hits"] + st["host_computed"] + st["misses_host"] + st["misses_file"]
    # misses go to free slots only, never evict
    assert st["evictions"] == 0
    # the 3 slots a layer filled once, then hit
    assert st["exchanged"] <= 3 * 2 and st["hits"] > 0
    with Engine.from_gguf(path,
                          EngineConfig(**dict(BASE, host_experts="auto"), expert_cache=3)) as eng:
        # auto on a CPU device: on (runner._host_experts)
        assert eng.runner.stepper.host_trees is not None


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_one_program_windows_give_the_same_bits_and_counts(reference, arch):
    """--layer-step auto (stepped.py, resident_window): with host experts every window runs as ONE
    program (a layer with a miss computes from the host blocks inside it), with the bits of every
    expert on the device and the same expert counters as the same windows layer by layer. Without
    host experts, an arena that holds every expert runs one program a window once its windows stop
    missing; a window tried as one program that meets a miss after all is run again layer by layer
    (counted in `redone`), same bits."""
    path, logits, answers = reference[arch]
    stats = {}
    for step in ("auto", "always"):
        with Engine.from_gguf(path, EngineConfig(**dict(BASE, host_experts="on", layer_step=step),
                                                 expert_cache=3)) as eng:
            assert np.array_equal(eng.logits(_prompts()[0]), logits)
            assert _answers(eng, _prompts()) == answers
            st = stats[step] = eng.stats()["experts"]
            stages = {lay.stage for lay in eng.runner.programs.programs}
        assert (("resident" in stages) == (step == "auto")
                and ("attn" in stages) == (step == "always"))
    windows = stats["always"].pop("one_program")
    assert windows == 0 and stats["auto"].pop("one_program") > 10 and stats["auto"]["redone"] == 0
    # as served: the warm-up builds the one program of each base layout, windows narrow until theirs
    # is built
    with Engine.from_gguf(path, EngineConfig(**dict(BASE, host_experts="on", layer_step="auto",
                                                    warmup=True), expert_cache=3)) as eng:
        assert (_answers(eng, _prompts()) == answers
                and np.array_equal(eng.logits(_prompts()[0]), logits))
        assert {lay.stage for lay in eng.runner.programs.programs} == {"resident"}
    for st in stats.values():
        st.pop("copy_seconds")                                  # a time, not a count
    # the same lookups, hits, host layers, fills
    assert stats["auto"] == stats["always"]
    redone = []
    for slots in (8, 7):
        with Engine.from_gguf(path, EngineConfig(**dict(BASE, layer_step="auto"),
                                                 expert_cache=slots)) as eng:
            assert np.array_equal(eng.logits(_prompts()[0]), logits)
            assert _answers(eng, _prompts()) == answers
            st = eng.stats()["experts"]
        assert (st["one_program"] > 0
                and st["lookups"] == st["hits"] + st["misses_host"] + st["misses_file"])
        # 8 slots hold every expert: each copied in once, never evicted; 7 slots evict
        assert ((st["evictions"] == 0) == (slots == 8)
                and st["exchanged"] == st["misses_host"] + st["misses_file"])
        redone.append(st["redone"])
    # some window tried as one program met a miss and was stepped again
    assert sum(redone) > 0


def test_host_experts_on_where_they_cannot_run_is_a_clear_error(reference):
    path = reference["qwen3moe"][0]
    with pytest.raises(Exception, match="host_experts = on: .*cpu backend with weights = blocks"):
        Engine.from_gguf(path, EngineConfig(**dict(BASE, host_experts="on", weights="dequantized"),
                                            expert_cache=3))


def test_host_experts_are_packed_unless_a_ram_budget_keeps_them_in_the_file(reference):
    """Every expert in host RAM (no --resident-budget-gib) and packed weights (the int8 default):
    the host tier's experts, which the one-program window reads a layer's misses from, are packed
    (cpu/packed.h), so a miss is read as fast as a hit, with the same bits; under a RAM budget (the
    rest in the file) they stay GGUF blocks, and the layers the budget holds whole are one copy in
    RAM that the host path reads too (not the file's pages again); with --weights blocks the file's
    pages."""
    from pallas_kernels import PACKED_SUFFIX

    path, logits, answers = reference["qwen3moe"]
    all_in_ram = 100 * _one_expert_bytes(path) / (1 << 30)
    # (settings, packed, the host path reads the tier's RAM copy)
    for extra, packed, shared in (({}, True, True),
                                  ({"resident_budget_gib": all_in_ram}, False, True),
                                  ({"weights": "blocks"}, False, False)):
        cfg = EngineConfig(**dict(BASE, host_experts="on", layer_step="auto", **extra),
                           expert_cache=3)
        with Engine.from_gguf(path, cfg) as eng:
            trees = eng.runner.stepper.host_trees
            kinds = {w.qtype.endswith(PACKED_SUFFIX) for ts in trees.values() for w in ts.values()}
            assert kinds == {packed}, extra
            layer = next(iter(trees))
            held = eng.runner.stepper.arena.host.resident[(layer, 0)]["exp_gate"]
            # packed, or a layer the budget holds whole: the host tier's RAM copy is a view of what
            # the host path reads (one copy in all)
            assert (np.shares_memory(held, np.asarray(trees[layer]["exp_gate"].data))
                    == shared), extra
            assert np.array_equal(eng.logits(_prompts()[0]), logits)
            assert _answers(eng, _prompts()) == answers
            assert eng.stats()["experts"]["one_program"] > 0


def test_experts_off_a_64_byte_boundary_are_not_copied_by_the_host_path(tmp_path, monkeypatch,
                                                                         caplog):
    """GGUF aligns tensors to 32 bytes, and XLA's CPU runtime uses a host array in place only at 64:
    the host path, which reads the layers RAM does not hold from the file's map, would hold such
    experts as a copy in RAM (a 36 GiB file was OOM-killed so). With host experts on auto they are
    turned off (misses read into the device cache: the same tokens), --host-experts on is a
    ConfigError naming the bytes, and the start check counts the copies every expert on the device
    would make. make-model writes 64-byte alignment, where none of this happens."""
    import strata_jax.gguf.writer as mw
    import strata_jax.makers.make_model as mm
    from strata_jax.config import ConfigError
    from strata_jax.engine.choices import resolve
    from strata_jax.engine.runner import _host_needs
    from strata_jax.gguf import GGUFModel
    from strata_jax.model.weights import in_place

    opts = dict(MOE, experts=5, expert_ffn=8)           # sizes that leave ffn_up_exps off 64
    aligned = mm.make_model(tmp_path / "a" / "m.gguf", **opts)[0]
    monkeypatch.setattr(mw, "ALIGNMENT", 32)
    off = mm.make_model(tmp_path / "b" / "m.gguf", **opts)[0]
    assert all(in_place(t.data) for t in GGUFModel.open(aligned).tensors.values())
    model = GGUFModel.open(off)
    unaligned = {n: t.n_bytes for n, t in model.tensors.items() if not in_place(t.data)}
    assert any("_exps." in n for n in unaligned), unaligned
    with Engine.from_gguf(off, EngineConfig(**dict(BASE, weights="blocks"))) as eng:
        answers = _answers(eng, _prompts())
    tiers = dict(BASE, weights="blocks", host_experts="auto", layer_step="auto")
    with Engine.from_gguf(aligned, EngineConfig(**tiers, expert_cache=2)) as eng:
        assert eng.runner.stepper.host_trees is not None       # in place: the host path reads it
    with (caplog.at_level(logging.WARNING, logger="strata_jax.engine"),
          Engine.from_gguf(off, EngineConfig(**tiers, expert_cache=2)) as eng):
        assert eng.runner.stepper.host_trees is None
        assert _answers(eng, _prompts()) == answers
    assert "host experts off" in caplog.text and "64-byte boundary" in caplog.text
    with pytest.raises(ConfigError, match=r"host_experts = on: [\d,]+ B \(0\.00 GiB\) of the "
                                          "file's experts do not start at a 64-byte boundary"):
        Engine.from_gguf(off, EngineConfig(**dict(tiers, host_experts="on"), expert_cache=2))

    def copies(path, **cfg) -> int:
        m, c = GGUFModel.open(path), EngineConfig(**dict(BASE, weights="blocks"), **cfg)
        items = _host_needs(m, c, resolve(c, m), np.float32, 64, 64, 0).items
        return next(n for k, n in items.items() if "64-byte boundary" in k)
    assert copies(off) == sum(unaligned.values()) and copies(aligned) == 0
    assert copies(off, expert_cache=2) == sum(n for k, n in unaligned.items() if "_exps." not in k)


def _stages(eng) -> list[str]:
    """The stage names of the programs a decode window of 2 rows runs (ModelRunner.warmup builds
    these)."""
    from strata_jax.engine.execute.programs import Layout

    return [lay.stage for lay in eng.runner.stepper.stage_layouts(Layout(((2, 1, False, 0),), 16))]


def test_file_tier_serves_what_ram_does_not_hold(reference):
    path, _logits, answers = reference["qwen3moe"]
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
    """With a device-memory budget below weights + KV + every expert, auto picks a device cache that
    fits, and the logits stay the same bits."""
    # 13 MiB of Q-blocks experts: half of them is more than the 4 MiB the engine keeps for programs
    path = tiny_model(**dict(MOE, hidden=128, experts=16, expert_ffn=1024))
    with Engine.from_gguf(path, EngineConfig(**BASE)) as eng:
        assert eng.runner.expert_mode == "device"
        mem = eng.stats()["memory"]
        r = eng.runner
        room = max(largest_window_temp_bytes(r.spec, r.cfg, r.choices, r.opts, r.cache_len,
                                             r.device_len),
                   16 * MIN_PROGRAM_BYTES)
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
    # plain LRU drops the hot expert: least recent
    assert lru.victim(resident, set(), 8) == 0
    # frequency-aware: the one-off, least recent of equals
    assert freq.victim(resident, set(), 8) == 1
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
    assert c.hit_line().startswith("decode expert cache hit rate: 57.9% (271 hits / 468 lookups); "
                                   "197 more read")
    total = ExpertCounters()
    total.add(c)
    total.add(c)
    assert total.as_dict()["decode_hits"] == 542
    tiers = ExpertCounters(lookups=480, hits=271, misses_host=12, misses_file=197,
                           file_reads=197, file_bytes=197 * 4 << 20)
    assert tiers.tier_line(16) == ("expert tiers: 480 lookups: 271 device hits, 12 copied from "
                                   "host RAM, 197 from the file, 0 computed on the host; 197 file "
                                   "reads, 788.0 MiB (49.2 MiB a token)")


def test_upcycled_smollm2_device_cache(tmp_path):
    """A real model (SmolLM2 upcycled to 8 experts, top-2) through 2 expert slots a layer, experts
    in GGUF blocks: the same logits, bit for bit, and the same greedy tokens as every expert on the
    device."""
    from strata_jax.fetch import smollm2_path
    from strata_jax.makers.upcycle import upcycle

    path = upcycle(smollm2_path(), tmp_path / "smollm2-8x2.gguf", experts=8, top_k=2)
    base = {"parallel": 1, "max_context": 32, "prefill": 16, "warmup": False, "weights": "blocks",
            "host_experts": "off"}
    with Engine.from_gguf(path, EngineConfig(**base)) as eng:
        assert eng.stats()["experts"].get("all_on_device") == 1
        ids = eng.prompt_ids("The capital of France is")
        ref_logits = eng.logits(ids)
        # greedy by whole-prompt logits: one program (a 16-token layout)
        ref_tokens = []
        for _ in range(3):
            ref_tokens.append(int(np.argmax(eng.logits(ids + ref_tokens)[-1])))
    with Engine.from_gguf(path, EngineConfig(**base, expert_cache=2)) as eng:
        logits = eng.logits(ids)
        tokens = eng.generate(ids, max_tokens=3).tokens
        st = eng.stats()["experts"]
    assert st["device_slots"] == 2
    assert np.array_equal(logits, ref_logits) and tokens == ref_tokens
    assert st["hits"] > 0 and st["evictions"] > 0


def test_expert_policy_is_a_setting():
    import argparse

    from strata_jax.cli_flags import add_engine_flags, engine_config
    from strata_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"expert_policy = 'lfu': must be one of freq, lru"):
        EngineConfig(expert_policy="lfu")
    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    cfg = engine_config(ap.parse_args(["--expert-policy", "lru", "--expert-prefetch"]))
    assert cfg.expert_policy == "lru" and cfg.expert_prefetch is True
    assert EngineConfig().expert_policy == "freq"


def _profile_traffic(eng):
    eng.logits(_prompts()[0])
    return _answers(eng, _prompts())


def test_expert_profile_written_read_back_and_pinned(reference, tmp_path):
    """The profile counts the same routing in both modes (one program with every expert on the
    device, and layer-stepped windows); read back at start, it pins each layer's hottest experts,
    which are there before the first request and never leave, and the tokens do not change."""
    import json

    from strata_jax.experts.profile import ExpertProfile, pins_for

    path, _, answers = reference["qwen3moe"]
    with Engine.from_gguf(path, EngineConfig(**BASE)) as eng:
        assert _profile_traffic(eng) == answers
        saved = eng.save_expert_profile(tmp_path / "device.json")
    with Engine.from_gguf(path, EngineConfig(**BASE, expert_cache=3)) as eng:
        assert _profile_traffic(eng) == answers
        eng.save_expert_profile(tmp_path / "arena.json")
        routed = eng.stats()["experts"]["routed"]
    device, arena = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("device", "arena"))
    assert device["counts"] == arena["counts"]            # the same routing, counted in both modes
    assert saved["routed"] == device["routed"] == routed > 0
    assert device["n_experts"] == 8 and set(device["counts"]) == {"0", "1"}
    prof = ExpertProfile.load(tmp_path / "device.json", GGUFModel_spec(path))
    hot = {i: prof.hottest(i, pins_for(4)) for i in (0, 1)}
    assert all(len(h) == 3 for h in hot.values())
    cfg = EngineConfig(**BASE, expert_cache=4, expert_profile=str(tmp_path / "device.json"))
    with Engine.from_gguf(path, cfg) as eng:
        arena_ = eng.runner.stepper.arena
        assert ({i: sorted(arena_.pinned[i]) for i in (0, 1)}
                == {i: sorted(h) for i, h in hot.items()})
        # resident before any request
        assert all(arena_.slot_of[i][e] >= 0 for i in (0, 1) for e in hot[i])
        slots = {i: [int(arena_.slot_of[i][e]) for e in hot[i]] for i in (0, 1)}
        assert _answers(eng, _prompts()) == answers
        st = eng.stats()["experts"]
        # the free slot turned over ...
        assert st["pinned"] == 6 and st["evictions"] > 0
        # ... the pins did not
        assert {i: [int(arena_.slot_of[i][e]) for e in hot[i]] for i in (0, 1)} == slots


def GGUFModel_spec(path):
    from strata_jax.gguf import GGUFModel

    return GGUFModel.open(path).spec


def test_bad_expert_profile_is_a_clear_error(reference, tmp_path):
    import json

    from strata_jax.experts.profile import ExpertProfile, ExpertProfileError

    path = reference["qwen3moe"][0]
    spec = GGUFModel_spec(path)
    good = ExpertProfile(spec).to_json()
    cases = {
        "missing.json": (None, "cannot be read"),
        "broken.json": ("{not json", "is not valid JSON"),
        "other.json": ({"hello": 1}, "is not an expert profile"),
        "experts.json": ({**good, "n_experts": 16, "counts": {"0": [0] * 16, "1": [0] * 16}},
                         "was made on a model with 16 experts a layer; this model .* has 8"),
        "layers.json": ({**good, "counts": {str(i): [0] * 8 for i in range(4)}},
                        "counts MoE layers 0..3 .4.; this"),
        "row.json": ({**good, "counts": {"0": [0] * 8, "1": [1, -2] + [0] * 6}},
                     "layer 1's counts must be 8 whole"),
    }
    for name, (body, message) in cases.items():
        f = tmp_path / name
        if body is not None:
            f.write_text(body if isinstance(body, str) else json.dumps(body))
        with pytest.raises(ExpertProfileError, match=f"expert profile {f}: {message}"):
            ExpertProfile.load(f, spec)
    for cache in ("auto", 3):            # the engine refuses it at start, in both modes
        cfg = EngineConfig(**BASE, expert_cache=cache,
                           expert_profile=str(tmp_path / "experts.json"))
        with pytest.raises(ExpertProfileError, match="experts.json: was made on a model with 16"):
            Engine.from_gguf(path, cfg)


def test_prefetch_changes_where_experts_come_from_not_the_bits(reference):
    path, logits, answers = reference["qwen2moe"]
    with Engine.from_gguf(path, EngineConfig(**BASE, expert_cache=4, expert_prefetch=True)) as eng:
        assert np.array_equal(eng.logits(_prompts()[0]), logits)
        assert _answers(eng, _prompts()) == answers
        st = eng.stats()["experts"]
        assert st["prefetch"] == 1 and st["prefetched"] > 0
        assert 0 < st["prefetch_hits"] <= st["hits"]
        assert st["lookups"] == st["hits"] + st["misses_host"] + st["misses_file"]
        assert any("predict" in lay for lay in eng.stats()["programs"]["layouts"])
    # The same traffic through a cache of every expert, traced, then replayed with 4 slots: the
    # replay's counters are the ones the 4-slot engine reported (bench/sweep.py's hit rates come
    # from replays).
    from strata_jax.experts.replay import replay

    with Engine.from_gguf(path, EngineConfig(**BASE, expert_cache=8, expert_prefetch=True)) as eng:
        eng.runner.stepper.trace = trace = []
        eng.logits(_prompts()[0])
        assert _answers(eng, _prompts()) == answers
    got = replay(trace, [0, 1], 8, 4, "freq", prefetch=True).as_dict()
    for name in ("lookups", "hits", "decode_lookups", "decode_hits", "evictions", "passes",
                 "prefetched", "prefetch_hits", "routed"):
        assert got[name] == st[name], name


def test_server_writes_the_expert_profile(reference, tmp_path):
    """POST /expert-profile {"name"} on a real server process: the engine process writes NAME.json
    in the server's --expert-profile-dir; a body that is not {"name"} is a 400 naming the field; the
    written file starts a new engine with pinned experts. (Bad names, modes, other routes:
    tests/test_server_safety.py.)"""
    import json

    import httpx

    from strata_jax.serve.launch import ServerProcess

    path = reference["qwen3moe"][0]
    out = tmp_path / "profiles" / "served.json"
    with ServerProcess([str(path), "--parallel", "1", "--max-context", "64", "--no-warmup",
                        "--expert-profile-dir", str(tmp_path / "profiles")]) as srv:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 4},
                       timeout=120)
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/expert-profile", json={"name": "served"}, timeout=60)
        assert r.status_code == 200, r.text
        assert (r.json()["name"] == "served" and r.json()["path"] == "served.json"
                and r.json()["routed"] > 0)
        bad = httpx.post(srv.url + "/expert-profile", json={"file": "x"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "file"
        named = httpx.post(srv.url + "/expert-profile", json={"path": str(tmp_path / "x.json")},
                           timeout=60)
        assert named.status_code == 400 and named.json()["error"]["param"] == "path"
        assert not (tmp_path / "x.json").exists()
    data = json.loads(out.read_text())
    assert data["routed"] == r.json()["routed"] == sum(map(sum, data["counts"].values()))
    cfg = EngineConfig(**BASE, expert_cache=4, expert_profile=str(out))
    with Engine.from_gguf(path, cfg) as eng:
        assert eng.stats()["experts"]["pinned"] > 0


def test_dense_layers_among_moe_layers(tiny_model, tmp_path):
    """A glm4moe model whose first layer is dense (as GLM-4.5's are): the dense layer runs attention
    and FFN in a stage of its own; the device cache (with prefetch) gives the same bits as every
    expert on the device, and the profile counts only the MoE layers."""
    import json

    # GLM-4.5: sigmoid router, bias
    path = tiny_model(**dict(MOE, arch="glm4moe", layers=3, leading_dense=1))
    spec = GGUFModel_spec(path)
    assert spec.moe_layers == (1, 2) and spec.dense_layers == (0,)
    with Engine.from_gguf(path, EngineConfig(**BASE)) as eng:
        logits = eng.logits(_prompts()[0])
        answers = _answers(eng, _prompts())
    with Engine.from_gguf(path, EngineConfig(**BASE, expert_cache=3, expert_prefetch=True)) as eng:
        assert eng.runner.stepper.arena.layers == [1, 2]
        assert np.array_equal(eng.logits(_prompts()[0]), logits)
        assert _answers(eng, _prompts()) == answers
        assert any("dense" in lay for lay in eng.stats()["programs"]["layouts"])
        assert _stages(eng) == ["embed", "attn", "experts", "head", "predict", "dense"]
        eng.save_expert_profile(tmp_path / "p.json")
        assert eng.stats()["experts"]["experts_total"] == 16
    assert set(json.loads((tmp_path / "p.json").read_text())["counts"]) == {"1", "2"}


# llama.cpp's Q4_K_M mix: Q4_K, with attn_v and ffn_down_exps Q6_K in the layers it gives more bits
# (2 and 3 of 4). K-quant rows are 256 values, so hidden and expert_ffn are 256.
MIXED = dict(MOE, layers=4, hidden=256, expert_ffn=256, quant="Q4_K", more_bits_quant="Q6_K")


@pytest.mark.parametrize("weights", ["blocks", "dequantized"])
def test_layers_that_mix_quant_types(tiny_model, weights):
    """A Q4_K_M-like file (layers 2 and 3 have Q6_K attn_v and ffn_down_exps) through 2 expert slots
    a layer: a program per kind of layer, an arena whose leaves differ by layer, and the same
    logits, bit for bit, and the same greedy tokens as every expert on the device."""
    from strata_jax.gguf import GGUFModel
    from strata_jax.makers.make_model import use_more_bits

    # llama.cpp's rule at 8 layers
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    path = tiny_model(**MIXED)
    t = GGUFModel.open(path).tensors
    for name in ("attn_v", "ffn_down_exps"):
        assert ([t[f"blk.{i}.{name}.weight"].qtype.name for i in range(4)]
                == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"])
    assert ({t[f"blk.{i}.{n}.weight"].qtype.name for i in range(4)
             for n in ("attn_q", "ffn_up_exps")} == {"Q4_K"})
    one_expert = {i: sum(int(t[f"blk.{i}.ffn_{n}_exps.weight"].data[0].nbytes)
                         for n in ("gate", "up", "down"))
                  for i in range(4)}
    # a Q6_K layer's expert is bigger
    assert one_expert[0] < one_expert[2]

    base = dict(BASE, weights=weights)
    with Engine.from_gguf(path, EngineConfig(**base)) as eng:
        assert eng.runner.expert_mode == "device"
        logits = eng.logits(_prompts()[0])
        answers = _answers(eng, _prompts())
    with Engine.from_gguf(path, EngineConfig(**base, expert_cache=2)) as eng:
        stepper = eng.runner.stepper
        arena = stepper.arena
        stages = _stages(eng)
        # quant types are baked into programs: two kinds of attention and of experts
        if weights == "blocks":
            assert stages == ["embed", "attn", "attn.1", "experts", "experts.1", "head"]
            assert (stepper.kind_of["experts"]
                    == {0: "experts", 1: "experts", 2: "experts.1", 3: "experts.1"})
            assert arena.arena[2]["exp_down"].shape[-1] > arena.arena[0]["exp_down"].shape[-1]
            # 2 slots of each layer's own size
            assert arena.nbytes == 2 * sum(one_expert.values())
        # floats of one shape: one kind, each layer dequantized with its own type
        else:
            assert stages == ["embed", "attn", "experts", "head"]
        assert eng.runner.ledger.snapshot()["experts_bytes"] == arena.nbytes
        assert np.array_equal(eng.logits(_prompts()[0]), logits)
        assert _answers(eng, _prompts()) == answers
        st = eng.stats()["experts"]
        _check_counters(st, 2)
        assert st["resident_bytes"] == 8 * sum(one_expert.values())
        built = {lay.stage for lay in eng.runner.programs.programs}
        assert built == set(stages)                                 # every kind ran


def test_a_file_larger_than_the_memory_limit_gets_expert_tiers_sized_from_it(tiny_model, caplog):
    """--expert-cache auto on a CPU: while the file fits in the memory the engine may use, every
    expert is read in place; when it does not (--memory-limit-gib here, a container's limit or the
    RAM elsewhere), the engine sizes the tiers from what the limit leaves (tier_sizes.py: a quarter
    of it the device cache, a quarter the RAM tier, host experts off), with the same bits. Too
    little room for a token's experts keeps the map, with a warning; tiers the user gave are
    kept."""
    from strata_jax.engine.execute.tier_sizes import file_bytes, slot_bytes_all_layers
    from strata_jax.engine.runner import _host_needs
    from strata_jax.gguf import GGUFModel

    path = tiny_model(**dict(MOE, experts=16, expert_ffn=256))
    model = GGUFModel.open(path)
    experts, dense = file_bytes(model)
    one = slot_bytes_all_layers(model)
    # GGUF blocks in place, not packed: what a model larger than half the RAM gets (choices.py)
    auto = dict(BASE, host_experts="auto", layer_step="auto", weights="blocks")
    with Engine.from_gguf(path, EngineConfig(**auto)) as eng:
        assert eng.runner.expert_mode == "device"
        logits, answers = eng.logits(_prompts()[0]), _answers(eng, _prompts())
        r = eng.runner
        base = _host_needs(model, EngineConfig(**dict(auto, host_experts="off"), expert_cache=0),
                           r.choices, r.kv_dtype,
                           r.device_len, r.cache_len, 0, r.ring).total

    def limit_gib(room: float) -> float:        # the limit that leaves `room` beside the rest
        return (base + dense + room) / (1 << 30)

    room = 0.75 * experts                       # a quarter of it: 3 of the 16 slots a layer
    with (caplog.at_level(logging.INFO, logger="strata_jax.engine"),
          Engine.from_gguf(path, EngineConfig(**auto, memory_limit_gib=limit_gib(room))) as eng):
        cfg = eng.runner.cfg
        assert eng.runner.expert_mode == "arena" and eng.runner.stepper.host_trees is None
        assert cfg.expert_cache == 3 == int(room / 4) // one and cfg.host_experts == "off"
        assert abs(cfg.resident_budget_gib * (1 << 30) - room / 4) < 1024
        assert np.array_equal(eng.logits(_prompts()[0]), logits)
        assert _answers(eng, _prompts()) == answers
    assert "the expert tiers, sized from what is left" in caplog.text
    assert "--expert-cache 3" in caplog.text and "--host-experts off" in caplog.text
    caplog.clear()
    # room for one slot a layer, not the two experts a token reads: the map, and a warning
    with (caplog.at_level(logging.WARNING, logger="strata_jax.engine"),
          Engine.from_gguf(path, EngineConfig(**auto,
                                              memory_limit_gib=limit_gib(5 * one))) as eng):
        assert eng.runner.expert_mode == "device"
    assert "too little is left for an expert cache of 2 slots a layer" in caplog.text
    # the file fits: nothing changes
    with Engine.from_gguf(path, EngineConfig(**auto,
                                             memory_limit_gib=limit_gib(experts + 4096))) as eng:
        assert eng.runner.expert_mode == "device"
    # the user's tiers are kept as given, the host path (auto) with them
    mine = dict(auto, expert_cache=2, resident_budget_gib=2 * one / (1 << 30))
    caplog.clear()
    with (caplog.at_level(logging.INFO, logger="strata_jax.engine"),
          Engine.from_gguf(path, EngineConfig(**mine, memory_limit_gib=limit_gib(room))) as eng):
        assert eng.runner.cfg.expert_cache == 2 and eng.runner.stepper.host_trees is not None
        assert _answers(eng, _prompts()) == answers
    assert "sized from what is left" not in caplog.text
