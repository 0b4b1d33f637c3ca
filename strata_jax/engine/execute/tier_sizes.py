"""The expert tiers sized by the memory limit, for a MoE model whose file does not fit in it.

On a CPU device, `--expert-cache auto` puts "every expert on the device": the file's blocks where
they lie in its map. That is right while the page cache holds the file. When the file is larger than
the memory the engine may use (engine/host_memory.py: the RAM, a memory cgroup's limit,
--memory-limit-gib), every token faults its experts in through the map, a page at a time on the
thread that touches it, and evicts others it will need next (docs/BENCHMARKS.md, issue 36 session
29: a 36 GiB model on 23.5 GiB of RAM decoded 0.45 tok/s so). The expert tiers read the same experts
with pread, several threads at once, into a device cache of expert slots, and keep a RAM tier of
whole layers: 1.01 tok/s on the same file with `--expert-cache 64 --resident-budget-gib 6
--host-experts off` (the host path, which computes a layer's misses from the file's map, made
0.35 tok/s there: it faults the experts in too). `tiers_for_memory` chooses those three from the
limit when the user set none of them.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ...config import EngineConfig
from ...experts.host import expert_tensors
from ...gguf import GGUFModel
from ..host_memory import GiB, HostNeeds, MemoryLimit

log = logging.getLogger("strata_jax.engine")

# Shares of the room the limit leaves (the limit less what the flags need and the dense weights'
# pages) given to the device expert cache and to the RAM tier. The other half stays free for the
# page cache (the pread copies pass through it) and the compiled programs. On the 36 GiB model
# and 23.5 GiB of RAM, 64 slots (5.4 GiB) and a 6 GiB RAM tier were measured first (1.01 tok/s);
# these shares give 65 slots and 5.14 GiB there (0.95 tok/s; docs/BENCHMARKS.md, session 30).
ARENA_SHARE = 0.25
RAM_TIER_SHARE = 0.25


def file_bytes(model: GGUFModel) -> tuple[int, int]:
    """(the routed experts' bytes, every other tensor's bytes) in the model's file."""
    experts = sum(t.n_bytes for name, t in model.tensors.items() if "_exps." in name)
    return experts, sum(t.n_bytes for t in model.tensors.values()) - experts


def slot_bytes_all_layers(model: GGUFModel) -> int:
    """One expert slot in every MoE layer: what a slot of --expert-cache costs."""
    return sum(sum(int(t.data[0].nbytes) for t in expert_tensors(model, i).values())
               for i in model.spec.moe_layers)


def tiers_for_memory(model: GGUFModel, cfg: EngineConfig, needs: HostNeeds,
                     limit: MemoryLimit | None) -> EngineConfig:
    """cfg, or cfg with --expert-cache N, --resident-budget-gib G and (from auto) --host-experts off
    when the model's file is larger than the memory `limit` leaves beside `needs` (what the flags
    ask of host RAM). Only for what the user left to the engine: expert_cache auto, no
    --resident-budget-gib; the caller checks the device is a CPU with GGUF blocks."""
    if limit is None or not model.spec.is_moe or cfg.expert_cache != "auto" \
            or cfg.resident_budget_gib is not None:
        return cfg
    experts, dense = file_bytes(model)
    if experts + dense + needs.total <= limit.bytes:
        return cfg
    room = limit.bytes - needs.total - dense
    one = slot_bytes_all_layers(model)
    slots = min(int(room * ARENA_SHARE) // one, model.spec.n_experts)
    where = (f"the model's file ({(experts + dense) / GiB:.2f} GiB, {experts / GiB:.2f} GiB of it "
             f"routed experts) and what the flags need ({needs.total / GiB:.2f} GiB) are more than "
             f"the {limit.bytes / GiB:.2f} GiB this engine may use ({limit.source})")
    if slots < model.spec.n_experts_used:
        log.warning("%s, and too little is left for an expert cache of %d slots a layer (a "
                    "token's experts): every expert is read through the file's map, slowly; give "
                    "--expert-cache and --resident-budget-gib, or more memory", where,
                    model.spec.n_experts_used)
        return cfg
    budget = room * RAM_TIER_SHARE / GiB
    host = "off" if cfg.host_experts == "auto" else cfg.host_experts
    # a warning: the server shows the engine's warnings in its log (its INFO lines are debug there)
    log.warning("%s: the expert tiers, sized from what is left (%.2f GiB): --expert-cache %d "
                "(%.2f GiB) --resident-budget-gib %.2f --host-experts %s (misses read by %d "
                "threads into the cache, not faulted in through the file's map); the rest stays "
                "free for the page cache. Give any of these flags to choose yourself", where,
                room / GiB, slots, slots * one / GiB, budget, host, cfg.pool_workers)
    return replace(cfg, expert_cache=slots, resident_budget_gib=budget, host_experts=host)
