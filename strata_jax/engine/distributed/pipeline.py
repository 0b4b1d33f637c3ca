"""--split layers: the model's layers in contiguous runs over N devices of one host, a window as a
chain of stage programs (devices.py decides the split and refuses what cannot combine with it).

Stage s on device s holds its run of layers (their weights, experts included, and their KV:
KVCache's per-stage arrays), the first stage also the embedding, the last the final norm and the
output head. A window runs stage 0's program (embedding, its layers), hands its hidden states [R, L,
h] per group to device 1 (jax.device_put), runs stage 1's, ..., and the last stage gives the logits.
The groups' tokens, positions and slots go to every stage (each writes its own layers' KV). Each
stage's program is forward()'s own code (embed_stage, decoder_layer, head_stage) with the stage's
local layer index into its own KV arrays, so the logits are the same bits as one device's.

Programs: one ProgramCache a device, each with its own device-memory ledger (the stage's weights and
KV reserved in it), its own bound (--max-programs) and its own out-of-memory halving: a device that
runs out frees its own programs. StagePrograms gives the runner and the engine the one cache's
interface over them (a window's layout is ready when every stage's program is).

What overlaps: a window is cut into micro-batches (micro_batches.py: its rows, or its groups, in up
to --micro-batches parts, each part's layout one the warm-up already builds), and the host
dispatches stage 0's program on every part, then stage 1's on every part, ... without waiting (JAX
dispatch is asynchronous; each device runs its programs in the order given, the donated KV chaining
a stage's parts). So device s+1 runs part p while device s runs part p+1. The engine still plans the
next window only after this one's tokens are sampled (a decode row's next token is this window's),
so windows do not overlap: a window of one row (one request decoding) runs its stages in turn
(docs/DISTRIBUTED.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from ...experts.profile import ExpertProfile
from ...model import Group
from ...model.transformer import decoder_layer, embed_stage, head_stage
from ..execute.executors import Forward, all_on_device
from ..execute.kv_cache import KVCache, kv_bytes
from ..execute.memory import MemoryLedger
from ..execute.programs import Layout, ProgramCache
from .micro_batches import Cut, cut, join, part_inputs


def stage_bounds(n_layers: int, n: int) -> list[tuple[int, int]]:
    """n contiguous runs of layers [start, end), as even as can be (the first ones one longer)."""
    at, out = 0, []
    for s in range(n):
        size = n_layers // n + (s < n_layers % n)
        out.append((at, at + size))
        at += size
    return out


def stage_spec(spec, a: int, b: int):
    """spec as a stage holding layers [a, b) sees it: its layers only, numbered from 0 (gpt-oss's
    sliding-window layers among them, so its rings hold those: spec.ring_layers, kv_layer), with no
    NextN (MTP) layers (the mtp drafter does not combine with the split)."""
    return replace(spec, n_layers=b - a, n_nextn=0, layer_kinds=spec.layer_kinds[a:b],
                   swa_layers=tuple(i - a for i in spec.swa_layers if a <= i < b))


def stage_kv(spec, devices: list) -> list:
    """KVCache's stages: [(a stage's spec: stage_spec, its device)]."""
    return [(stage_spec(spec, a, b), d)
            for (a, b), d in zip(stage_bounds(spec.n_layers, len(devices)), devices)]


class Pipeline:
    # its stages' windows are not taken ahead of their turn (run_ahead.py)
    runs_ahead = False

    def __init__(self, params: dict, spec, opts, devices: list, kv: KVCache, cfg, kv_dtype,
                 device_len: int, faults, rows_alone: bool = False):
        """rows_alone: every row is computed alone (ModelRunner.min_rows = 1, and not deepseek2's
        MLA: runner.py), so a window's rows may be cut."""
        self.spec, self.opts, self.devices, self.kv = spec, opts, devices, kv
        n = len(devices)
        self.rows_alone = rows_alone
        self.micro_batches = micro_batches_of(cfg.micro_batches, n, devices[0].platform)
        self._cuts: dict[Layout, Cut] = {}
        # a test's probe: called with (stage, part, that program's outputs) as each is dispatched
        self.on_dispatch: Callable[[int, int, list], None] | None = None
        self.bounds = stage_bounds(spec.n_layers, n)
        self.params, caches = [], []
        for s, ((a, b), dev) in enumerate(zip(self.bounds, devices)):
            p = {"layers": params["layers"][a:b]}
            if s == 0:
                p["embed"] = params["embed"]
            if s == n - 1:
                p["norm"], p["output"] = params["norm"], params["output"]
            p = jax.device_put(p, dev)
            self.params.append(p)
            ledger = MemoryLedger(cfg.device_memory_mib, cfg.vram_reserve_mib)      # this device's
            ledger.reserve_bytes("weights",
                                 sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(p)),
                                 f"stage {s}'s weights (layers {a}..{b - 1}) on {dev}")
            ledger.reserve_bytes("kv", kv_bytes(stage_spec(spec, a, b), kv_dtype, cfg.parallel,
                                                device_len, ring=kv.ring),
                                 f"stage {s}'s KV cache on {dev}")
            caches.append(ProgramCache(lambda lay, s=s: self._build(lay, s), ledger,
                                       cfg.max_programs, kv.wait, faults))
        self.programs = StagePrograms(caches)

    def cut(self, layout: Layout) -> Cut:
        if layout not in self._cuts:
            self._cuts[layout] = cut(layout, self.micro_batches, self.rows_alone)
        return self._cuts[layout]

    def layouts(self, layout: Layout) -> list[Layout]:
        """The programs (on every stage) a window of `layout` runs: its parts' layouts."""
        return list(dict.fromkeys(self.cut(layout).parts))

    def forward(self, groups: list, layout: Layout) -> Forward:
        """The executor's run (executors.py): the stages keep no hidden states for a drafter."""
        return self.run(groups, layout), None

    def expert_profile(self) -> ExpertProfile:
        raise ValueError("the expert profile is not counted with --split layers"
                         if self.spec.is_moe else
                         "this model has no experts: there is no expert profile to write")

    def expert_stats(self) -> dict:
        return all_on_device(self.spec)

    def close(self) -> None:
        pass                      # the stages' program caches close with the runner's programs

    def run(self, groups: list, layout: Layout) -> list[jax.Array]:
        """One window through every stage -> logits per group (on the last device). Stage-major
        order: every part through stage 0, then every part through stage 1, ...; nothing here waits
        for a device."""
        c = self.cut(layout)
        args, orders = part_inputs(c, groups)
        xs: list[list] = [[] for _ in c.parts]
        for s, cache in enumerate(self.programs.caches):
            for p, lay in enumerate(c.parts):
                # hidden states, to device s
                ins = list(jax.device_put(xs[p], self.devices[s])) if s else []

                def step(cs, s=s, cache=cache, ins=ins, lay=lay, a=args[p]):
                    out, kv = cache.run(lay, self.params[s], cs[s], *ins, *a)
                    return out, cs[:s] + (kv,) + cs[s + 1:]
                xs[p] = self.kv.through(step)
                if self.on_dispatch is not None:
                    self.on_dispatch(s, p, xs[p])
        return join(c, xs, orders)

    def _build(self, layout: Layout, s: int):
        """Stage s's program for `layout`: (its weights, its KV, [hidden states per group,] the
        groups' arrays) -> (hidden states per group, or logits on the last stage; its KV)."""
        spec, opts, n_groups = self.spec, self.opts, len(layout.groups)
        first, last = s == 0, s == len(self.devices) - 1
        local = stage_spec(spec, *self.bounds[s])

        def stage(p, cache, *flat):
            xs, flat = ([], flat) if first else (list(flat[:n_groups]), flat[n_groups:])
            groups, at = [], 0
            for _, _, all_logits, picks in layout.groups:
                groups.append(Group(*flat[at:at + 3], all_logits, flat[at + 3] if picks else None))
                at += 4 if picks else 3
            groups = tuple(groups)
            if first:
                xs = embed_stage(p, opts, tuple(g.tokens for g in groups))
            # the layer's index in this stage's KV arrays (or its rings: gpt-oss's sliding-window
            # layers count apart, stage_spec)
            for j, lp in enumerate(p["layers"]):
                xs, cache = decoder_layer(lp, local.kv_layer(j), spec, opts, groups, xs, cache,
                                          layout.kv_len)
            return (head_stage(p, spec, opts, groups, xs) if last else xs), cache

        here = SingleDeviceSharding(self.devices[s])
        S, i32, h = jax.ShapeDtypeStruct, jnp.int32, spec.hidden
        ins = ([] if first else [S((r, t, h), jnp.dtype(opts.dtype), sharding=here)
                                 for r, t, _, _ in layout.groups])
        for rows, length, _, picks in layout.groups:
            ins += [S((rows, length), i32, sharding=here), S((rows, length), i32, sharding=here),
                    S((rows,), i32, sharding=here)] + [S((picks,), i32,
                                                         sharding=here)] * bool(picks)

        def shape(a):
            return S(a.shape, a.dtype, sharding=here)
        tree = jax.tree_util.tree_map(shape, (self.params[s], self.kv.arrays[s]))
        return jax.jit(stage, donate_argnums=(1,)).lower(*tree, *ins).compile()


