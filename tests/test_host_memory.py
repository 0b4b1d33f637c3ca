"""The host memory the engine may use (engine/host_memory.py): the smallest of the RAM and the
memory cgroup limits over the process (v2 up the tree, v1), a start whose flags ask for more
refused with the figures (by the engine for its KV cache, by `serve` at once for the budgets), and
the availability a container has left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from strata_jax.config import ConfigError, EngineConfig
from strata_jax.engine.host_memory import (
    RUNTIME_RESERVE,
    HostNeeds,
    cgroup_available,
    memory_limit,
)

GiB = 1 << 30


def fake_root(tmp_path: Path, cgroup: str, files: dict[str, str], ram_gib: int = 24) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal:       {ram_gib * 1024 * 1024} kB\n"
                                           "MemAvailable:   1000 kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_v2_parents_limit_binds_its_child(tmp_path):
    root = fake_root(tmp_path, "0::/box/job\n", {
        "sys/fs/cgroup/cgroup.controllers": "memory\n",
        "sys/fs/cgroup/box/job/memory.max": "max\n",               # the process's own: no limit
        "sys/fs/cgroup/box/job/memory.current": "1073741824\n",
        "sys/fs/cgroup/box/memory.max": f"{int(2.5 * GiB)}\n",     # its parent's binds it
        "sys/fs/cgroup/box/memory.current": f"{2 * GiB}\n"})
    got = memory_limit(root=root)
    assert got.bytes == int(2.5 * GiB) and "box/memory.max" in got.source
    assert cgroup_available(root) == GiB // 2
    assert memory_limit(1.5, root=root).bytes == int(1.5 * GiB)    # the flag, lower still
    assert memory_limit(100, root=root).bytes == int(2.5 * GiB)    # never above the cgroup's


def test_v1_limits_and_no_limit_at_all(tmp_path):
    v1 = fake_root(tmp_path / "a", "4:memory:/process_api/x\n0::/\n", {
        "sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes": f"{3 * GiB}\n",
        "sys/fs/cgroup/memory/process_api/x/memory.usage_in_bytes": f"{GiB}\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"})   # v1's "none"
    assert memory_limit(root=v1).bytes == 3 * GiB and cgroup_available(v1) == 2 * GiB
    free = fake_root(tmp_path / "b", "0::/\n", {"sys/fs/cgroup/memory.max": "max\n"}, ram_gib=8)
    got = memory_limit(root=free)
    assert got.bytes == 8 * GiB and "MemTotal" in got.source and cgroup_available(free) is None


def test_needs_past_the_limit_are_refused_with_every_figure(tmp_path):
    limit = memory_limit(root=fake_root(tmp_path, "0::/\n", {}, ram_gib=4))
    HostNeeds({"a": 2 * GiB}).check(limit)                           # 2 + 1 reserve <= 4
    with pytest.raises(ConfigError) as e:
        HostNeeds({"the KV cache (8 slots x 32768 positions)": int(3.5 * GiB), "x": 0}).check(limit)
    msg = str(e.value)
    assert ("the engine would need 4.50 GiB of host memory (the KV cache (8 slots x 32768 "
            "positions): 3.50 GiB, the runtime's reserve: 1.00 GiB) and may use 4.00 GiB (the "
            "machine's RAM (MemTotal))") in msg and "lower --parallel, --max-context" in msg
    assert RUNTIME_RESERVE == GiB
    from strata_jax.engine.host_memory import check_flags

    check_flags(EngineConfig(conversation_cache_mib=0.1), is_moe=False)   # a fraction of a MiB


def test_the_engine_refuses_a_kv_cache_past_its_memory_limit(tiny_model):
    """A real engine: 4 slots of 8192 positions of a 2-layer model's float32 KV are 16 MiB; with
    --memory-limit-gib 1.01 (1 GiB of it the runtime's reserve) that is refused before anything
    is allocated, naming the figures."""
    from strata_jax.engine import Engine

    path = tiny_model(arch="qwen3", layers=2, hidden=64, context=8192)
    cfg = EngineConfig(parallel=4, max_context=8192, kv="f32", memory_limit_gib=1.01,
                       backend="xla")
    with pytest.raises(ConfigError, match=r"the KV cache \(4 slots x 8192 positions\): 0\.02 GiB"
                                          r".* may use 1\.01 GiB \(--memory-limit-gib 1\.01\)"):
        Engine.from_gguf(path, cfg)
    with pytest.raises(ConfigError, match="memory_limit_gib = -1: must be a positive number"):
        EngineConfig(memory_limit_gib=-1)


def test_serve_refuses_a_resident_budget_past_the_memory_at_once(tiny_model):
    """`serve --resident-budget-gib` beyond the memory this process may use (the machine's RAM
    here, or a container's limit) exits at once with the figures, instead of an engine that
    restarts forever."""
    path = tiny_model(arch="qwen3moe", layers=2, experts=8)
    done = subprocess.run([sys.executable, "-m", "strata_jax", "serve", str(path), "--port", "0",
                           "--resident-budget-gib", "100000"], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert ("--resident-budget-gib 100000: 100000.00 GiB" in done.stderr
            and "may use" in done.stderr), done.stderr[-2000:]


def test_a_device_expert_cache_on_a_cpu_is_host_memory_too(tiny_model):
    """On a CPU the device expert cache (--expert-cache N) is host RAM: 8 slots a layer of 16
    experts of ~0.8 MiB are ~13 MiB, past a limit 5 MiB above the runtime's reserve."""
    from strata_jax.engine import Engine

    path = tiny_model(arch="qwen3moe", layers=2, hidden=256, experts=16, expert_ffn=1024)
    cfg = EngineConfig(max_context=256, expert_cache=8, memory_limit_gib=1 + 5 / 1024)
    with pytest.raises(ConfigError,
                       match=r"the device expert cache \(8 slots a layer\): 0\.01 GiB"):
        Engine.from_gguf(path, cfg)


def test_serve_a_moe_file_larger_than_its_memory_limit(tiny_model):
    """The server on a MoE file that does not fit in the memory it may use (--memory-limit-gib here;
    a container's limit or the RAM elsewhere): the engine sizes its expert tiers from what the limit
    leaves, says so in the server's log, and answers (tests/test_experts.py checks the sizes and the
    bits)."""
    import httpx
    import numpy as np

    from strata_jax.engine.choices import resolve
    from strata_jax.engine.execute.tier_sizes import file_bytes
    from strata_jax.engine.runner import _host_needs
    from strata_jax.gguf import GGUFModel
    from strata_jax.serve.launch import ServerProcess

    # tests/test_experts.py's 16-expert model (the same options: the same file)
    path = tiny_model(arch="qwen3moe", layers=2, hidden=64, heads=4, kv_heads=2, experts=16,
                      experts_used=2, expert_ffn=256)
    model = GGUFModel.open(path)
    experts, dense = file_bytes(model)
    c = EngineConfig(parallel=2, max_context=64, weights="blocks", expert_cache=0,
                     host_experts="off")
    # what the flags need beside the experts (about: the server's KV may differ by a few KiB), and
    # room for three quarters of the experts: an arena of 2-3 slots a layer of 16
    base = _host_needs(model, c, resolve(c, model), np.float32, 64, 64, 0).total
    gib = (base + dense + 0.75 * experts) / GiB
    args = [str(path), "--parallel", "2", "--max-context", "64", "--weights", "blocks",
            "--memory-limit-gib", f"{gib:.9f}"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"prompt": [3, 4, 5, 6], "max_tokens": 4, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        log = srv.log()
    assert "the expert tiers, sized from what is left" in log and "--host-experts off" in log, log
