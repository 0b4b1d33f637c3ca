"""The model runner: weights and the slots' KV cache on the device, and the programs that run
windows.

A window is a few groups of rows (decode rows, one prefill chunk); `run` takes numpy arrays for each
group, picks the program for the window's layout from the program cache (building it if needed), and
returns each group's sampled tokens. The KV cache is donated to every program and updated in place.

The runner makes the parts and hands each its own dependencies: the machine's choices (choices.py),
the KVCache (kv_cache.py), the program cache (programs.py, where each part registers the builder of
its stages), the layouts (layouts.py) and the executor of the engine's mode, chosen once here and
asked everything that differs between modes (execute/executors.py: whole windows on one device or an
expert mesh, the expert tiers' LayerStepper, the pipeline's stages, a process group's leader); a
window's groups get their answers from their logits in answers.py. None of them holds the runner.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import jax
import numpy as np

import pallas_kernels as pk

from ..config import ConfigError, EngineConfig
from ..experts.profile import ExpertProfile
from ..gguf import GGUFModel
from ..model import RunOptions, load_nextn_experts, load_params
from ..model.transformer import ring_size
from ..model.weights import copied_bytes
from .choices import KV_DTYPES, packable, resolve
from .distributed.devices import (
    AXIS,
    ExpertShards,
    devices_for,
    ledger_for,
    resolve_split,
)
from .distributed.lockstep import GroupWindows, Leader, over_processes
from .distributed.pipeline import Pipeline, stage_kv
from .execute.answers import GroupAnswers
from .execute.embeddings import Embedder
from .execute.executors import Executor, SteppedWindows, WholeWindows
from .execute.kv_cache import KVCache, kv_bytes
from .execute.kv_host import KVHostStore
from .execute.layouts import GroupInput, WindowLayouts, decode_only, verify_only
from .execute.placement import host_tier_holds_all, largest_window_temp_bytes, place_experts
from .execute.programs import Layout, ProgramCache
from .execute.run_ahead import RunAhead
from .execute.stepped import LayerStepper
from .execute.tier_sizes import slot_bytes_all_layers, tiers_for_memory
from .families import is_hybrid, keeps_state
from .faults import Faults
from .host_memory import HostNeeds, budget_items, memory_limit

log = logging.getLogger("strata_jax.engine")


class ModelRunner:
    def __init__(self, model: GGUFModel, cfg: EngineConfig, progress: bool = False):
        self.spec = model.spec
        self.cfg = cfg
        self.choices = resolve(cfg, model)
        chunk = cfg.attention_chunk()
        self.opts = RunOptions(dtype=self.choices["dtype"], backend=self.choices["backend"],
                               attn_chunk=chunk, host_backend=pk.cpu_backend(cfg.cpu_math))
        # --devices N (devices.py): "none", one device as before; "experts", each window one program
        # over a mesh whose devices hold E/N experts each; "layers", a chain of stage programs
        # (pipeline.py)
        self.split = resolve_split(cfg, self.spec)
        devs = devices_for(cfg, self.spec, self.split) if self.split != "none" else []
        # --num-processes N (hosts.py): the experts split over every process's devices, process 0
        # leading the others in lockstep; group: the leader's channel (lockstep.py), None in one
        # process and in followers
        self.group: Leader | None = None
        if cfg.num_processes > 1:
            self.split, (devs, self.group) = "experts", over_processes(cfg, self.spec)
        self.shards = ExpertShards.over(devs) if self.split == "experts" else None
        if self.shards is not None:
            self.opts = replace(self.opts, expert_axis=AXIS)
        # The smallest row bucket of decode and verify windows. XLA's dot takes another path for one
        # row than for 2..32 (DESIGN.md, Batch invariance), so a lone row is padded to two. With
        # blocks on the cpu backend every product, the attention and the router run in its kernels,
        # whose rows are independent of each other: a lone row runs alone (SmolLM2's decode step:
        # ~25% less work).
        self.min_rows = (1 if pk.is_cpu(self.choices["backend"])
                         and self.choices["weights"] == "blocks" else 2)
        self.cache_len = -(-cfg.max_context // chunk) * chunk       # positions a slot's cache holds
        # --kv-resident N: the device holds a slot's first N positions, host RAM the rest
        # (kv_host.py)
        self.device_len = min(cfg.kv_resident or self.cache_len, self.cache_len)
        self.faults = Faults()
        self.kv_dtype = KV_DTYPES[self.choices["kv"]]
        # a hybrid family with --spec keeps its DeltaNet state after each token of a verify window
        # (keep_steps)
        steps = 1 + cfg.spec if is_hybrid(self.spec) and cfg.spec > 0 else 0
        # gpt-oss's sliding-window layers: a ring a slot of the window and the most tokens a slot
        # reads in one window (a prompt chunk, a verify row; model.transformer.ring_size)
        self.ring = ring_size(self.spec, max(int(self.choices["prefill"]), 1 + cfg.spec),
                              self.cache_len)
        limit = memory_limit(cfg.memory_limit_gib)
        if _experts_in_host_ram(model, cfg, self.choices, devs, self.group):
            # a MoE file larger than that memory: the expert tiers, sized from it (tier_sizes.py)
            base = _host_needs(model, replace(cfg, expert_cache=0, host_experts="off"),
                               self.choices, self.kv_dtype, self.device_len, self.cache_len, steps,
                               self.ring)
            self.cfg = cfg = tiers_for_memory(model, cfg, base, limit)
        # what the flags ask of host RAM, refused here with the figures when it cannot fit
        _host_needs(model, cfg, self.choices, self.kv_dtype, self.device_len, self.cache_len,
                    steps, self.ring).check(limit)
        self.ledger = ledger_for(cfg, self.split, len(devs))
        # The routed experts are placed after the weights and the KV cache: all on the device when
        # they fit (--expert-cache auto), else in a device arena fed by the host and file tiers
        # (experts/).
        self.params = load_params(model, self.choices["weights"], self.choices["dtype"], progress,
                                  experts=False, pack=self.choices["pack"])
        self.ledger.reserve_bytes("weights", _tree_bytes(self.params), "the model's weights")
        self.ledger.reserve_bytes("kv", kv_bytes(self.spec, self.kv_dtype, cfg.parallel,
                                                 self.device_len, steps, self.ring),
                                  f"the KV cache of {cfg.parallel} slots ({self.device_len} "
                                  "positions a slot)")
        host = None
        if self.device_len < self.cache_len:
            host = KVHostStore(self.spec, self.device_len, self.cache_len, chunk, self.kv_dtype)
            log.info("KV: the first %d positions of each slot on the device, up to %d more in host "
                     "RAM", self.device_len, self.cache_len - self.device_len)
        self.kv = (KVCache if self.group is None else self.group.kv)(       # its one owner
                          self.spec, cfg.parallel, self.device_len, self.kv_dtype, host,
                          place=self.shards.replicate if self.shards is not None else None,
                          stages=stage_kv(self.spec, devs) if self.split == "layers" else None,
                          steps=steps, ring=self.ring)
        # --drafter mtp: window programs also hand back every token's last hidden state (the MTP
        # layer's input), kept on the device until the engine takes them (take_hiddens)
        self.with_hidden = cfg.spec > 0 and cfg.drafter == "mtp"
        # Packed windows (engine/schedule/scheduler.py) where every row is computed alone and no
        # drafter reads the windows' hidden states by group row.
        # A hybrid family's recurrent state needs a row a slot (engine/families.py).
        self.packed = self.min_rows == 1 and not self.with_hidden and not is_hybrid(self.spec)
        self.layouts = WindowLayouts(self.opts.backend, chunk, self.device_len, self.cache_len,
                                     self.min_rows,
                                     self.packed, cfg.parallel, cfg.spec,
                                     int(self.choices["prefill"]),
                                     int(self.choices["batch_tokens"]))
        # each mode registers the builders of its programs (executors.py)
        self.programs = ProgramCache(None, self.ledger, cfg.max_programs, self.kv.wait, self.faults)
        self.stepper: LayerStepper | None = None
        # none (a dense model) | device (every expert) | arena (expert tiers)
        self.expert_mode = "none"
        if self.spec.is_moe:
            temp = largest_window_temp_bytes(self.spec, cfg, self.choices, self.opts,
                                             self.cache_len, self.device_len)
            t = place_experts(model, self.params, cfg, self.choices, self.ledger, temp,
                              self.shards.n if self.shards is not None else 1)
            self.expert_mode = t.mode
            if t.mode != "device":
                self.stepper = LayerStepper(self.params, self.spec, self.opts, self.programs,
                                            self.kv, t.arena, t.qtypes, t.shapes, t.host_trees,
                                            t.remote, t.rule, t.stream,
                                            with_hidden=self.with_hidden,
                                            prefetch=cfg.expert_prefetch,
                                            one_program=cfg.layer_step == "auto",
                                            build_now=not cfg.warmup)
        # the NextN layer's own experts on the device (the tiers hold the main layers')
        if self.with_hidden:
            nbytes = load_nextn_experts(model, self.params, self.choices["weights"],
                                        self.choices["dtype"])
            if nbytes:
                self.ledger.reserve_bytes("experts", nbytes,
                                          "the NextN (MTP) layer's experts, for the mtp drafter")
        # every expert is loaded now: E/N of them onto each device
        if self.shards is not None:
            self.params = self.shards.place(self.params)
        self.pipeline: Pipeline | None = None
        if self.split == "layers":           # each device its stage's weights, KV and programs
            if self.stepper is not None:
                raise ConfigError("split = layers: the experts do not fit, and the expert tiers do "
                                  "not combine")
            self.programs.close()
            # deepseek2's MLA maps each head's query and output through its per-head matrices
            # with XLA's einsums (model/mla.py), whose bits depend on the rows multiplied at once:
            # its windows are cut by whole groups only, so the stages keep one device's bits
            self.pipeline = Pipeline(self.params, self.spec, self.opts, devs, self.kv, cfg,
                                     self.kv_dtype, self.device_len, self.faults,
                                     rows_alone=self.min_rows == 1 and self.spec.mla is None)
            self.programs, self.params = self.pipeline.programs, None      # the stages' now
        self.executor = self._executor()    # how windows run in this mode, chosen once
        self._hiddens: list[jax.Array] | None = None     # the last window's, until take_hiddens
        # embeddings ("hidden" programs) read the weights as the whole-window program does: not
        # beside the tiers
        self.embedder = None if self.stepper is not None or self.split != "none" else Embedder(
            self.params, self.spec, self.opts, self.programs, self.kv, self.layouts.kv_bucket,
            int(self.choices["prefill"]))
        # each group's tokens from its logits (answers.py)
        self.answers = GroupAnswers(self.cache_len, cpu_pick=pk.is_cpu(self.opts.backend))
        # per group of the last window: (logprob, top ids, top logprobs)
        self.last_logprobs: list = []
        # the next decode window dispatched before this one's tokens are applied (run_ahead.py):
        # only where a window dropped unused can change nothing (packed windows: no drafter's
        # hidden states, no hybrid state; nor gpt-oss's rings; one program a window: the
        # executor's runs_ahead), and not beside --kv-resident's host part (its positions are moved
        # by the host between windows)
        self.ahead = (RunAhead(self.executor.forward_ahead, self.layout_of, self.ready, self.kv)
                      if cfg.run_ahead and self.packed and self.executor.runs_ahead
                      and self.shards is None and not keeps_state(self.spec)
                      and not self.faults.rules and self.device_len == self.cache_len else None)
        self.windows = 0
        if self.group is not None:           # every follower has loaded its part and says hello
            self.group.accept()

    # ---- layouts (layouts.py) --------------------------------------------------------------------

    def layout_of(self, groups: list[GroupInput], kv_needed: int) -> Layout:
        return self.layouts.layout_of(groups, kv_needed)

    def base_layouts(self) -> list[Layout]:
        """The layouts the warm-up builds (WindowLayouts.base)."""
        return self.layouts.base()

    # ---- running ---------------------------------------------------------------------------------

    def run(self, groups: list[GroupInput], kv_needed: int,
            ahead: bool = False) -> list[np.ndarray]:
        """Run one window; returns per group the sampled tokens [R] (or logits [R, L, V] with
        all_logits; or for a verify group the pair (tokens [R, L], n_accepted [R])); a group with
        sampling controls or logprobs also leaves (logprob [R], top ids [R, K], top logprobs [R, K])
        in last_logprobs. ahead: the window is one packed group of decode rows that may go on
        (EngineCore says): the next decode window is dispatched before this one's tokens are
        waited for (run_ahead.py)."""
        logits = None
        if self.ahead is not None:
            logits = self.ahead.take(groups, self.layout_of(groups, kv_needed))
            if logits is not None:
                self.windows += 1
        if logits is None:
            logits = self.forward_logits(groups, kv_needed)
        tokens = None
        try:
            if ahead and self.ahead is not None:
                tokens, nxt = self.answers.tokens_on_device(logits[0], groups[0])
                try:
                    self.ahead.start(groups[0], kv_needed, nxt)
                # the window run ahead is a guess: its failure is not this window's, unless it
                # took the KV cache with it
                except Exception as e:
                    self.ahead.drop()
                    if self.cache_lost():
                        raise
                    log.warning("a decode window run ahead failed (%s): not run ahead this time",
                                e)
        finally:
            if self.ahead is not None:
                # a taken window's own host work (the expert tiers count its routing), now that
                # the next one is on its way
                self.ahead.settle()
        answers = [self.answers.answer(lg, g, tokens if i == 0 else None)
                   for i, (lg, g) in enumerate(zip(logits, groups))]
        self.last_logprobs = [lp for _, lp in answers]
        return [out for out, _ in answers]

    def forward_logits(self, groups: list[GroupInput], kv_needed: int) -> list[jax.Array]:
        """Run one window's model program(s) -> logits per group, on the device (and its hidden
        states, with_hidden, for take_hiddens)."""
        layout = self.layout_of(groups, kv_needed)
        self.windows += 1
        self.faults.on_window()
        logits, self._hiddens = self.executor.forward(groups, layout)
        return logits

    def window(self, layout: Layout, args: list[np.ndarray]) -> list[jax.Array]:
        """A follower of a process group replays the leader's windows through here (lockstep.py):
        the whole-window program of `layout` on its inputs -> the groups' logits."""
        logits, self._hiddens = self.executor.window(layout, args)
        return logits

    def take_hiddens(self) -> list[jax.Array] | None:
        """The last window's hidden states a group (with_hidden; else None), handed over once: the
        MTP drafter's input (EngineCore gives them to the speculator), no longer held here."""
        out, self._hiddens = self._hiddens, None
        return out

    # ---- programs --------------------------------------------------------------------------------

    def program_layouts(self, layout: Layout) -> list[Layout]:
        """The programs a window of `layout` runs: itself, the layer-stepped stages, or its
        micro-batches."""
        return self.executor.layouts(layout)

    def ready(self, layout: Layout) -> bool:
        """Every program a window of `layout` runs is built (after taking in the builder
        thread's)."""
        self.programs.collect()
        return all(self.programs.ready(lay) for lay in self.program_layouts(layout))

    def refused(self, layout: Layout) -> bool:
        """A program of `layout`'s window can never fit (ProgramCache.refused): waiting for it is in
        vain."""
        return any(self.programs.refused(lay) for lay in self.program_layouts(layout))

    def building(self, layout: Layout) -> bool:
        """A program of `layout`'s window is queued on the builder thread (not failed there, not
        refused): its programs go to the front of that queue."""
        mine = [lay for lay in self.program_layouts(layout) if self.programs.queued(lay)]
        for lay in reversed(mine):
            self.programs.hurry(lay)
        return bool(mine)

    def build_later(self, layout: Layout) -> None:
        """Compile a window layout's programs off the engine thread (ProgramCache.build_later)."""
        for lay in self.program_layouts(layout):
            self.programs.build_later(lay)

    def set_faults(self, faults: Faults) -> None:
        """Swap the fault injector (tests)."""
        self.faults = faults
        self.programs.use_faults(faults)

    def warmup(self, progress: bool = True) -> None:
        """Build the decode windows' programs of base_layouts() now (--spec: and the smallest verify
        one; the other verify ones first in the builder's queue: a window with drafts runs as plain
        decode until its program is built, issue 32 finding 6), the others on the builder thread
        (the engine serves meanwhile, in windows whose programs exist). The persistent compilation
        cache makes a restart's builds fast."""
        from tqdm import tqdm

        base = self.base_layouts()
        # by row bucket, the smallest first
        verify = [lay for lay in base if verify_only(lay)]
        now = [lay for lay in base if decode_only(lay)] + verify[:1]
        for layout in tqdm(now, desc="building decode programs", unit="program",
                           disable=not progress, leave=False):
            for lay in self.program_layouts(layout):
                self.programs.get(lay)
        for layout in base:
            if layout not in now:
                self.build_later(layout)
        # to the front of the builder's queue, smallest first
        for layout in reversed(verify[1:]):
            self.building(layout)
        # decode windows as one program (stepped.py)
        if self.stepper is not None and self.stepper.one_program:
            for layout in now:
                self.programs.build_later(self.stepper.resident_layout(layout))

    def _executor(self) -> Executor:
        """The mode's executor (executors.py), made once the weights, experts and devices are
        placed."""
        if self.pipeline is not None:
            return self.pipeline
        if self.stepper is not None:
            return SteppedWindows(self.stepper, self.programs, self.with_hidden)
        args = (self.spec, self.opts, self.params, self.kv, self.programs, self.shards,
                self.with_hidden)
        return GroupWindows(self.group, *args) if self.group is not None else WholeWindows(*args)

    # ---- the KV cache (kv_cache.py owns it) ------------------------------------------------------

    @property
    def cache(self) -> dict[str, jax.Array]:
        """The KV cache's device arrays, to read."""
        return self.kv.arrays

    @property
    def kv_host(self) -> KVHostStore | None:
        return self.kv.host

    def cache_lost(self) -> bool:
        """A failed run may have consumed the donated cache: then it must be made anew
        (KVCache.reset)."""
        return self.kv.lost()

    def scratch_kv(self):
        """A blank KV cache (device and host parts) for the duration; the slots' own KV is put back
        after."""
        return self.kv.scratch()

    def slot_kv(self, slot: int, n: int) -> dict[str, np.ndarray]:
        """A slot's first n positions, from the device and host parts: {name: [layers, n, ...]}
        (checks)."""
        return self.kv.slot(slot, n)

    # ---- experts and counters --------------------------------------------------------------------

    def expert_profile(self) -> ExpertProfile:
        """The routing of live traffic since start, per (MoE layer, expert). Call from the engine
        thread."""
        return self.executor.expert_profile()

    def close(self) -> None:
        self.programs.close()
        self.executor.close()

    def expert_stats(self) -> dict:
        """Flat numeric counters (the server exports them as metrics)."""
        return self.executor.expert_stats()

    def stats(self) -> dict:
        kv = {"device_positions": self.device_len, "positions": self.cache_len,
              **(self.kv_host.stats() if self.kv_host is not None else {})}
        return {"programs": self.programs.snapshot(), "memory": self.ledger.snapshot(),
                "windows": self.windows,
                # decode windows dispatched ahead (run_ahead.py), and those a planned window took
                "windows_ahead": self.ahead.ran if self.ahead is not None else 0,
                "windows_ahead_taken": self.ahead.taken if self.ahead is not None else 0,
                "experts": self.expert_stats(), "kv_cache": kv,
                **{k: v for k, v in self.choices.items()},
                "devices": {"count": self.cfg.devices, "split": self.split},
                **({"group": self.group.stats()} if self.group is not None else {})}


