"""Which expert leaves the device arena when a new one needs its slot.

Two policies, one interface (per MoE layer; `now` is a clock that ticks once a lookup):

- "lru": plain least recently used.
- "freq" (the default): a frequency-aware LRU. Each expert keeps a use count that decays by half
  every `half_life` ticks (LFU with aging), remembered even while the expert is not on the device;
  the victim is the resident expert with the lowest decayed count, the least recently used among
  equals. An expert that many tokens route to survives a burst of one-off experts, which plain LRU
  lets flush it, and the aging lets yesterday's favourites go when routing shifts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

POLICIES = ("freq", "lru")


class LRUPolicy:
    name = "lru"

    def __init__(self, n_experts: int):
        self.last = [-1] * n_experts

    def access(self, experts: Iterable[int], now: int) -> None:
        for e in experts:
            self.last[e] = now

    def victim(self, resident: Iterable[int], protected: set[int], now: int) -> int:
        cands = [e for e in resident if e not in protected]
        if not cands:
            raise RuntimeError("every resident expert is in use: no slot can be freed")
        return min(cands, key=lambda e: self.last[e])


class FreqLRUPolicy(LRUPolicy):
    name = "freq"

    def __init__(self, n_experts: int, half_life: float = 64.0):
        super().__init__(n_experts)
        self.count = [0.0] * n_experts
        self.stamp = [0] * n_experts
        self.rate = math.log(2) / half_life

    def _score(self, e: int, now: int) -> float:
        return self.count[e] * math.exp(-self.rate * (now - self.stamp[e]))

    def access(self, experts: Iterable[int], now: int) -> None:
        for e in experts:
            self.count[e] = self._score(e, now) + 1.0
            self.stamp[e] = now
            self.last[e] = now

    def victim(self, resident: Iterable[int], protected: set[int], now: int) -> int:
        cands = [e for e in resident if e not in protected]
        if not cands:
            raise RuntimeError("every resident expert is in use: no slot can be freed")
        return min(cands, key=lambda e: (self._score(e, now), self.last[e]))


def make_policy(name: str, n_experts: int):
    if name == "lru":
        return LRUPolicy(n_experts)
    if name == "freq":
        return FreqLRUPolicy(n_experts)
    raise ValueError(f"expert cache policy {name!r}: choose one of {', '.join(POLICIES)}")