def micro_batches_of(setting: int | str, stages: int, platform: str) -> int:
    """--micro-batches: a number of parts, or auto: 1 on CPU devices (forced CPU devices share the
    host's cores, and every M > 1 measured slower on a 2-core machine: the stages' kernel calls
    contend for the same cores and each part reads the stage's weights again; docs/DISTRIBUTED.md),
    else one part a stage (devices with compute of their own; not measured here)."""
    if setting != "auto":
        return int(setting)
    return 1 if platform == "cpu" else stages


class StagePrograms:
    """The program cache's interface over one ProgramCache a device: a layout is ready, queued or
    refused when any stage's is; building and collecting go to every stage."""

    def __init__(self, caches: list[ProgramCache]):
        self.caches = caches

    def __len__(self) -> int:
        return sum(len(c) for c in self.caches)

    @property
    def faults(self):
        return self.caches[0].faults

    def use_faults(self, faults) -> None:
        for c in self.caches:
            c.use_faults(faults)

    @property
    def pending(self) -> int:
        return sum(c.pending for c in self.caches)

    def collect(self) -> int:
        return sum(c.collect() for c in self.caches)

    def ready(self, layout: Layout) -> bool:
        return all(c.ready(layout) for c in self.caches)

    def queued(self, layout: Layout) -> bool:
        return any(c.queued(layout) for c in self.caches)

    def refused(self, layout: Layout) -> bool:
        return any(c.refused(layout) for c in self.caches)

    def hurry(self, layout: Layout) -> None:
        for c in self.caches:
            c.hurry(layout)

    def build_later(self, layout: Layout) -> None:
        for c in self.caches:
            c.build_later(layout)

    def get(self, layout: Layout) -> list:
        return [c.get(layout) for c in self.caches]

    def clear(self) -> None:
        for c in self.caches:
            c.clear()

    def close(self) -> None:
        for c in self.caches:
            c.close()

    def snapshot(self) -> dict:
        """The stages' counters summed (lists joined), and each device's own under "devices"."""
        snaps = [c.snapshot() for c in self.caches]
        out = {k: ([x for s in snaps for x in s[k]] if isinstance(v, list) else
                   v if k == "max" else sum(s[k] for s in snaps)) for k, v in snaps[0].items()}
        return out | {"devices": snaps}