def _tree_bytes(tree) -> int:
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(tree))


def _experts_in_host_ram(model: GGUFModel, cfg: EngineConfig, choices: dict, devs: list,
                         group) -> bool:
    """Whether "every expert on the device" would be the file's blocks in host RAM: one CPU device
    (no device-memory budget, no split over devices or processes) reading GGUF blocks."""
    return (model.spec.is_moe and jax.default_backend() == "cpu" and not devs and group is None
            and cfg.device_memory_mib is None and choices["weights"] == "blocks")


def _host_needs(model: GGUFModel, cfg: EngineConfig, choices: dict, kv_dtype, device_len: int,
                cache_len: int, steps: int, ring: int = 0) -> HostNeeds:
    """What the flags ask for in host RAM (engine/host_memory.py): on a CPU device the KV cache and
    any weight copies are host RAM too; on any device the host part of the KV (--kv-resident), the
    host expert tier's budget and the conversation cache."""
    spec, items = model.spec, {}
    if jax.default_backend() == "cpu":
        items[f"the KV cache ({cfg.parallel} slots x {device_len} positions)"] = kv_bytes(
            spec, kv_dtype, cfg.parallel, device_len, steps, ring)
        if choices["weights"] == "dequantized":
            items["the dequantized weights"] = np.dtype(choices["dtype"]).itemsize * sum(
                t.n_values for t in model.tensors.values())
        elif choices.get("pack"):
            # the experts too while every one is on the device, or the host tier packs them all
            # (placement.py pack_host: no budget, host experts, no --pcie-frac); else the expert
            # tiers pack what the device cache holds, counted below
            experts = cfg.expert_cache == "auto" or (cfg.host_experts != "off"
                                                      and host_tier_holds_all(cfg))
            items["the packed weights"] = sum(
                t.n_bytes for name, t in model.tensors.items()
                if packable(t) and (experts or "_exps." not in name))
        if choices["weights"] == "blocks":
            # the tensors read where they lie in the file's map: not free where they are off XLA's
            # boundary (a copy each); the experts only when every one is placed so (auto)
            placed = [t for name, t in model.tensors.items()
                      if not (choices.get("pack") and packable(t))
                      and (cfg.expert_cache == "auto" or "_exps." not in name)]
            items["copies of the file's tensors not at a 64-byte boundary (GGUF aligns to 32: "
                  "the runtime copies them)"] = copied_bytes(placed)
        if spec.is_moe and cfg.expert_cache != "auto":       # the device expert cache is RAM here
            n = min(int(cfg.expert_cache), spec.n_experts)
            items[f"the device expert cache ({n} slots a layer)"] = n * slot_bytes_all_layers(model)
    if device_len < cache_len:
        items[f"the KV kept in host RAM ({cache_len - device_len} positions a slot)"] = kv_bytes(
            spec, kv_dtype, cfg.parallel, cache_len - device_len)
    return HostNeeds(items | budget_items(cfg, spec.is_moe))
