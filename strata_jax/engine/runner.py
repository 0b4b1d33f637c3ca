"""The model runner: weights and the slots' KV cache on the device, and the programs that run windows.

A window is a few groups of rows (decode rows, one prefill chunk); `run` takes numpy arrays for each
group, picks the program for the window's layout from the program cache (building it if needed), and
returns each group's sampled tokens. The KV cache is donated to every program and updated in place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

from ..config import ConfigError, EngineConfig
from ..experts.profile import ExpertProfile
from ..gguf import GGUFModel
from ..model import (
    Group,
    RunOptions,
    forward,
    load_params,
)
from .constrain import fill_masks
from .controls import controls_of, sample_controlled
from .faults import Faults
from .kv_cache import KVCache
from .kv_host import KVHostStore
from .memory import MemoryLedger
from .placement import largest_window_temp_bytes, place_experts
from .programs import Layout, ProgramCache
from .sampler import SamplingRows, sample
from .spec.accept import verify
from .stepped import LayerStepper

log = logging.getLogger("strata_jax.engine")

KV_DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16, "int8": jnp.int8}
# Below this many float32 bytes a CPU keeps dequantized weights (see model/weights.py).
DEQUANTIZE_LIMIT = 4 << 30


@dataclass
class GroupInput:
    tokens: np.ndarray        # [R, L] int32
    pos: np.ndarray           # [R, L] int32 (-1: padding)
    slots: np.ndarray         # [R] int32
    sampling: SamplingRows
    all_logits: bool = False
    drafts: np.ndarray | None = None    # [R, L-1] int32: a verify group's drafts (spec/accept.py), with
    n_draft: np.ndarray | None = None   # [R] int32: the real drafts a row (the group then returns tokens, n_accepted)
    picks: np.ndarray | None = None     # [E] int32: logits of these tokens only (a packed window; model.Group)

    def arrays(self) -> list[np.ndarray]:
        """The program's inputs for this group, in model.Group's order."""
        return [self.tokens, self.pos, self.slots] + ([self.picks] if self.picks is not None else [])


def _decode_only(layout: Layout) -> bool:
    """One group of one token a row, a logit a row: decode rows alone (packed: tokens == picks)."""
    if len(layout.groups) != 1:
        return False
    r, n, a, e = layout.groups[0]
    return n == 1 and not a and e in (0, r)


def _powers(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (a power of two)."""
    out = [1]
    while out[-1] < most:
        out.append(out[-1] * 2)
    return out


