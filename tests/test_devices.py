"""--devices N over the forced CPU devices of one host: --split experts and --split layers give the
logits and greedy tokens of one device (issue 19). XLA_FLAGS must force the devices before JAX
starts, and this process's JAX already has one, so the checks run in a child
(scripts/multi_device.py) and these tests read its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MOE = {"arch": "qwen3moe", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}
DENSE = {"arch": "llama", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2}
# issue 37's families as make-model writes them. gpt-oss: window 8 on the even layers (0 and 2), so
# each of two stages holds a ring layer and a full one; MXFP4 experts with their biases.
# deepseek2: MLA (the latent cache, no values), a leading dense layer, then 3 MoE layers; no NextN
# block (its KV is the MTP drafter's, which does not combine with the split)
GPT_OSS = {"arch": "gpt-oss", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
           "experts_used": 2, "expert_ffn": 32}
DEEPSEEK2 = {"arch": "deepseek2", "layers": 4, "quant": "F32"}


def child(mode: str, model: Path, spec, devices: int = 4):
    # PYTHONPATH: the child imports this checkout's packages (not an installed copy's)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "multi_device.py"), mode,
                           str(model),
                           json.dumps(spec)], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["results"]


def check_equal(results: list, rows_cut: bool = True) -> None:
    """rows_cut: the layers split cuts a window's rows into its micro-batches (else whole groups
    only: a packed window is one part)."""
    base = results[0]
    assert base["runner"] == {"count": 1, "split": "none"}
    for r in results[1:]:
        assert r["runner"] == {"count": r["devices"], "split": r["split"]}, r
        assert r["bits_equal"], (f"{r['devices']} devices, split {r['split']}: logits differ by "
                                 f"{r['max_diff']}")
        assert r["tokens_equal"], (r, base)
        # the prefix cache's KV moves (read, write, copy) across stages
        assert r["kv_equal"], r
        # a window of two prompts, logits of every token, cut into micro-batches with the layers
        # split
        assert r["cut_bits_equal"], (f"{r['devices']} devices, split {r['split']}: cut window "
                                     f"differs by {r['cut_max_diff']}")
        # auto on CPU devices: 1
        want = r.get("micro_batches", 1) if r["split"] == "layers" and rows_cut else 1
        assert r["parts"] == want, r


# A device-memory budget (vram reserve 0) that holds the weights, the KV and about 3 of the 5
# programs the check meets: each device's program cache runs out and frees its own older half
# (per-device ledgers).
TIGHT = {"experts": {"device_memory_mib": 1.5, "vram_reserve_mib": 0},
         "layers": {"device_memory_mib": 1.0, "vram_reserve_mib": 0, "micro_batches": 4}}


def test_moe_both_splits_give_one_devices_logits(tiny_model):
    results = child("check", tiny_model(**MOE),
                    [[1, "auto"], [2, "experts", TIGHT["experts"]], [4, "experts"],
                                                 [2, "layers", {"micro_batches": 2}],
                                                 [4, "layers", TIGHT["layers"]]])
    check_equal(results)
    # the tight budgets: every device freed its own programs once
    for r in (results[1], results[4]):
        assert len(r["programs"]) == (1 if r["split"] == "experts" else r["devices"]), r["programs"]
        assert all(p["oom_recoveries"] >= 1 and p["live"] <= 3
                   for p in r["programs"]), r["programs"]


def test_the_program_bound_holds_on_each_device(tiny_model):
    results = child("check", tiny_model(**MOE),
                    [[1, "auto"], [4, "layers", {"max_programs": 2, "micro_batches": 4}]])
    check_equal(results)
    assert [p["live"] for p in results[1]["programs"]] == [2, 2, 2, 2]
    assert all(p["evicted"] >= 1 for p in results[1]["programs"])


def test_dense_layers_split_gives_one_devices_logits(tiny_model):
    """auto (on CPU devices: the plain chain of stages), 2 and 4 micro-batches."""
    results = child("check", tiny_model(**DENSE),
                    [[1, "auto"], [2, "layers"], [2, "layers", {"micro_batches": 2}],
                                                   [4, "layers", {"micro_batches": 4}],
                                                   [4, "layers", {"micro_batches": 2}]])
    check_equal(results)


@pytest.mark.parametrize("family", [GPT_OSS, DEEPSEEK2], ids=["gpt-oss", "deepseek2"])
def test_issue37_families_both_splits_give_one_devices_logits(tiny_model, family):
    """gpt-oss (sinks, sliding-window rings, expert and router biases) and deepseek2 (MLA's latent
    cache) over 2 devices, each split, the layers split's windows cut in 2 micro-batches: one
    device's logits and greedy tokens, the prefix cache's KV moves, and for gpt-oss a prompt that
    wraps the rings and a slot's rings (a state checkpoint's) read and written across the stages,
    each stage holding its own ring layer. deepseek2's rows are not cut (its MLA einsums' bits
    depend on the rows multiplied together: runner.py), so its packed window is one part."""
    results = child("check", tiny_model(**family),
                    [[1, "auto"], [2, "experts"], [2, "layers", {"micro_batches": 2}]])
    check_equal(results, rows_cut=family is GPT_OSS)
    for r in results:
        assert r["state_round_trip"], r
        if family is GPT_OSS:
            assert len(r["wrapped"]) == 6, r
            want = [1, 1] if r["split"] == "layers" else [2]
            assert r["state_layers"] == {"k_swa": want, "v_swa": want}, r
        else:
            assert r["wrapped"] == [] and r["state_layers"] == {}, r


def test_layers_split_dispatches_stage_by_stage_without_waiting(tiny_model):
    """A window cut in micro-batches is dispatched stage by stage (both parts on device 0 first) and
    the host does not wait for the devices: parts are still computing when the window's last part is
    dispatched. One part a window (micro_batches 1, the plain chain) never lets a later stage finish
    a part before the earlier stage's last: that control is exact (a data dependence). Whether the
    cut's stages then compute at once is up to the host's cores (on CI's 2 loaded cores, sometimes
    in 0 of 20 windows): a figure for the benchmark (`scripts/multi_device.py overlap`,
    docs/BENCHMARKS.md), not a test. A wider model than the others, so that a part's program
    outlasts dispatching the next (hidden 512)."""
    res = child("overlap", tiny_model(arch="llama", layers=4, hidden=512, heads=8, kv_heads=4),
                [[2, 1], [2, 2]])
    chain, cut = res
    assert chain["order"] == [[0, 0], [1, 0]] and chain["overlapped"] == 0, chain
    # stage-major: both parts on device 0 first
    assert cut["order"] == [[0, 0], [0, 1], [1, 0], [1, 1]], cut
    # the host did not wait for the devices
    assert max(cut["pending_after_dispatch"]) >= 2, cut


def test_a_cut_adds_no_programs_and_keeps_groups_whole_where_rows_are_not_alone():
    """Every part's layout is one the warm-up's set already holds (packed windows, and verify rows
    with --spec), and where rows are not computed alone (XLA's dots) the parts are whole groups."""
    from strata_jax.engine.distributed.micro_batches import cut
    from strata_jax.engine.execute.layouts import WindowLayouts
    from strata_jax.engine.execute.programs import Layout

    packed = WindowLayouts("cpu", 256, 256, 256, 1, True, 4, 0, 16, 64)
    base = set(packed.base())
    for lay in base:
        for m in (2, 3, 4, 8):
            c = cut(lay, m, rows_alone=True)
            assert set(c.parts) <= base, (lay, m, c.parts)
            r = lay.groups[0][0]
            # 3 parts cannot share 2^k rows evenly
            assert len(c.parts) == min(r, m if m != 3 else 2), (lay, m)
    verify = WindowLayouts("cpu", 256, 256, 256, 1, False, 4, 2, 16, 64)
    for lay in verify.base():
        assert set(cut(lay, 2, rows_alone=True).parts) <= set(verify.base()), lay
    grouped = WindowLayouts("xla", 256, 256, 256, 2, False, 4, 0, 16, 64)
    for lay in grouped.base():
        c = cut(lay, 4, rows_alone=False)
        # whole groups, in order
        assert [g for p in c.parts for g in p.groups] == list(lay.groups), lay
        assert set(c.parts) <= set(grouped.base()), lay
    two = Layout(((4, 1, False, 0), (1, 16, False, 0)), 256)
    assert ([p.groups for p in cut(two, 4, rows_alone=False).parts]
            == [((4, 1, False, 0),), ((1, 16, False, 0),)])


def test_what_cannot_split_is_refused_with_the_reason(tiny_model):
    moe, dense = tiny_model(**MOE), tiny_model(**DENSE)
    errs = child("errors", moe,
                 [{"devices": 3, "split": "experts"}, {"devices": 4, "kv_resident": 64},
                                 {"devices": 2, "expert_cache": 4}, {"devices": 8}])
    assert "8 experts do not divide over 3 devices" in errs[0]
    assert "kv_resident = 64" in errs[1]
    assert "expert_cache = 4" in errs[2]
    assert "JAX sees 4 cpu device(s)" in errs[3] and "device_count=8" in errs[3]
    errs = child("errors", dense,
                 [{"devices": 2, "split": "experts"}, {"devices": 4, "split": "layers"}])
    assert "no experts to split" in errs[0]
    assert errs[1] is None                      # 4 layers over 4 devices: one layer a stage


def test_more_devices_than_jax_sees_names_the_count_and_the_flag(tiny_model):
    with pytest.raises(ConfigError, match=r"devices = 4: JAX sees 1 cpu device\(s\).*"
                                          r"XLA_FLAGS=--xla_force_host_platform_device_count=4"):
        Engine.from_gguf(tiny_model(**MOE), EngineConfig(devices=4, warmup=False))


@pytest.mark.parametrize("bad", [{"devices": 0}, {"devices": "2"}, {"split": "rows"}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        EngineConfig(**bad)


def test_cpu_kernels_called_from_every_device_thread_at_once_give_the_same_bits():
    """The kernels' own spin pool takes one caller at a time (the others run their rows alone): four
    device threads multiplying at once, 300 times, neither deadlock nor change a bit."""
    pk = pytest.importorskip("pallas_kernels")
    if not pk.cpu.available():
        pytest.skip("the cpu kernels were not built")
    res = child("kernels", Path("-"), 300)
    assert res["devices"] == 4 and res["bits_equal"], res
