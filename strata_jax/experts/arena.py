"""The device cache: a preallocated arena of expert slots per MoE layer, updated in place.

Each MoE layer has N slots for each of its three expert tensors (GGUF blocks [N, rows, row_bytes] in
that layer's quant type, or float [N, k, n] where the engine keeps weights dequantized), a page
table (layer, expert) -> slot on the host, and the same table on the device as int32 [E] per layer
(slot, or -1), which the experts program reads to find each chosen expert. Layers may differ in
quant type (a Q4_K_M file gives some layers' ffn_down_exps Q6_K, whose blocks are bigger), so leaf
shapes and the conversion to the arena's form are per layer. Missing experts are copied in by a
small jitted update that donates the arena leaf, so it is written in place, never copied.

`passes(layer, ids)` is the host's side of one layer: it yields the device page table once for every
pass the layer needs (one, unless the window chose more distinct experts than the arena has slots),
after making that pass's experts resident.

Pinned experts (`pin`, from an expert profile at start) stay in their slots for good: the policy
never picks them, and a pass fits the layer's other experts into the unpinned slots.
`prefetch(layer, experts)` copies experts in ahead of the layer's lookup (the engine's guess of what
the layer will need); it never counts as a lookup, and a later lookup that finds a prefetched expert
counts as a prefetch hit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from .host import EXPERT_TENSORS, HostTier
from .policy import make_policy
from .stats import ExpertCounters

log = logging.getLogger("strata_jax.experts")


def _put(leaves: dict[str, jax.Array], slots: jax.Array,
         vals: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {n: leaf.at[slots].set(vals[n].astype(leaf.dtype)) for n, leaf in leaves.items()}


# One small program per layer's leaf shapes and batch bucket (a handful): the arena leaves are
# donated, so updated in place, all three of an expert in one call.
_put_jit = jax.jit(_put, donate_argnums=(0,))


def slot_bytes(leaf_shapes: dict[int, dict[str, tuple[tuple[int, ...], object]]]) -> int:
    """Bytes of one expert slot in every layer of `leaf_shapes` (layer -> tensor -> (shape,
    dtype))."""
    return sum(int(np.prod(shape)) * jnp.dtype(dtype).itemsize
               for leaves in leaf_shapes.values() for shape, dtype in leaves.values())


def _count_lookups(counters: ExpertCounters, routed: int, lookups: int, hits: int,
                   decode: bool) -> None:
    """One layer's (or several layers') lookups into the counters: routed assignments, distinct
    experts needed, how many of them were resident; the decode_* figures too for a window without a
    prompt chunk."""
    counters.routed += routed
    counters.lookups += lookups
    counters.hits += hits
    if decode:
        counters.decode_lookups += lookups
        counters.decode_hits += hits
        counters.decode_misses += lookups - hits


class ExpertArena:
    def __init__(self, host: HostTier, n_slots: int,
                 to_device: Callable[[int, str, np.ndarray], jax.Array],
                 leaf_shapes: dict[int, dict[str, tuple[tuple[int, ...], object]]],
                 policy: str = "freq"):
        """to_device(layer, tensor name, blocks [m, rows, row_bytes]) -> the arena's form of m
        experts of that layer (its blocks, or floats dequantized from its quant type); leaf_shapes:
        layer -> tensor name -> (shape of one expert in the arena, dtype)."""
        self.host = host
        self.layers = host.layers
        self.n_experts = host.n_experts
        self.n_slots = min(n_slots, self.n_experts)
        self.to_device = to_device
        self.arena = {i: {n: jnp.zeros((self.n_slots, *shape), dtype)
                          for n, (shape, dtype) in leaf_shapes[i].items()}
                      for i in self.layers}
        # bytes of one slot in every MoE layer (the device memory one more slot a layer costs)
        self.slot_bytes = slot_bytes(leaf_shapes)
        # expert -> slot
        self.slot_of = {i: np.full(self.n_experts, -1, np.int32) for i in self.layers}
        # slot -> expert
        self.expert_in = {i: np.full(self.n_slots, -1, np.int32) for i in self.layers}
        # the page tables the experts programs read, as host arrays (a program call takes a small
        # numpy argument in C++; a jax.device_put from Python costs ~0.1 ms): copies, never aliased
        self.tables = {i: self.slot_of[i].copy() for i in self.layers}
        self.policies = {i: make_policy(policy, self.n_experts) for i in self.layers}
        self.policy = policy
        # experts that never leave (an expert profile's hottest)
        self.pinned = {i: set() for i in self.layers}
        self.fresh = {i: set() for i in self.layers}     # prefetched experts not looked up yet
        self.clock = 0
        self.exchanged = 0            # experts copied host -> device since start
        self.copy_seconds = 0.0

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.n_slots

    def passes(self, layer: int, ids: np.ndarray, counters: ExpertCounters,
               decode: bool) -> Iterator[jax.Array]:
        """Make the experts of `ids` (any shape) resident, in as few passes as the slots allow;
        yield the device page table of `layer` after each pass."""
        self.clock += 1
        needed = [int(e) for e in np.unique(ids)]
        slot_of = self.slot_of[layer]
        hits = [e for e in needed if slot_of[e] >= 0]
        missing = [e for e in needed if slot_of[e] < 0]
        _count_lookups(counters, int(ids.size), len(needed), len(hits), decode)
        self.policies[layer].access(needed, self.clock)
        fresh = self.fresh[layer]
        counters.prefetch_hits += len(fresh.intersection(hits))
        fresh.clear()
        pinned = self.pinned[layer]
        # Pinned experts sit in their slots already; the others share the unpinned slots, resident
        # ones first (the first pass moves least), as many a pass as there are unpinned slots.
        free_slots = self.n_slots - len(pinned)
        first = [e for e in needed if e in pinned]
        order = [e for e in hits if e not in pinned] + missing
        for n, start in enumerate(range(0, max(len(order), 1), free_slots)):
            chunk = (first if n == 0 else []) + order[start:start + free_slots]
            if n:
                counters.passes += 1
            self._load(layer, [e for e in chunk if slot_of[e] < 0], set(chunk), counters)
            yield self.tables[layer]

    def count_hits(self, counts: np.ndarray, rows: np.ndarray, counters: ExpertCounters,
                   decode: bool) -> None:
        """The lookups of the MoE layers `rows` (indices into self.layers) of a window whose routed
        experts were all resident: counts [layers, E] holds how many real tokens routed to each
        expert. Counted, and each layer's policy told, as passes() does it (the one-program window:
        stepped.py), nothing moved."""
        needed = counts[rows] > 0
        n = int(needed.sum())
        _count_lookups(counters, int(counts[rows].sum()), n, n, decode)
        for r, experts in zip(rows, needed):
            layer = self.layers[r]
            self.clock += 1
            chosen = np.flatnonzero(experts).tolist()
            self.policies[layer].access(chosen, self.clock)
            fresh = self.fresh[layer]
            if fresh:
                counters.prefetch_hits += len(fresh.intersection(chosen))
                fresh.clear()

    def missing(self, layer: int, ids: np.ndarray) -> int:
        """How many distinct experts of `ids` are not in the device arena."""
        return int(np.sum(self.slot_of[layer][np.unique(ids)] < 0))

    def count_host(self, layer: int, ids: np.ndarray, counters: ExpertCounters,
                   decode: bool) -> None:
        """The lookups of a layer whose experts are computed from the host tier's blocks
        (--host-experts): counted (and the policy told) as passes() counts them, nothing copied
        in."""
        self.clock += 1
        needed = [int(e) for e in np.unique(ids)]
        hits = sum(1 for e in needed if self.slot_of[layer][e] >= 0)
        _count_lookups(counters, int(ids.size), len(needed), hits, decode)
        counters.host_computed += len(needed) - hits
        counters.host_layers += 1
        self.policies[layer].access(needed, self.clock)
        self.fresh[layer].clear()
        # Free slots still take the missed experts (never an eviction: that copy is the cost the
        # host path avoids), so an arena with room for them all fills and its later windows hit.
        free = int(np.sum(self.expert_in[layer] < 0))
        if free:
            miss = [e for e in needed if self.slot_of[layer][e] < 0][:free]
            tiers = [self.host.tier_of(layer, e) for e in miss]
            self._load(layer, miss, set(needed), counters)
            # these lookups are counted as host_computed above
            counters.misses_host -= tiers.count("host")
            counters.misses_file -= tiers.count("file")

    def pin(self, layer: int, experts: list[int]) -> None:
        """Bring `experts` in now and keep them for good (at least one slot always stays
        unpinned)."""
        room = self.n_slots - 1 - len(self.pinned[layer])
        experts = [e for e in experts if e not in self.pinned[layer]][:max(room, 0)]
        self._load(layer, [e for e in experts if self.slot_of[layer][e] < 0], set(experts), None)
        self.pinned[layer].update(experts)

    def prefetch(self, layer: int, experts: list[int], counters: ExpertCounters) -> None:
        """Copy in the experts that `layer` will likely need (up to its unpinned slots), before it
        asks."""
        slot_of, pinned = self.slot_of[layer], self.pinned[layer]
        room = self.n_slots - len(pinned)
        want = [e for e in experts if e not in pinned][:room]
        todo = [e for e in want if slot_of[e] < 0]
        if todo:
            self._load(layer, todo, set(want), counters, prefetch=True)
            self.fresh[layer].update(todo)

    def _load(self, layer: int, experts: list[int], protected: set[int],
              counters: ExpertCounters | None, prefetch: bool = False) -> None:
        """Copy `experts` into free slots or ones the policy frees (never a protected or pinned
        expert's). counters None: at start (pinning), counted nowhere but in `exchanged`."""
        if not experts:
            return
        t0 = time.perf_counter()
        slot_of, expert_in, policy = (self.slot_of[layer], self.expert_in[layer],
                                      self.policies[layer])
        protected = protected | self.pinned[layer]
        if counters is None:
            counters = ExpertCounters()
        elif prefetch:
            counters.prefetched += len(experts)
        else:
            for e in experts:
                counters.misses_host += self.host.tier_of(layer, e) == "host"
                counters.misses_file += self.host.tier_of(layer, e) == "file"
        # file-tier ones read by the pool's threads
        blocks = self.host.get(layer, experts)
        slots = []
        for e in experts:
            free = np.flatnonzero(expert_in < 0)
            if free.size:
                s = int(free[0])
            else:
                old = policy.victim([int(x) for x in expert_in], protected, self.clock)
                s = int(slot_of[old])
                slot_of[old] = -1
                self.fresh[layer].discard(old)
                counters.evictions += 1
            slot_of[e], expert_in[s] = s, e
            slots.append(s)
        m = len(experts)
        # pad to a power of two: few update programs
        bucket = 1 << (m - 1).bit_length()
        pad = slots + [slots[-1]] * (bucket - m)          # the padding writes the last expert again
        idx = np.array(pad, np.int32)
        vals = {}
        for n in EXPERT_TENSORS:
            # one expert: a view, not a stacked copy (to_device may then read it in place:
            # jax.device_put)
            stacked = (blocks[0][n][None] if bucket == 1
                       else np.stack([b[n] for b in blocks] + [blocks[-1][n]] * (bucket - m)))
            vals[n] = self.to_device(layer, n, stacked)
        self.arena[layer] = _put_jit(self.arena[layer], idx, vals)
        self.tables[layer] = slot_of.copy()
        counters.bytes_moved += m * self.host.expert_bytes[layer]
        self.exchanged += m
        self.copy_seconds += time.perf_counter() - t0
