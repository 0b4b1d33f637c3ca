"""Several devices of one host (--devices N, --split experts|layers): which split, the checks that
refuse what cannot work, and the experts split's mesh (ExpertShards). The layers split's stages are
pipeline.py's.

--split experts: every routed expert is on the devices, E/N a device (a contiguous run of expert ids
on each), and every other weight, the KV cache and the window's inputs are replicated. A window is
ONE program over all N devices (jax.shard_map over a 1-D mesh, axis "experts"): every device runs
the whole window (embedding, attention over its own replica of the KV, routers, head); at each MoE
layer it computes only the routed rows whose expert it holds, and one psum of the layer's [tokens,
k, hidden] float32 expert rows gives every device all of them (model/layers.py sharded_expert_rows).
One device gives each row and the others exact zeros, so the logits are the same bits as on one
device.

Per device, memory is the same on each: the weights but the experts, E/N of the experts, the whole
KV cache, and each program's per-device part (`memory_analysis()` of an SPMD program is per device).
So the one device-memory ledger stands for every device, and the program cache's bound and its
out-of-memory halving apply to each device alike (a program's executable lives on all N).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...config import ConfigError, EngineConfig
from ..execute.memory import MemoryLedger

AXIS = "experts"
FORCE = "XLA_FLAGS=--xla_force_host_platform_device_count={n}"


def resolve_split(cfg: EngineConfig, spec) -> str:
    """"none" (one device), "experts" or "layers"; auto: experts for a MoE model, else layers."""
    if cfg.devices == 1:
        return "none"
    if cfg.split != "auto":
        return cfg.split
    return "experts" if spec.is_moe else "layers"


def devices_for(cfg: EngineConfig, spec, split: str) -> list[jax.Device]:
    """The first cfg.devices devices JAX sees, after refusing what the split cannot do
    (ConfigError)."""
    n, have = cfg.devices, jax.devices()
    if n > len(have):
        hint = (f"; on a CPU, start Python with {FORCE.format(n=n)} (set before JAX is imported)"
                if have[0].platform == "cpu" else "")
        raise ConfigError(f"devices = {n}: JAX sees {len(have)} {have[0].platform} device(s){hint}")
    refused = _refused(cfg, spec, split)
    if refused:
        raise ConfigError(f"split = {split} with devices = {n}: {refused}")
    return list(have[:n])


def _refused(cfg: EngineConfig, spec, split: str) -> str | None:
    """Why `split` cannot run with this config, or None. These combinations would need each feature
    taught about the split first; refused rather than run wrong (docs/DISTRIBUTED.md lists them)."""
    if split == "experts":
        if not spec.is_moe:
            return "the model has no experts to split (use --split layers)"
        if spec.n_experts % cfg.devices:
            return (f"the model's {spec.n_experts} experts do not divide over {cfg.devices} "
                    "devices (each device holds E/N of them): use a device count that divides "
                    f"{spec.n_experts}")
    if spec.is_moe and cfg.expert_cache != "auto":
        return (f"expert_cache = {cfg.expert_cache}: the split keeps every expert on the devices; "
                "the expert tiers (a device arena) do not combine with it")
    if split == "layers" and cfg.devices > spec.n_layers:
        return f"the model has {spec.n_layers} layers, fewer than the {cfg.devices} stages"
    if cfg.kv_resident is not None:
        return (f"kv_resident = {cfg.kv_resident}: host-RAM KV does not combine with several "
                "devices yet")
    if cfg.spec > 0 and (cfg.drafter == "mtp" or cfg.drafter.startswith("draft:")):
        return f"drafter = {cfg.drafter}: only the ngram drafter combines with several devices"
    return None


def ledger_for(cfg: EngineConfig, split: str, n: int) -> MemoryLedger:
    """The runner's device-memory ledger. One device, or --split experts: a device's (every device
    holds the same). --split layers: the runner's ledger (the whole model's weights and KV) stands
    for all n devices together, n times one device's budget and reserve; each device's own ledger is
    the pipeline's, and its stage's weights, KV and programs are reserved there."""
    ledger = MemoryLedger(cfg.device_memory_mib, cfg.vram_reserve_mib)
    if split == "layers":
        ledger.budget = ledger.budget * n if ledger.budget else None
        ledger.reserve *= n
    return ledger


@dataclass(frozen=True)
class ExpertShards:
    """The experts split's 1-D mesh: where each array lives and how a window program is wrapped."""
    mesh: Mesh

    @classmethod
    def over(cls, devices: list[jax.Device]) -> ExpertShards:
        return cls(Mesh(np.array(devices), (AXIS,)))

    @property
    def n(self) -> int:
        return self.mesh.devices.size

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def specs(self, params: dict):
        """params -> the same tree of PartitionSpecs: the routed experts' leaves split on their
        leading (expert) axis, every other leaf replicated."""
        def spec(path, _leaf):
            return P(AXIS) if any(getattr(k, "name", None) == "experts" for k in path) else P()
        return jax.tree_util.tree_map_with_path(spec, params)

    def place(self, params: dict) -> dict:
        """The weights onto the mesh: E/N experts a device, the rest on every device."""
        shardings = jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s),
                                           self.specs(params), is_leaf=lambda x: isinstance(x, P))
        return jax.device_put(params, shardings)

    def replicate(self, tree):
        return jax.device_put(tree, self.replicated)

    def wrap(self, fn, params: dict, n_rest: int):
        """fn(weights, *rest) as one program over the mesh, weights being params' leaves as one flat
        list (window_program.py): split as `specs`, the n_rest other
        inputs (the KV cache, counts, the groups' arrays) and every output replicated. check_vma is
        off: the cpu kernels' custom calls carry no replication types, and every output is
        replicated by construction (computed from replicated inputs and the psum'd expert rows)."""
        weights = jax.tree_util.tree_structure(params).flatten_up_to(self.specs(params))
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(weights,) + (P(),) * n_rest,
                             out_specs=P(), check_vma=False)

    def shapes(self, tree, sharding: NamedSharding | None = None):
        """Arrays or ShapeDtypeStructs -> ShapeDtypeStructs with their sharding on the mesh (their
        own, or `sharding`): what lowering a program over the mesh needs."""
        def one(a):
            if not hasattr(a, "dtype"):
                return a
            s = sharding or getattr(a, "sharding", None) or self.replicated
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        return jax.tree_util.tree_map(one, tree)
