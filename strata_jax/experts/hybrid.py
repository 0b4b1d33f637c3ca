"""Experts computed where they live (--host-experts): which CPU device computes a layer's missed
experts from the host tier's blocks, and the cost rule that chooses, a layer and a window at a time,
between that and copying the missed experts into the device cache.

Two places the host can be:
- "local": the device IS a CPU (the cpu backend with GGUF blocks). The device cache is host RAM, so
  a copy into it is pure overhead: every miss is computed in place, inside the window's one program
  (stepped_build.resident_window picks the host blocks with lax.cond).
- "remote": the device is another one (a GPU; or, in tests, another CPU device of a process with
  forced host devices). The window steps layer by layer; a layer with misses sends its normed input
  and router ids to the host device, whose program (transformer.host_experts_stage) computes only
  the missed experts with the CPU expert kernel, and the device's experts program computes the held
  ones and adds the host's rows in (experts_stage's y_acc). KTransformers' and llama.cpp's
  --n-cpu-moe way.

The rule (issue 15): a miss costs either its copy, expert bytes / link bandwidth, or its rows on the
host, rows x expert bytes / host kernel rate; both rates are measured at start and printed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import numpy as np

from ..config import ConfigError


@dataclass(frozen=True)
class HostRule:
    # GB/s: one expert's blocks copied host -> device (the device cache's fill)
    link_gbs: float
    # GB/s: the host's expert kernel reading one expert's blocks for one row
    host_gbs: float
    force: bool = False      # --host-experts on: every miss is computed on the host

    def host_wins(self, rows: np.ndarray) -> bool:
        """rows [m]: how many (token, choice) rows each missed expert has in this window. The host
        computes them in sum(rows) x B / host_gbs, a copy costs m x B / link_gbs: the host wins
        below host_gbs / link_gbs rows a missed expert (decode: about one)."""
        return self.force or float(np.sum(rows)) * self.link_gbs < rows.size * self.host_gbs

    def describe(self) -> str:
        per = self.host_gbs / max(self.link_gbs, 1e-9)
        return (f"a miss costs its copy at {self.link_gbs:.1f} GB/s (measured) or its rows on the "
                f"host at {self.host_gbs:.1f} GB/s a row (measured): the host computes a missed "
                f"expert with fewer than {per:.1f} rows in the window"
                + ("; --host-experts on: every miss on the host" if self.force else ""))


def host_device(want: str, device_name: str, engine_device, able_local: bool, kernels: bool):
    """-> (the CPU device that computes missed experts, "local" | "remote"), or (None, None) when
    none does. want: --host-experts; device_name: --host-device; able_local: the engine runs the cpu
    backend on GGUF blocks on a CPU device; kernels: the C++ CPU kernels are built."""
    if want == "off":
        return None, None
    if not kernels:
        if want == "on":
            raise ConfigError("host_experts = on: computing experts on the host needs the C++ CPU "
                              "kernels, which are not built here (see docs/FLAGS.md, The CPU "
                              "kernels)")
        return None, None
    cpus = jax.devices("cpu")
    if device_name == "auto":
        dev = engine_device if engine_device.platform == "cpu" else cpus[0]
    else:
        n = int(device_name.split(":")[1])
        if n >= len(cpus):
            raise ConfigError(f"host_device = {device_name}: this process has {len(cpus)} CPU "
                              f"device(s) (cpu:0 to cpu:{len(cpus) - 1})")
        dev = cpus[n]
    if dev == engine_device:
        if not able_local:
            if want == "on":
                raise ConfigError("host_experts = on: the device is this CPU, and computing "
                                  "experts in place needs the cpu backend with weights = blocks")
            return None, None
        return dev, "local"
    return dev, "remote"


def _best_of(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def memcpy_rate(blocks: np.ndarray) -> float:
    """GB/s of copying one expert's blocks in RAM: the link a miss crosses when the device is the
    CPU."""
    dst = np.empty_like(blocks)
    return blocks.nbytes / _best_of(lambda: np.copyto(dst, blocks)) / 1e9


def link_rate(blocks: np.ndarray, device) -> float:
    """GB/s of copying one expert's blocks from host RAM onto `device` (jax.device_put)."""
    return blocks.nbytes / _best_of(lambda: jax.device_put(blocks,
                                                           device).block_until_ready()) / 1e9


def host_rate(tree, spec, device, backend: str) -> float:
    """GB/s the host's expert kernel reads one expert's gate blocks at for one row (on `device`),
    with the cpu backend the host experts run ("cpu" | "cpu-exact": --cpu-math, which the rate
    depends on)."""
    import jax.numpy as jnp

    import pallas_kernels as pk

    gate = tree["exp_gate"]
    x = jax.device_put(jnp.ones((1, spec.hidden), jnp.float32), device)
    ids = jax.device_put(jnp.zeros((1,), jnp.int32), device)
    fn = jax.jit(lambda x, w, ids: pk.expert_matmul(x, w, ids, gate.qtype, backend))
    fn(x, gate.data, ids).block_until_ready()
    one = gate.data.nbytes / gate.data.shape[0]
    return one / _best_of(lambda: fn(x, gate.data, ids).block_until_ready()) / 1e9