def _shapes(tree):
    """Arrays -> ShapeDtypeStructs (other leaves as they are): what lowering a program needs of them."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "dtype") else a, tree)


def resolve(cfg: EngineConfig, model: GGUFModel) -> dict[str, str]:
    """Turn the config's "auto" choices into this machine's: backend, dtype, kv, weights, prefill."""
    on_gpu = jax.default_backend() == "gpu"
    backend = pk.resolve_backend(cfg.backend)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    kv = cfg.kv if cfg.kv != "auto" else ("bf16" if on_gpu else "f32")
    weights = cfg.weights
    if weights == "auto":
        # The cpu and pallas kernels read GGUF blocks at memory speed: keep them. XLA alone on a CPU has no
        # fast low-bit path, so there a small model gets a float copy (DESIGN.md, Speed).
        f32_bytes = 4 * sum(t.n_values for t in model.tensors.values())
        small = f32_bytes <= DEQUANTIZE_LIMIT
        weights = "dequantized" if (backend == "xla" and not on_gpu and small) else "blocks"
    prefill = cfg.prefill if cfg.prefill != "auto" else (1024 if on_gpu else 256)
    # auto: the budget measured best here on a CPU (docs/BENCHMARKS.md, issue 15); on a GPU vLLM's default
    # for online serving (not measured here: no GPU was at hand). Never below one whole prompt chunk.
    batch = cfg.batch_tokens if cfg.batch_tokens != "auto" else max(prefill, 2048 if on_gpu else 512)
    if batch < prefill:
        raise ConfigError(f"batch_tokens = {batch}: must be at least the prompt chunk a window reads "
                          f"(prefill = {prefill}): a window holds at least one whole chunk")
    return {"backend": backend, "dtype": dtype, "kv": kv, "weights": weights, "prefill": prefill,
            "batch_tokens": batch}


class ModelRunner:
    def __init__(self, model: GGUFModel, cfg: EngineConfig, progress: bool = False):
        self.spec = model.spec
        self.cfg = cfg
        self.choices = resolve(cfg, model)
        chunk = cfg.attention_chunk()
        self.opts = RunOptions(dtype=self.choices["dtype"], backend=self.choices["backend"], attn_chunk=chunk)
        # The smallest row bucket of decode and verify windows. XLA's dot takes another path for one row
        # than for 2..32 (DESIGN.md, Batch invariance), so a lone row is padded to two. With blocks on the
        # cpu backend every product, the attention and the router run in its kernels, whose rows are
        # independent of each other: a lone row runs alone (SmolLM2's decode step: ~25% less work).
        self.min_rows = 1 if (self.choices["backend"], self.choices["weights"]) == ("cpu", "blocks") else 2
        self.cache_len = -(-cfg.max_context // chunk) * chunk       # positions a slot's cache holds
        # --kv-resident N: the device holds a slot's first N positions, host RAM the rest (kv_host.py)
        self.device_len = min(cfg.kv_resident or self.cache_len, self.cache_len)
        self.faults = Faults()
        self.ledger = MemoryLedger(cfg.device_memory_mib, cfg.vram_reserve_mib)
        # The routed experts are placed after the weights and the KV cache: all on the device when they fit
        # (--expert-cache auto), else in a device arena fed by the host and file tiers (experts/).
        self.params = load_params(model, self.choices["weights"], self.choices["dtype"], progress, experts=False)
        self.ledger.reserve_bytes("weights", _tree_bytes(self.params), "the model's weights")
        self.kv_dtype = KV_DTYPES[self.choices["kv"]]
        self.ledger.reserve_bytes("kv", self._kv_bytes(), f"the KV cache of {cfg.parallel} slots "
                                  f"({self.device_len} positions a slot)")
        host = None
        if self.device_len < self.cache_len:
            host = KVHostStore(self.spec, self.device_len, self.cache_len, chunk, self.kv_dtype)
            log.info("KV: the first %d positions of each slot on the device, up to %d more in host RAM",
                     self.device_len, self.cache_len - self.device_len)
        self.kv = KVCache(self.spec, cfg.parallel, self.device_len, self.kv_dtype, host)     # its one owner
        self.stepper: LayerStepper | None = None
        self.expert_mode = "none"          # none (a dense model) | device (every expert) | arena (expert tiers)
        self.expert_counts = None          # device mode: int32 [n_layers, E], routing of live traffic
        if self.spec.is_moe:
            temp = largest_window_temp_bytes(self.spec, cfg, self.choices, self.opts, self.cache_len, self.device_len)
            tiers = place_experts(model, self.params, cfg, self.choices, self.ledger, temp)
            self.expert_mode = tiers.mode
            if tiers.mode == "device":
                self.expert_counts = self._new_counts()
            else:
                self.stepper = LayerStepper(self, tiers.arena, tiers.qtypes, tiers.shapes, tiers.host_trees,
                                            tiers.remote, tiers.rule, tiers.stream)
        # --drafter mtp: window programs also hand back every token's last hidden state (the MTP layer's
        # input), kept on the device in last_hiddens until the next window
        self.with_hidden = cfg.spec > 0 and cfg.drafter == "mtp"
        # Packed windows (engine/scheduler.py) where every row is computed alone and no drafter reads the
        # windows' hidden states by group row.
        self.packed = self.min_rows == 1 and not self.with_hidden
        self.last_hiddens: list[jax.Array] | None = None
        self.builders: dict = {}            # stage -> build(layout): programs of other parts (the MTP drafter's)
        self.programs = ProgramCache(self._build, self.ledger, cfg.max_programs, self.wait_for_device, self.faults)
        self._sample = jax.jit(sample)          # one small program per row count (a handful: row buckets)
        self._verify = jax.jit(verify)          # the speculative accept rule, one per verify group shape
        # sampling controls and logprobs: one program per row bucket, greedy or sampled (controls.py)
        self._controlled = jax.jit(sample_controlled, static_argnames=("sampled",))
        self.last_logprobs: list = []           # per group of the last window: (logprob, top ids, top logprobs)
        self.windows = 0

    # ---- layouts --------------------------------------------------------------------------------------

    def kv_bucket(self, needed: int) -> int:
        """The KV length a window attends over: chunk * 2^i covering `needed`, at most the cache length
        (and at most the device part when `needed` fits in it: such windows never touch host KV)."""
        if self.opts.backend == "cpu" and needed <= self.device_len:
            # the cpu attention kernel reads only the keys each query sees, in place: the KV length is
            # not part of its arithmetic, so one program serves every length (fewer layouts to build)
            return self.device_len
        n = self.opts.attn_chunk
        while n < needed:
            n *= 2
        return min(n, self.device_len if needed <= self.device_len else self.cache_len)

    def layout_of(self, groups: list[GroupInput], kv_needed: int) -> Layout:
        return Layout(tuple((g.tokens.shape[0], g.tokens.shape[1], g.all_logits,
                             0 if g.picks is None else len(g.picks)) for g in groups),
                      self.kv_bucket(kv_needed))

    # ---- running --------------------------------------------------------------------------------------

    def run(self, groups: list[GroupInput], kv_needed: int) -> list[np.ndarray]:
        """Run one window; returns per group the sampled tokens [R] (or logits [R, L, V] with all_logits;
        or for a verify group the pair (tokens [R, L], n_accepted [R])); a group with sampling controls or
        logprobs also leaves (logprob [R], top ids [R, K], top logprobs [R, K]) in last_logprobs."""
        logits = self.forward_logits(groups, kv_needed)
        out = []
        self.last_logprobs = [None] * len(groups)
        for i, (lg, g) in enumerate(zip(logits, groups)):
            if g.drafts is not None:
                out.append(tuple(np.asarray(a) for a in self._verify(lg, g.drafts, g.n_draft, *g.sampling.as_tuple())))
            elif g.all_logits:
                out.append(np.asarray(lg))
            elif g.sampling.controlled is not None:      # a row with sampling controls or logprobs
                c = controls_of(g.sampling.controlled, lg.shape[0], lg.shape[-1], self.cache_len)
                sampled = bool(np.any(g.sampling.temperature > 0))
                # the model program is dispatched: the grammars' masks are filled while the device runs it
                cons = g.sampling.constraints
                mask = None if cons is None else fill_masks(cons, lg.shape[0], lg.shape[-1])
                tokens, *lp = (np.asarray(a) for a in self._controlled(lg, *g.sampling.as_tuple(), *c.as_tuple(),
                                                                       mask, sampled=sampled))
                out.append(tokens)
                self.last_logprobs[i] = tuple(lp)
            elif not np.any(g.sampling.temperature > 0):
                out.append(greedy_on_host(np.asarray(lg)))
            else:
                out.append(np.asarray(self._sample(lg, *g.sampling.as_tuple())))
        return out

    def forward_logits(self, groups: list[GroupInput], kv_needed: int) -> list[jax.Array]:
        """Run one window's model program(s) -> logits per group, on the device."""
        layout = self.layout_of(groups, kv_needed)
        self.windows += 1
        self.faults.on_window()
        self.last_hiddens = None
        if self.stepper is not None:
            out = self.stepper.run(groups, layout)
        else:
            args = []
            for g in groups:
                args += g.arrays()
            if self.expert_counts is not None and self.expert_counts.is_deleted():
                log.warning("the expert profile's counts were lost in a failed window: counting anew")
                self.expert_counts = self._new_counts()       # a failed run consumed it: the profile starts again
            counts = [] if self.expert_counts is None else [self.expert_counts]
            res = self.kv.through(lambda c: _cache_last(self.programs.run(layout, self.params, c, *counts, *args)))
            if counts:
                self.expert_counts = res.counts
            self.last_hiddens = res.hiddens
            return res.logits
        if self.with_hidden:
            out, self.last_hiddens = out
        return out

    def program_layouts(self, layout: Layout) -> list[Layout]:
        """The programs a window of `layout` runs: itself, or the layer-stepped stages."""
        return self.stepper.stage_layouts(layout) if self.stepper is not None else [layout]

    def ready(self, layout: Layout) -> bool:
        """Every program a window of `layout` runs is built (after taking in the builder thread's)."""
        self.programs.collect()
        return all(self.programs.ready(lay) for lay in self.program_layouts(layout))

    def refused(self, layout: Layout) -> bool:
        """A program of `layout`'s window can never fit (ProgramCache.refused): waiting for it is in vain."""
        return any(self.programs.refused(lay) for lay in self.program_layouts(layout))

    def building(self, layout: Layout) -> bool:
        """A program of `layout`'s window is queued on the builder thread (not failed there, not refused):
        its programs go to the front of that queue."""
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
        self.faults = self.programs._faults = faults

    def base_layouts(self) -> list[Layout]:
        """The layouts the warm-up builds, at the first KV bucket. Packed windows (the cpu backend): every
        (tokens, picks) pair of buckets a window can have, so nothing is compiled while serving (until a
        --kv-resident window reaches the host part). Otherwise: decode rows alone for each row bucket
        (min_rows, 2 min_rows, ... up to parallel), verify rows alone with --spec, one whole prompt chunk
        alone, and each decode bucket with one whole chunk; whatever else a window needs is built off the
        engine thread while the engine runs these (Engine._ready_window: a chunk pads to a whole one, and
        decode rows can run without it)."""
        rows, buckets = self.min_rows, []
        while True:
            buckets.append(rows)
            if rows >= self.cfg.parallel:
                break
            rows *= 2
        kv, chunk = self.kv_bucket(1), int(self.choices["prefill"])
        if self.packed:           # every (tokens, picks) bucket pair a window can have: all of them
            n = max(int(self.choices["batch_tokens"]), self.cfg.parallel + min(chunk, self.cache_len))
            most = 1 << (n - 1).bit_length()
            return [Layout(((t, 1, False, e),), kv) for t in _powers(most) for e in _powers(min(t, buckets[-1]))]
        prompt = (1, chunk, False, 0)
        lays = [Layout(((r, 1, False, 0),), kv) for r in buckets] + [Layout((prompt,), kv)]
        if self.cfg.spec:
            lays += [Layout(((r, 1 + self.cfg.spec, True, 0),), kv) for r in buckets]
        if self.cfg.parallel > 1:
            lays += [Layout(((r, 1, False, 0), prompt), kv) for r in buckets]
        return lays

    def warmup(self, progress: bool = True) -> None:
        """Build the decode windows' programs of base_layouts() now, and the others on the builder thread
        (the engine serves meanwhile, in windows whose programs exist). The persistent compilation cache
        makes a restart's builds fast."""
        from tqdm import tqdm

        base = self.base_layouts()
        now = [lay for lay in base if _decode_only(lay)]
        for layout in tqdm(now, desc="building decode programs", unit="program", disable=not progress, leave=False):
            for lay in self.program_layouts(layout):
                self.programs.get(lay)
        for layout in base:
            if layout not in now:
                self.build_later(layout)
        if self.stepper is not None and self.stepper.one_program:     # decode windows as one program (stepped.py)
            for layout in now:
                self.programs.build_later(self.stepper.resident_layout(layout))

    @property
    def cache(self) -> dict[str, jax.Array]:
        """The KV cache's device arrays, to read (self.kv owns them: KVCache.through)."""
        return self.kv.arrays

    @property
    def kv_host(self) -> KVHostStore | None:
        return self.kv.host

    def wait_for_device(self) -> None:
        self.kv.wait()

    def cache_lost(self) -> bool:
        """A failed run may have consumed the donated cache: then it must be made anew."""
        return self.kv.lost()

    def reset_cache(self) -> None:
        self.kv.reset()

    def scratch_kv(self):
        """A blank KV cache (device and host parts) for the duration; the slots' own KV is put back after."""
        return self.kv.scratch()

    def slot_kv(self, slot: int, n: int) -> dict[str, np.ndarray]:
        """A slot's first n positions, from the device and host parts: {name: [layers, n, ...]} (checks,
        and moving a slot's KV elsewhere)."""
        return self.kv.slot(slot, n)

    def _build(self, layout: Layout):
        """Compile the window program of `layout`: tokens, positions and slots in, logits out (sampling is
        a small program of its own, `_sample`, compiled once per row count: keeping it out of every window
        program makes each build ~0.7 s faster on a CPU)."""
        if layout.stage in self.builders:
            return self.builders[layout.stage](layout)
        if layout.stage != "window":
            return self.stepper.build(layout)
        spec, opts = self.spec, self.opts
        counting = self.expert_counts is not None     # the expert profile: counts in, counts out (donated)

        def window(params, cache, *flat):
            counts, flat = (flat[0], flat[1:]) if counting else (None, flat)
            groups, at = [], 0
            for _, _, all_logits, picks in layout.groups:
                n = 4 if picks else 3
                groups.append(Group(*flat[at:at + 3], all_logits, flat[at + 3] if picks else None))
                at += n
            return forward(params, spec, opts, tuple(groups), cache, layout.kv_len, with_hidden=self.with_hidden,
                           host=self.kv_host, counts=counts)

        args = [self.expert_counts] if counting else []
        for rows, length, _, picks in layout.groups:
            args += [jax.ShapeDtypeStruct((rows, length), jnp.int32), jax.ShapeDtypeStruct((rows, length), jnp.int32),
                     jax.ShapeDtypeStruct((rows,), jnp.int32)] + [jax.ShapeDtypeStruct((picks,), jnp.int32)] * bool(picks)
        donate = (1, 2) if counting else (1,)
        # Shapes only (the builder thread compiles while the engine thread runs, donates and replaces the arrays)
        return jax.jit(window, donate_argnums=donate).lower(_shapes(self.params), _shapes(self.cache),
                                                            *_shapes(args)).compile()

    def _kv_bytes(self) -> int:
        s = self.spec
        layers = s.n_layers + s.n_nextn                                         # new_kv_cache: MTP layers too
        per_pos = layers * s.n_kv_heads * (s.head_dim + s.value_dim) * jnp.dtype(self.kv_dtype).itemsize
        if self.kv_dtype == jnp.int8:
            per_pos += layers * s.n_kv_heads * 2 * 4                            # a float32 scale a token and head
        return per_pos * self.cfg.parallel * (self.device_len + 1)

    def _new_counts(self):
        return jnp.zeros((self.spec.n_layers, self.spec.n_experts), jnp.int32)

    def expert_profile(self) -> ExpertProfile:
        """The routing of live traffic since start, per (MoE layer, expert). Call from the engine thread."""
        if self.stepper is not None:
            return self.stepper.profile
        if self.expert_counts is None:
            raise ValueError("this model has no experts: there is no expert profile to write")
        prof = ExpertProfile(self.spec)
        prof.add_all(np.asarray(self.expert_counts))
        return prof

    def close(self) -> None:
        self.programs.close()
        if self.stepper is not None:
            self.stepper.arena.host.close()

    def expert_stats(self) -> dict:
        """Flat numeric counters (the server exports them as metrics)."""
        if self.stepper is not None:
            return self.stepper.stats()
        if self.spec.is_moe:
            n = self.spec.n_experts * len(self.spec.moe_layers)
            return {"device_slots": self.spec.n_experts, "experts_total": n, "all_on_device": 1}
        return {}

    def stats(self) -> dict:
        kv = {"device_positions": self.device_len, "positions": self.cache_len,
              **(self.kv_host.stats() if self.kv_host is not None else {})}
        return {"programs": self.programs.snapshot(), "memory": self.ledger.snapshot(), "windows": self.windows,
                "experts": self.expert_stats(), "kv_cache": kv, **{k: v for k, v in self.choices.items()}}


def _cache_last(res):
    """A window program's ForwardOut -> (it, its cache): KVCache.through's form."""
    return res, res.cache


def greedy_on_host(logits: np.ndarray) -> np.ndarray:
    """sample()'s answer for rows that are all greedy, from logits [R, V] already on the host (on a CPU,
    a view: no transfer), without a program call (~0.25 ms a decode step): the argmax, or -1 where a row's
    logits hold a NaN or an inf (sampler.mark_non_finite)."""
    tokens = np.argmax(logits, axis=-1).astype(np.int32)
    return np.where(np.isfinite(np.max(logits, axis=-1)), tokens, np.int32(-1))


def _tree_bytes(tree) -> int:
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(tree))
