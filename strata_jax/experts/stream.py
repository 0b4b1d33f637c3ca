"""--pcie-frac F: up to a fraction F of a layer's routed experts in a window are read by the device
straight from host memory over the link, never copied into the device cache (Strata's third way,
beside copying a miss in and computing it on the host). The missed experts with the fewest rows in
the window (the coldest: caching them would evict hotter ones) are staged as one small tree of S
slots in JAX's `pinned_host` memory kind, which the window's "sexperts" program takes as it takes
the arena (stepped.py): the same expert kernel on the same blocks, so the same bits. Offered where
the device has that memory kind, a clear error where not.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from ..config import ConfigError
from .host import EXPERT_TENSORS, HostTier
from .stats import ExpertCounters


def pinned_host(device) -> jax.sharding.SingleDeviceSharding:
    """The device's pinned_host memory, or a ConfigError naming the kinds it has."""
    kinds = [m.kind for m in device.addressable_memories()]
    if "pinned_host" not in kinds:
        raise ConfigError(f"pcie_frac: the device {device} has no pinned_host memory kind (it has "
                          f"{', '.join(kinds)}): its programs cannot read host memory over the "
                          "link; use 0")
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


class ExpertStream:
    def __init__(self, host: HostTier, frac: float, to_form, device):
        """to_form(layer, tensor name, blocks [m, ...]) -> the arena's form of m experts
        (ExpertArena.to_device)."""
        self.host, self.frac, self.to_form = host, frac, to_form
        self.slots = max(1, math.ceil(frac * host.n_experts))
        self.sharding = pinned_host(device)
        self.bytes = 0                    # read over the link since start

    def choose(self, layer: int, ids: np.ndarray, slot_of: np.ndarray) -> list[int]:
        """The missed experts of `ids` this window streams: up to floor(frac x distinct routed),
        fewest rows first."""
        flat = ids.reshape(-1)
        experts, rows = np.unique(flat, return_counts=True)
        n = min(self.slots, math.floor(self.frac * experts.size))
        missed = [(int(r), int(e)) for e, r in zip(experts, rows) if slot_of[e] < 0]
        return [e for _, e in sorted(missed)[:n]]

    def stage(self, layer: int, experts: list[int], counters: ExpertCounters, decode: bool):
        """-> (the experts as a tree of self.slots slots in pinned_host memory, their table [E]
        int32)."""
        blocks = self.host.get(layer, experts)
        pad = blocks + [blocks[-1]] * (self.slots - len(blocks))
        tree = {n: jax.device_put(np.asarray(self.to_form(layer, n, np.stack([b[n] for b in pad]))),
                                  self.sharding)
                for n in EXPERT_TENSORS}
        table = np.full(self.host.n_experts, -1, np.int32)
        table[experts] = np.arange(len(experts), dtype=np.int32)
        nbytes = len(experts) * self.host.expert_bytes[layer]
        self.bytes += nbytes
        counters.streamed += len(experts)
        counters.bytes_streamed += nbytes
        counters.lookups += len(experts)
        if decode:
            counters.decode_lookups += len(experts)
            counters.decode_misses += len(experts)
        return tree, table
