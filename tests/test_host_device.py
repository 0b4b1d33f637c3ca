"""Experts computed where they live beside another device ("remote" host experts,
experts/hybrid.py): a process with two forced CPU devices runs the engine on cpu:0 and computes each
layer's missed experts on cpu:1 from the host tier's blocks, as it would beside a GPU. The same
kernel on the same blocks: the same logits bits and greedy tokens as copying every miss into the
device cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from strata_jax import EngineConfig
from strata_jax.config import ConfigError
from strata_jax.experts.hybrid import HostRule

MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}

CHILD = r"""
import json, sys
import numpy as np
import jax
from strata_jax import Engine, EngineConfig
path, out = sys.argv[1], sys.argv[2]
assert len(jax.devices("cpu")) == 2, jax.devices()
BASE = dict(parallel=2, max_context=64, prefill=16, warmup=False, expert_cache=3)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (21, 6)]
res = {}
for name, kw in (("arena", dict(host_experts="off")), ("remote", dict(host_experts="on", host_device="cpu:1")),
                 ("auto", dict(host_device="cpu:1"))):
    with Engine.from_gguf(path, EngineConfig(**BASE, **kw)) as eng:
        st = eng.runner.stepper
        logits = eng.logits(prompts[0])
        hs = [eng.submit(p, max_tokens=8, ignore_eos=True) for p in prompts]
        toks = [[e.token for e in h if e.kind == "token"] for h in hs]
        ran_on = sorted({str(next(iter(leaf.devices()))) for tree in (st.host_trees or {}).values()
                         for leaf in jax.tree_util.tree_leaves(tree)})
        stages = sorted({lay.stage for lay in eng.runner.programs.programs})
        res[name] = {"logits": np.asarray(logits).tolist(), "tokens": toks, "experts": eng.stats()["experts"],
                     "host_device": str(st.host_device), "blocks_on": ran_on, "stages": stages,
                     "rule": None if st.rule is None else [st.rule.link_gbs, st.rule.host_gbs, st.rule.force]}
json.dump(res, open(out, "w"))
"""  # noqa: E501


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    path = tiny_model(**MOE)
    out = tmp_path_factory.mktemp("remote") / "out.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(out)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_remote_host_experts_give_the_same_bits_as_copying_every_miss(runs):
    arena, remote = runs["arena"], runs["remote"]
    assert remote["host_device"] == "cpu:1", remote["host_device"]
    # the host tier's blocks sit on cpu:1
    assert remote["blocks_on"] == [remote["host_device"]]
    assert any(s.startswith("rexperts") for s in remote["stages"]), remote["stages"]
    assert np.array_equal(np.array(arena["logits"]), np.array(remote["logits"]))
    assert arena["tokens"] == remote["tokens"]
    e = remote["experts"]
    assert e["host_computed"] > 0 and e["host_layers"] > 0
    assert e["lookups"] == e["hits"] + e["host_computed"] + e["misses_host"] + e["misses_file"]
    assert arena["experts"]["host_computed"] == 0


def test_auto_measures_its_rule_and_gives_the_same_tokens(runs):
    auto = runs["auto"]
    link, host, force = auto["rule"]
    assert link > 0 and host > 0 and not force
    assert auto["tokens"] == runs["arena"]["tokens"]


def test_the_cost_rule():
    # the host computes 2 rows in one copy's time
    rule = HostRule(link_gbs=10.0, host_gbs=20.0)
    assert rule.host_wins(np.array([1, 1]))                        # decode: a row a missed expert
    assert not rule.host_wins(np.array([3, 2]))                    # 2.5 rows each: copying wins
    assert HostRule(10.0, 1.0, force=True).host_wins(np.array([64]))
    assert "2.0 rows" in rule.describe()


def test_host_device_names_a_cpu_device():
    with pytest.raises(ConfigError, match="host_device = 'gpu:0'"):
        EngineConfig(host_device="gpu:0")
    # checked against the devices when the engine starts
    EngineConfig(host_device="cpu:1")


# ---- --pcie-frac: some misses read by the device from pinned host memory, never copied into the
# cache ----

def test_pcie_frac_reads_misses_over_the_link_with_the_same_bits(tiny_model):
    from strata_jax import Engine

    path = tiny_model(**MOE)
    base = {"parallel": 2, "max_context": 64, "prefill": 16, "warmup": False, "expert_cache": 3,
            "host_experts": "off", "layer_step": "always"}
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (21, 6)]
    out = {}
    for name, kw in (("arena", {}), ("pcie", {"pcie_frac": 0.5})):
        with Engine.from_gguf(path, EngineConfig(**base, **kw)) as eng:
            logits = eng.logits(prompts[0])
            hs = [eng.submit(p, max_tokens=8, ignore_eos=True) for p in prompts]
            out[name] = (logits, [[e.token for e in h if e.kind == "token"] for h in hs],
                         eng.stats()["experts"])
            if name == "pcie":
                stages = {lay.stage for lay in eng.runner.programs.programs}
                assert "sexperts" in stages, stages
    (la, ta, ea), (lp, tp, ep) = out["arena"], out["pcie"]
    assert np.array_equal(la, lp) and ta == tp
    assert ep["streamed"] > 0 and ep["bytes_streamed"] > 0 and ea["streamed"] == 0
    assert ep["lookups"] == ep["hits"] + ep["misses_host"] + ep["misses_file"] + ep["streamed"]
    # the streamed (coldest) misses never evict a cached expert
    assert ep["evictions"] < ea["evictions"]


def test_pcie_frac_is_a_clear_error_where_the_device_has_no_pinned_host():
    from types import SimpleNamespace

    from strata_jax.experts.stream import pinned_host

    dev = SimpleNamespace(addressable_memories=lambda: [SimpleNamespace(kind="device")])
    with pytest.raises(ConfigError, match="no pinned_host memory kind"):
        pinned_host(dev)
    with pytest.raises(ConfigError, match="pcie_frac = 1.5"):
        EngineConfig(pcie_frac=1.5)
