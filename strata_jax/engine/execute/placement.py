"""Where a MoE model's routed experts live, decided once at start: all on the device when they fit
beside the weights, the KV cache, the largest window's temporary memory and the reserve (one program
a window), else a device cache of expert slots fed by host RAM and the file (experts/: the arena,
the host tier, the file's blocks), with the options around it: experts computed where they live
(--host-experts, experts/hybrid.py), misses read over the link (--pcie-frac, experts/stream.py), an
expert profile's hottest pinned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

from ...config import ConfigError, EngineConfig
from ...experts import EXPERT_TENSORS, ExpertArena, HostTier, expert_tensors, slot_bytes
from ...experts.host import aligned_copy
from ...experts.hybrid import HostRule, host_device, host_rate, link_rate, memcpy_rate
from ...experts.profile import ExpertProfile, pins_for
from ...experts.stream import ExpertStream
from ...gguf import GGUFModel
from ...model import expert_tensor_bytes, load_experts
from ...model.weights import QTensor, blocks_in_place, copied_bytes, release_file_pages
from ..faults import resource_exhausted
from .memory import MemoryLedger
from .programs import MIN_PROGRAM_BYTES

log = logging.getLogger("strata_jax.engine")


@dataclass
class Tiers:
    """place_experts' decision: "device" (every expert loaded into the weights) or "arena" (the
    parts of the layer stepper: engine/execute/stepped.py)."""
    mode: str
    arena: ExpertArena | None = None
    qtypes: dict | None = None
    shapes: dict | None = None
    # every expert's blocks on the CPU device that computes misses that device, when it is not the
    # device itself
    host_trees: dict | None = None
    remote: Any = None
    rule: HostRule | None = None
    stream: ExpertStream | None = None


def place_experts(model: GGUFModel, params: dict, cfg: EngineConfig, choices: dict,
                  ledger: MemoryLedger, temp: int, shards: int = 1) -> Tiers:
    """--expert-cache auto: every expert on the device when they fit beside the weights, the KV
    cache, the largest window's temporary memory and the reserve (today's one-program path);
    otherwise, or with an explicit number of slots, a device arena of that many expert slots a
    layer. shards: devices the experts are split over (--split experts: a device holds E/N of them,
    and the ledger is a device's)."""
    spec, mode, dtype, policy = model.spec, choices["weights"], choices["dtype"], cfg.expert_policy
    all_bytes = expert_tensor_bytes(model, mode, dtype) // shards
    free = ledger.free
    if shards > 1 and free is not None and all_bytes + temp > free:
        raise ConfigError(f"split = experts over {shards} devices: a device's "
                          f"{spec.n_experts // shards} experts of every layer "
                          f"({all_bytes / 2**20:.1f} MiB) and the largest window "
                          f"({temp / 2**20:.1f} MiB) do not fit its {free / 2**20:.1f} MiB free; "
                          "the expert tiers do not combine with the split: use more devices")
    # dense layers among them (GLM-4.5's first ones) keep their FFN
    layers = list(spec.moe_layers)
    # Layers may differ in quant type (Q4_K_M files give some layers' ffn_down_exps Q6_K): the
    # arena's leaf shapes, quant types and conversion are per layer.
    infos = {i: expert_tensors(model, i) for i in layers}       # layer -> tensor -> GGUF TensorInfo
    budget = None if cfg.resident_budget_gib is None else int(cfg.resident_budget_gib * (1 << 30))
    dev, where = _host_device(cfg, choices)
    # The host tier's experts packed (see _host_tree): with host experts, packed weights, every
    # expert in host RAM (no budget) and no --pcie-frac (its reads are the GPU's)
    pack_host = dev is not None and bool(choices.get("pack")) and host_tier_holds_all(cfg)
    if mode == "dequantized":
        jdt = jnp.dtype(dtype)
        # stored [k, n]
        leaf_shapes = {i: {n: ((t.shape[2], t.shape[1]), jdt) for n, t in ts.items()}
                       for i, ts in infos.items()}
        qtypes = {i: dict.fromkeys(EXPERT_TENSORS) for i in layers}

        def to_arena(layer: int, name: str, blocks: np.ndarray):
            t = infos[layer][name]          # as to_device does at load: dequantize, cast, transpose
            vals = pk.dequantize(blocks, t.qtype).reshape(blocks.shape[0],
                                                          *t.shape[1:]).astype(dtype)
            return jnp.swapaxes(vals, -1, -2).copy()
    else:
        # On the cpu backend's int8 math the cache slots hold their experts packed
        # (pallas_kernels/cpu/packed.h: the expert kernel reads them twice as fast), packed as they
        # are copied in, or copied as they are when the host tier holds them packed already
        # (pack_host); the file tier keeps the GGUF blocks. Not with --pcie-frac (its reads are the
        # GPU's).
        def packed(t) -> bool:
            return choices["pack"] and cfg.pcie_frac == 0 and pk.packs(t.qtype)

        leaf_shapes = {i: {n: (t.data.shape[1:], jnp.uint8) for n, t in ts.items()}
                       for i, ts in infos.items()}
        qtypes = {i: {n: t.qtype.name + (pk.PACKED_SUFFIX if packed(t) else "")
                      for n, t in ts.items()}
                  for i, ts in infos.items()}

        def to_arena(layer: int, name: str, blocks: np.ndarray):
            # the update program takes the host array (converted in C++, no Python device_put)
            t = infos[layer][name]
            return pk.pack(blocks, t.qtype) if packed(t) and not pack_host else blocks
    one_slot = slot_bytes(leaf_shapes)     # one expert slot in every MoE layer
    if cfg.expert_cache == "auto":
        if free is None or all_bytes + temp <= free:
            load_experts(model, params, mode, dtype, pack=choices["pack"])
            ledger.reserve_bytes("experts", all_bytes,
                                 "every expert on the device" if shards == 1 else "a device's "
                                 f"{spec.n_experts // shards} experts of every layer")
            # checked all the same: a bad file is an error, not a surprise
            if cfg.expert_profile:
                ExpertProfile.load(cfg.expert_profile, spec)
                log.info("expert profile %s: every expert is on the device, nothing to pin",
                         cfg.expert_profile)
            if cfg.pcie_frac > 0:
                log.info("--pcie-frac %g: every expert is on the device, nothing is read over the "
                         "link", cfg.pcie_frac)
            return Tiers("device")
        # A layer-stepped window runs 4 programs, each reserved at no less than MIN_PROGRAM_BYTES:
        # leave room for a few windows' worth of them.
        temp = max(temp, 16 * MIN_PROGRAM_BYTES)
        n_slots = (free - temp) // one_slot
        if n_slots < 1:
            raise _no_room(all_bytes, temp, free)
        log.info("the experts (%.1f MiB) do not fit on the device: %d expert slots a layer in the "
                 "device cache", all_bytes / 2**20, min(n_slots, spec.n_experts))
    else:
        n_slots = int(cfg.expert_cache)
        if n_slots < 1:
            raise ValueError("expert_cache = 0: the device cache needs at least 1 expert slot a "
                             "layer (or auto)")
    profile = ExpertProfile.load(cfg.expert_profile, spec, layers) if cfg.expert_profile else None
    shapes = {i: {n: tuple(t.shape[1:]) for n, t in ts.items()} for i, ts in infos.items()}
    host_trees = rule = in_ram = None
    if dev is not None and budget is not None and not pack_host:
        in_ram = _whole_layers_in_ram(infos, layers, budget)
    if dev is not None and not pack_host:
        dev, where = _unless_copied(cfg, infos, in_ram, dev, where)
    if dev is not None:
        # every expert of a layer on the CPU device that computes a layer's missed experts
        # (--host-experts, experts/hybrid.py): packed (pack_host), else GGUF blocks: the layers
        # the RAM budget holds whole from their RAM copy, the others the file's own
        host_trees = {i: {n: _host_tree(t, (spec.n_experts, *shapes[i][n]), dev, pack_host,
                                        (in_ram or {}).get(i, {}).get(n))
                          for n, t in ts.items()}
                      for i, ts in infos.items()}
    # the host tier's RAM copies are these packed experts themselves, not a second copy
    if pack_host:
        in_ram = {i: {n: np.asarray(w.data) for n, w in ts.items()} for i, ts in host_trees.items()}
        log.info("host experts: the host tier's experts packed for the int8 products (%.1f MiB, in "
                 "place of the host tier's copies of the file's blocks; --weights blocks keeps the "
                 "blocks)", sum(a.nbytes for ts in in_ram.values() for a in ts.values()) / 2**20)
    host = HostTier(model, layers, budget, cfg.pool_workers, in_ram)
    if in_ram is not None and not pack_host:
        for i in in_ram:                               # held once: in RAM, not also in the cache
            host.forget_file_pages(i, spec.n_experts)
    arena = ExpertArena(host, n_slots, to_arena, leaf_shapes, policy)
    if profile is not None:              # preload and pin each layer's hottest experts
        for i in layers:
            arena.pin(i, profile.hottest(i, pins_for(arena.n_slots)))
        log.info("expert profile %s: %d experts pinned in the device cache (up to %d of %d slots a "
                 "layer)",
                 cfg.expert_profile, sum(len(p) for p in arena.pinned.values()),
                 pins_for(arena.n_slots), arena.n_slots)
    ledger.reserve_bytes("experts", arena.nbytes,
                         f"the device expert cache ({arena.n_slots} slots a layer)")
    if dev is not None:
        rule = _host_rule(cfg, spec, where, infos, host_trees, dev)
    stream = None
    # --pcie-frac: the device reads some misses from pinned host memory
    if cfg.pcie_frac > 0:
        stream = ExpertStream(host, cfg.pcie_frac, to_arena, jax.devices()[0])
        log.info("--pcie-frac %g: up to %d of a layer's routed experts a window are read from "
                 "pinned host memory, not copied into the device cache (the coldest misses first)",
                 cfg.pcie_frac, stream.slots)
    log.info("expert tiers: %d of %d experts a layer on the device (%s policy), %.2f GiB of %.2f "
             "GiB in host RAM, the rest read from the file by %d threads", arena.n_slots,
             spec.n_experts, policy, host.resident_bytes / 2**30, host.total_bytes / 2**30,
             cfg.pool_workers)
    return Tiers("arena", arena, qtypes, shapes, host_trees, dev if where == "remote" else None,
                 rule, stream)


def host_tier_holds_all(cfg: EngineConfig) -> bool:
    """Whether the host tier holds every expert in RAM, where the host path packs them all (with
    host experts and packed weights): no --resident-budget-gib, no --pcie-frac (its reads are the
    GPU's). The start check (runner._host_needs) counts those packed copies by the same rule."""
    return cfg.resident_budget_gib is None and cfg.pcie_frac == 0


def _whole_layers_in_ram(infos: dict, layers: list[int], budget: int) -> dict:
    """--resident-budget-gib with host experts: the layers the budget holds whole (0, 1, ... as far
    as it goes), each as one contiguous copy of its expert tensors (64-byte aligned: the host device
    uses it in place) -> layer -> name -> [E, rows, row_bytes] blocks, for the RAM tier and the host
    path both. The host path computes a layer's misses from its host tree, which would otherwise be
    the file's pages: the tier's copies of the same experts (an array an expert) then served only
    the device cache's copy-ins, while the host path read the file again (the tier drops the pages
    it copied), so the budget held those layers twice (the 37 GB model's ladder, session 28: 0 of
    4,169 host computations from the RAM tier). What is left of the budget after the whole layers
    the tier fills expert by expert as before (for copy-ins)."""
    out, used = {}, 0
    for i in layers:
        size = sum(int(t.data.nbytes) for t in infos[i].values())
        if used + size > budget:
            break
        out[i] = {n: aligned_copy(t.data) for n, t in infos[i].items()}
        used += size
    if out:
        log.info("host experts: the RAM tier holds layers %d-%d whole (%.2f GiB), which the host "
                 "path computes from; the other layers' experts from the file", min(out),
                 max(out), used / 2**30)
    return out


def _host_tree(info, shape: tuple[int, ...], dev, pack: bool,
               ram: np.ndarray | None = None) -> QTensor:
    """One expert tensor of every expert on the host device. Packed (cpu/packed.h, the same bits)
    when the weights are packed and the host tier holds every expert in RAM (no
    --resident-budget-gib: a budget means the rest stays in the file): a miss then costs what a hit
    costs, where from GGUF blocks it cost ~1.5x a byte (docs/BENCHMARKS.md, issue 33 session 18;
    KTransformers repacks its CPU experts the same way). Else GGUF blocks: `ram`, the RAM tier's
    copy of a layer the budget holds whole, or the file's blocks in place (on a CPU device its mmap
    pages, no copy)."""
    if pack and pk.packs(info.qtype):
        # 64-byte aligned: used in place, no copy
        packed = jax.device_put(pk.pack(info.data, info.qtype), dev)
        release_file_pages(info.data)       # read once to pack: not held twice
        return QTensor(packed, info.qtype.name + pk.PACKED_SUFFIX, shape)
    return QTensor(blocks_in_place(info.data if ram is None else ram, dev), info.qtype.name, shape)


def _unless_copied(cfg: EngineConfig, infos: dict, in_ram: dict | None, dev, where):
    """(dev, where), or (None, None) when the host path would hold a copy of the file's experts: it
    reads the layers RAM does not hold from the file's map, in place only at a 64-byte boundary,
    and a GGUF file aligns its tensors to 32 (a model larger than RAM was OOM-killed so: 34 GiB
    copied). Misses are then read into the device cache instead, within its size."""
    off = copied_bytes(t for i, ts in infos.items() if i not in (in_ram or {})
                       for t in ts.values())
    if not off:
        return dev, where
    why = (f"{off:,} B ({off / 2**30:.2f} GiB) of the file's experts do not start at a 64-byte "
           "boundary (the file aligns its tensors to 32 bytes), and the host path could read them "
           "only as a copy in RAM")
    if cfg.host_experts == "on":
        raise ConfigError(f"host_experts = on: {why}: use --host-experts off (misses are read into "
                          "the device expert cache) or a file written with 64-byte alignment")
    log.warning("host experts off: %s; a layer's misses are read into the device expert cache "
                "instead", why)
    return None, None


def _host_device(cfg: EngineConfig, choices: dict):
    """--host-experts / --host-device -> (the CPU device that computes missed experts, "local" |
    "remote"), or (None, None) (experts/hybrid.py)."""
    able_local = pk.is_cpu(choices["backend"]) and choices["weights"] == "blocks"
    return host_device(cfg.host_experts, cfg.host_device, jax.devices()[0],
                       able_local and jax.default_backend() == "cpu", pk.cpu.available())

def _host_rule(cfg: EngineConfig, spec, where: str, infos: dict, host_trees: dict, dev) -> HostRule:
    """The cost rule between copying a miss in and computing it on the host, measured now and
    printed."""
    first = next(iter(infos))
    one = np.asarray(infos[first]["exp_gate"].data[0])          # one expert's gate blocks
    if where == "local":
        # the device cache is host RAM here and the host computes at the device's own rate: the host
        # wins whenever a layer misses (every miss in place, inside the window's one program)
        rule = HostRule(memcpy_rate(one), float("inf"), force=True)
        log.info("host experts: a layer with a device-cache miss computes its experts from the "
                 "host tier's blocks in place. The cost rule: a miss costs its copy (%.1f MiB at "
                 "%.1f GB/s, measured memcpy: the device cache is host RAM here) and the host "
                 "computes at the device's own rate, so the host wins whenever a layer misses",
                 one.nbytes * 3 / 2**20, rule.link_gbs)
        return rule
    rule = HostRule(link_rate(one, jax.devices()[0]), host_rate(host_trees[first], spec, dev,
                                                               pk.cpu_backend(cfg.cpu_math)),
                    force=cfg.host_experts == "on")
    log.info("host experts on %s beside %s: %s", dev, jax.devices()[0], rule.describe())
    return rule


def largest_window_temp_bytes(spec, cfg: EngineConfig, choices: dict, opts, cache_len: int,
                              device_len: int) -> int:
    """An estimate of the largest window's temporary device memory (decode rows of every slot plus
    one prompt chunk): activations, the attended keys and values, logits, and every tile's expert
    weights as floats. The program cache reserves the real figure (memory_analysis) when it
    builds."""
    s = spec
    # decode rows of every slot plus prompt chunks, one a reading slot, as many as the budget holds
    prompt = min(int(choices["batch_tokens"]), cfg.parallel * int(choices["prefill"]))
    rows = cfg.parallel + min(cfg.parallel, max(1, prompt // 16))
    tokens = cfg.parallel + prompt
    k = max(s.n_experts_used, 1)
    # a row's last token; a verify row's every token
    logit_rows = rows + cfg.parallel * cfg.spec
    act = ((tokens * (8 * s.hidden + 3 * k * (s.expert_ffn or s.ffn))
            + logit_rows * s.vocab_size) * 4)
    attn = (rows * min(cache_len, device_len + opts.attn_chunk) * s.n_kv_heads
            * (s.head_dim + s.value_dim) * 4)
    tiles = 0
    if pk.is_cpu(opts.backend) and choices["weights"] == "blocks":
        # its kernels read the cache and the experts' blocks where they lie: no copies of them
        return act
    # each tile's expert weights, gathered (float) or dequantized (blocks), gate/up/down
    if s.is_moe:
        n_tiles = -(-tokens * k // pk.expert_tile(opts.backend)) + min(s.n_experts, tokens * k)
        tiles = n_tiles * 3 * (s.expert_ffn or s.ffn) * s.hidden * 4
    return act + attn + tiles


def _no_room(all_bytes: int, temp: int, free: int):
    return resource_exhausted(
        f"no device memory for even one expert slot a layer: {free / 2**20:.1f} MiB free after the "
        f"weights and the KV cache, {temp / 2**20:.1f} MiB needed for the largest window (every "
        f"expert: {all_bytes / 2**20:.1f} MiB); lower --parallel, --max-context or "
        "--vram-reserve-mib")
