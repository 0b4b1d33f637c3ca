"""Replay a routing trace through the device cache's bookkeeping, for any cache size and policy.

Routing does not depend on where the experts are (the logits are the same bits with any cache), so
the lookups and prefetch guesses that one engine run records (`LayerStepper.trace`) are the ones any
other cache size or policy would see. Replaying them through a real ExpertArena (its page table,
policy, pins and prefetch; a stub host tier and one-float "experts" instead of weights) gives the
counters that engine would report, without running the model again. tests/test_experts.py checks
that against a real run.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .arena import ExpertArena
from .host import EXPERT_TENSORS
from .stats import ExpertCounters


class _StubHost:
    """What ExpertArena asks of a host tier, with one float an expert."""

    def __init__(self, layers: list[int], n_experts: int):
        self.layers, self.n_experts, self.expert_bytes = layers, n_experts, dict.fromkeys(layers, 0)
        self._blob = {n: np.zeros((1,), np.float32) for n in EXPERT_TENSORS}

    def tier_of(self, layer: int, expert: int) -> str:
        return "host"

    def get(self, layer: int, experts: list[int]) -> list[dict]:
        return [self._blob] * len(experts)


def replay(trace: list, layers: list[int], n_experts: int, n_slots: int, policy: str,
           prefetch: bool,
           pins: dict[int, list[int]] | None = None, count_from: int = 0) -> ExpertCounters:
    """trace: [("lookup", layer, ids, decode) | ("prefetch", layer, experts)] in the order they
    happened; the entries before `count_from` warm the cache up and are not counted."""
    arena = ExpertArena(_StubHost(layers, n_experts), n_slots,
                        lambda layer, name, blocks: jnp.asarray(blocks),
                        {i: {n: ((1,), jnp.float32) for n in EXPERT_TENSORS} for i in layers},
                        policy)
    for layer, experts in (pins or {}).items():
        arena.pin(layer, experts)
    warm, counters = ExpertCounters(), ExpertCounters()
    for n, entry in enumerate(trace):
        c = counters if n >= count_from else warm
        if entry[0] == "lookup":
            for _ in arena.passes(entry[1], np.asarray(entry[2]), c, entry[3]):
                pass
        elif prefetch:
            arena.prefetch(entry[1], entry[2], c)
    return counters
