"""Layer-stepped windows: how a window runs when the experts do not all sit on the device.

The window becomes a chain of small programs, each built once per layout shape and shared by every
layer (the layer's weights and index are arguments), all held in the ProgramCache (so its bound and
its out-of-memory handling apply; their layouts carry a `stage` name):

    embed -> for each MoE layer: attn (attention, FFN norm, router: the expert ids come back to the
                                 host) the host makes the chosen experts resident in the device
                                     arena
                                 experts (the expert matmul over arena slots; the shared expert;
                                     residual)
             for each dense layer (GLM-4.5's leading ones): dense (attention and FFN in one program)
          -> head (final norm and logits)

Kinds of layer: one program serves every layer whose weights have the same shapes, dtypes and quant
types (the layer's weights are arguments, but their shapes and quant types are baked into the
program). Files may mix them: llama.cpp's Q4_K_M gives some layers' attn_v and ffn_down
(ffn_down_exps too) Q6_K. So the layers are grouped, stage by stage, into kinds by that signature,
and each kind gets its own programs: stages "attn", "attn.1", ..., "experts", "experts.1", ... (kind
0 keeps the plain name, so a uniform model builds exactly one program a stage, as before). The
attention kinds and the expert kinds are counted apart (the experts' kind covers the shared expert
and the arena's leaves), so a file whose attn_v and ffn_down_exps get more bits in the same layers
builds two of each, not four.

The arithmetic is forward()'s, op for op and in the same order, so logits are the same bits as with
every expert on the device. A layer whose window chose more distinct experts than the arena has
slots runs its experts program in several passes; each pass fills in the rows whose experts it
holds.

Prefetch (--expert-prefetch): after layer i's experts program is queued, a small "predict" program
applies layer i+1's FFN norm and router to layer i's output (layer i+1's input, before its attention
adds to it), and while the device runs layer i+1's attention the host copies the experts that guess
names into layer i+1's arena. Only where the experts come from changes, never the math: the logits
stay the same bits. The router ids of every layer come back to the host anyway; they are also
counted into the expert profile.

One program a window where it can (`--layer-step auto`): the host round trip of each layer is only
needed to bring in experts the arena lacks. A window whose every layer finds its routed experts
where one program can read them runs as ONE program ("resident": resident_window, the same stages
chained on the device, each layer's page table looked up there): with --host-experts, a layer with a
miss computes its experts from the host tier's blocks inside that program (on the cpu kernels one
expert call reads each routed expert where it is, the held ones from the arena's slots and the
missed ones from the host blocks: model/stages.py's tiered_experts_stage; elsewhere lax.cond picks
the arena or the host blocks for the whole layer: the same kernel, the same bits); without, the
program is tried when the window before had no miss, its router ids come back with the logits, and a
window that met a miss after all is run again layer by layer (its KV writes are the same positions,
rewritten). With host experts a layout's only program is that one (stage_layouts); without, it is
built on the builder thread and windows step until it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from ...experts import EXPERT_TENSORS, ExpertArena, ExpertCounters
from ...experts.hybrid import HostRule
from ...experts.profile import ExpertProfile
from ...experts.stream import ExpertStream
from ...model import Group, QTensor
from ...model.params import ExpertSide
from .kv_cache import KVCache
from .programs import Layout, ProgramCache
from .stepped_build import KINDED, build_stage, group_kinds


class LayerStepper:
    def __init__(self, params: dict, spec, opts, programs: ProgramCache, kv: KVCache,
                 arena: ExpertArena,
                 qtypes: dict[int, dict[str, str | None]],
                 expert_shapes: dict[int, dict[str, tuple]],
                 host_trees: dict[int, dict] | None = None, host_device=None,
                 rule: HostRule | None = None, stream: ExpertStream | None = None, *,
                 with_hidden: bool = False, prefetch: bool = False, one_program: bool = True,
                 build_now: bool = False):
        """params: the model's weights (it reads the main layers', the embedding's and the head's);
        programs: the program cache its stages register with and run in; kv: the slots' KV cache,
        which its attention stages write through. with_hidden: the head also returns the hidden
        states (the MTP drafter); prefetch: --expert-prefetch; one_program: --layer-step auto;
        build_now: no --warmup (the one-program window is built when first needed, not on the
        builder thread)."""
        self.programs, self.kv = programs, kv
        self.arena = arena
        self.spec, self.opts = spec, opts
        self.with_hidden, self.build_now = with_hidden, build_now
        layers = params["layers"]
        # the others are dense
        self.moe = [i for i, lp in enumerate(layers) if lp.is_moe]
        self.embed_p = {"embed": params["embed"]}
        self.head_p = {"norm": params["norm"], "output": params["output"]}
        # a MoE layer's attention and router (its experts are the tiers'), and its shared expert or
        # None
        self.attn_p = {i: replace(layers[i], shared=None) for i in self.moe}
        # (and gpt-oss's expert biases: model/params.ExpertSide)
        self.moe_p = {i: ExpertSide(layers[i].shared, layers[i].expert_biases) for i in self.moe}
        self.dense_p = {i: lp for i, lp in enumerate(layers) if i not in self.attn_p}
        # layer -> tensor -> quant type name, or None where the arena holds floats
        self.qtypes = qtypes
        self.shapes = expert_shapes          # layer -> tensor -> logical shape of one expert [n, k]
        # each layer's index in the cache (its KV, or a hybrid family's DeltaNet state:
        # spec.kv_layer)
        self.index = [jnp.int32(spec.kv_layer(i)) for i in range(len(layers))]
        # predict_stage's
        self.predict_p = {i: (lp.ffn_norm, lp.router) for i, lp in self.attn_p.items()}
        # One program a kind of layer and stage (see the module docstring): kind_of[stage][layer] is
        # the stage name that layer's program runs under, first_of[that name] the layer its program
        # is built for. --host-experts: each layer's every expert as the host tier's blocks
        # (experts/hybrid.py). host_device None: they are the device's own memory ("local": the one
        # program reads them); else they sit on that CPU device beside the device ("remote": a
        # layer's misses are computed there, host_experts_stage)
        self.host_trees = host_trees
        self.host_device = host_device
        # gpt-oss's expert biases, a copy on the host device for its programs ("remote")
        self.host_biases = {i: jax.device_put(self.moe_p[i].biases, host_device)
                            for i in self.moe} if host_device is not None else {}
        self.rule = rule
        # what resident_window may read
        self.in_program = host_trees if host_device is None else None
        # --pcie-frac: some misses read over the link (experts/stream.py)
        self.stream = stream
        # expert -> itself: all present
        self.identity = np.arange(self.spec.n_experts, dtype=np.int32)
        trees = {"attn": self.attn_p,
                 "experts": {i: (self.moe_p[i], self.arena_tree(i)) for i in self.moe},
                 "hexperts": {i: (self.moe_p[i], host_trees[i]) for i in self.moe}
                             if self.in_program else {},
                 "rexperts": {i: host_trees[i] for i in self.moe} if host_trees and host_device
                             else {},
                 "sexperts": {i: (self.moe_p[i], self.stream_sds(i)) for i in self.moe} if stream
                             else {},
                 "predict": self.predict_p, "dense": self.dense_p}
        self.kind_of: dict[str, dict[int, str]] = {}
        self.first_of: dict[str, int] = {}
        for stage in KINDED:
            self.kind_of[stage], first_of = group_kinds(stage, trees[stage])
            self.first_of.update(first_of)
        self.prefetch = prefetch
        # --layer-step auto: one program a window where it can (resident_window); always: every
        # window stepped
        self.one_program = one_program
        self.core = {"embed": self.embed_p, "head": self.head_p, "attn": self.attn_p,
                     "shared": self.moe_p, "dense": self.dense_p}
        # the last window met a miss (arena only: whether to try one program)
        self.missed = True
        # one order of the MoE layers (the one-program window's ids)
        assert self.moe == list(arena.layers)
        # routing of live traffic, per (layer, expert)
        self.profile = ExpertProfile(self.spec, arena.layers)
        self.last = ExpertCounters()         # the last window's counters
        self.total = ExpertCounters()
        # a list: record every lookup and prefetch (bench/sweep.py replays it)
        self.trace: list | None = None
        # the one-program window's arguments that never change (its weights and the host tier's
        # blocks), flattened once: (leaves, tree)
        self.resident_consts = jax.tree_util.tree_flatten((self.core, self.in_program))
        # its programs, in the shared program cache
        for stage in ("embed", "head", "resident", *KINDED):
            programs.register(stage, self.build)

    def arena_tree(self, layer: int, leaves: dict | None = None) -> dict:
        """The layer's arena leaves (or others of the arena's form: the streamed experts') as the
        experts program takes them: QTensors where they are blocks."""
        leaves = self.arena.arena[layer] if leaves is None else leaves
        qtypes, shapes = self.qtypes[layer], self.shapes[layer]
        return {n: QTensor(leaves[n], qtypes[n], (leaves[n].shape[0], *shapes[n])) if qtypes[n]
                   else leaves[n]
                for n in EXPERT_TENSORS}

    def arena_leaves(self) -> list[jax.Array]:
        """Every MoE layer's arena leaves, in `moe` and EXPERT_TENSORS order: the one-program
        window's arena argument (the leaves change when experts are copied in)."""
        arena = self.arena.arena
        return [arena[i][n] for i in self.moe for n in EXPERT_TENSORS]

    def arena_trees(self, leaves: list) -> dict[int, dict]:
        """arena_leaves' list (or its tracers) -> each MoE layer's arena_tree."""
        m = len(EXPERT_TENSORS)
        return {i: self.arena_tree(i, dict(zip(EXPERT_TENSORS, leaves[j * m:(j + 1) * m])))
                for j, i in enumerate(self.moe)}

    def stream_sds(self, layer: int) -> dict:
        """The shapes of a layer's streamed experts (ExpertStream.stage), in pinned_host memory."""
        S, on = self.stream.slots, self.stream.sharding
        return self.arena_tree(layer,
                               {n: jax.ShapeDtypeStruct((S, *a.shape[1:]), a.dtype, sharding=on)
                                       for n, a in self.arena.arena[layer].items()})

    def kinds(self, stage: str) -> list[str]:
        """The stage names of `stage`'s kinds of layer, in order ("attn", "attn.1", ...; none
        without layers)."""
        return list(dict.fromkeys(self.kind_of[stage][i] for i in sorted(self.kind_of[stage])))

    @property
    def always_one_program(self) -> bool:
        """Every window runs as one program (--layer-step auto with host experts, no trace being
        recorded)."""
        return self.one_program and self.in_program is not None and self.trace is None

    def stage_layouts(self, layout: Layout) -> list[Layout]:
        """Every program one window of `layout` may run: the one-program window alone where every
        window runs as one (so the warm-up and the program bound hold one program a layout, not
        seven); else the embedding, each kind's attention and experts programs, the head, then each
        kind's predict (with prefetch) and dense programs."""
        if self.always_one_program:
            return [self.resident_layout(layout)]
        stages = (["embed", *self.kinds("attn"), *self.kinds("experts"), *self.kinds("hexperts"),
                   *self.kinds("rexperts"), *self.kinds("sexperts"), "head"]
                  + self.kinds("predict") * self.prefetch + self.kinds("dense"))
        # only the head reads a packed window's picks: the other stages' layouts leave them out
        plain = tuple((r, n, a, 0) for r, n, a, _ in layout.groups)
        return [replace(layout, stage=s,
                        kv_len=layout.kv_len if s.partition(".")[0] in ("attn", "dense") else 0,
                        groups=layout.groups if s == "head" else plain)
                for s in stages]

    def resident_layout(self, layout: Layout) -> Layout:
        """The one-program window of `layout` (resident_window)."""
        return replace(layout, stage="resident")

    def run(self, groups, layout: Layout):
        """One window (GroupInputs) -> logits per group, as forward() gives them (and the hidden
        states, as (logits, hiddens), with_hidden: the MTP drafter)."""
        with self._counting() as counters:
            if self._try_one_program(layout):
                out = self._run_resident(groups, self.resident_layout(layout), counters)
                if out is not None:
                    return out
                # it met a miss after all: the window again, layer by layer
                counters.redone += 1
            out = self._run(groups, self.stage_layouts(layout), counters)
            self.missed = counters.hits < counters.lookups
            return out

    def run_ahead(self, groups, layout: Layout):
        """A decode window dispatched before its turn (run_ahead.py), where every window runs as
        one program (always_one_program) -> (its logits, settle): settle() counts its routing as
        run() does, when the window is taken (a dropped window, whose tokens nobody uses, is
        counted nowhere). Its router ids stay on the device until then, so nothing here waits
        for the program. While a trace is recorded (bench/sweep.py) windows step: then it is run
        and counted now, as a window run ahead on the whole-window program counts its routing."""
        if not self.always_one_program:
            return self.run(groups, layout), None
        out, ids, tables = self._dispatch_resident(groups, self.resident_layout(layout))

        def settle():
            with self._counting() as counters:
                self._count_resident(groups, ids, tables, counters)
        return out, settle

    @contextmanager
    def _counting(self):
        """The counters of one window, made the last window's and added to the totals when it
        ends (a window that failed half way still moved what it moved)."""
        counters = self.last = ExpertCounters()
        host = self.arena.host
        reads, nbytes = host.file_reads, host.file_bytes
        try:
            yield counters
        finally:
            counters.file_reads = host.file_reads - reads
            counters.file_bytes = host.file_bytes - nbytes
            self.total.add(counters)

    def _try_one_program(self, layout: Layout) -> bool:
        """Whether this window runs as one program: --layer-step auto, no trace being recorded (it
        wants each layer's lookup in order, with prefetch), experts that one program can read (the
        host tier's blocks, or an arena that held every routed expert in the window before), and its
        program built. Until it is, it is built on the builder thread (at once, on the engine
        thread, without --warmup) and windows step."""
        if (not self.one_program or self.trace is not None
                or (self.in_program is None and self.missed)):
            return False
        res, progs = self.resident_layout(layout), self.programs
        # the latter: its only program, built now if need be
        if progs.ready(res) or self.always_one_program:
            return True
        if self.build_now:
            progs.get(res)
            return True
        progs.build_later(res)
        return False

    def _run_resident(self, groups, res: Layout, counters: ExpertCounters):
        """The window as one program -> its logits, or None when an expert it needed was not in the
        arena (no host blocks to fall back on): nothing is counted then, and the caller steps the
        window."""
        out, ids, tables = self._dispatch_resident(groups, res)
        return out if self._count_resident(groups, ids, tables, counters) else None

    def _dispatch_resident(self, groups, res: Layout):
        """The one-program window dispatched -> (its logits, its router ids [n_moe, tokens, k] on
        the device, the page tables it read)."""
        progs, arena = self.programs, self.arena
        gs = tuple(Group(g.tokens, g.pos, g.slots, g.all_logits, g.picks) for g in groups)
        tables = np.stack([arena.tables[i] for i in self.moe])
        leaves = self.arena_leaves()
        def window(cache):
            out, cache, ids = progs.run(res, self.resident_consts[0], leaves, tables, gs, cache)
            return out, ids, cache

        out, ids = self.kv.through(window)
        return out, ids, tables

    def _count_resident(self, groups, ids, tables: np.ndarray, counters: ExpertCounters) -> bool:
        """Count a one-program window's routing (its ids, read under `tables`) into the profile,
        the arena's policy and `counters` -> True; or False, counting nothing, when a routed expert
        was absent and no host blocks stood in (the window must be stepped)."""
        arena = self.arena
        real = np.concatenate([np.asarray(g.pos).reshape(-1) >= 0 for g in groups])
        ids = np.asarray(ids)[:, real]                                  # [n_moe, real tokens, k]
        E = self.spec.n_experts
        n_moe = len(self.moe)
        flat = (ids.reshape(n_moe, -1) + E * np.arange(n_moe)[:, None]).reshape(-1)
        # [n_moe, E] tokens an expert
        counts = np.bincount(flat, minlength=n_moe * E).reshape(n_moe, E)
        # layers with an absent expert
        missed = np.flatnonzero(np.any((counts > 0) & (tables < 0), axis=1))
        if self.in_program is None and missed.size:
            self.missed = True
            return False
        decode = all(g.tokens.shape[1] == 1 for g in groups)
        self.profile.add_moe(counts)
        arena.count_hits(counts, np.setdiff1d(np.arange(n_moe), missed), counters, decode)
        for j in missed:                    # computed from the host blocks inside the program
            arena.count_host(self.moe[j], ids[j], counters, decode)
        counters.one_program += 1
        self.missed = False
        return True

    def _run(self, groups, layouts: list[Layout], counters: ExpertCounters) -> list:
        progs, kv = self.programs, self.kv
        stage = {lay.stage: lay for lay in layouts}
        kind_of = self.kind_of
        k, h = self.spec.n_experts_used, self.spec.hidden
        gs = tuple(Group(g.tokens, g.pos, g.slots, g.all_logits) for g in groups)
        # the head's
        heads = tuple(Group(g.tokens, g.pos, g.slots, g.all_logits, g.picks) for g in groups)
        # no prompt chunk in the window
        decode = all(g.tokens.shape[1] == 1 for g in groups)
        # [R*L] per group: real tokens
        reals = [np.asarray(g.pos).reshape(-1) >= 0 for g in groups]
        xs = progs.run(stage["embed"], self.embed_p, tuple(g.tokens for g in groups))
        guess = None                          # the predict program's ids for this layer (prefetch)
        for i in range(self.spec.n_layers):
            if i in self.dense_p:
                xs = kv.through(lambda c, i=i, xs=xs: progs.run(stage[kind_of["dense"][i]],
                                                                self.dense_p[i],
                                                                self.index[i], c, gs, xs))
                continue
            parts = kv.through(lambda c, i=i, xs=xs: progs.run(stage[kind_of["attn"][i]],
                                                               self.attn_p[i],
                                                               self.index[i], c, gs, xs))
            if guess is not None:             # the device runs this layer's attention meanwhile
                want = _by_count(guess, reals)
                self.arena.prefetch(i, want, counters)
                if self.trace is not None:
                    self.trace.append(("prefetch", i, want))
            # Only real tokens' experts are brought in: padding rows (pos -1) whose experts are
            # absent get zeros, and nothing reads a padding row's output.
            ids = np.concatenate([np.asarray(p[3])[real] for p, real in zip(parts, reals)])
            self.profile.add(i, ids)
            if self.trace is not None:
                self.trace.append(("lookup", i, ids, decode))
            # host zeros: no eager op a layer
            ys = [np.zeros((p[3].shape[0], k, h), np.float32) for p in parts]
            if self.in_program is not None and self.arena.missing(i, ids):
                # computed where they live: every routed expert of the layer from the host tier's
                # blocks, the same kernel on the same blocks as from the arena (the same bits),
                # nothing copied in
                self.arena.count_host(i, ids, counters, decode)
                xs, ys = progs.run(stage[kind_of["hexperts"][i]], self.moe_p[i], self.host_trees[i],
                                   self.identity, parts, ys)
            elif self.host_device is not None and self._host_wins(i, ids):
                xs, ys = self._remote_layer(i, stage, parts, ids, counters, decode)
            else:
                experts_l = stage[kind_of["experts"][i]]
                if self.stream is not None:
                    ys, ids = self._stream_layer(i, stage, parts, ids, ys, counters, decode)
                for table in self.arena.passes(i, ids, counters, decode):
                    xs, ys = progs.run(experts_l, self.moe_p[i], self.arena_tree(i), table,
                                       parts, ys)
            if self.prefetch and i + 1 in self.predict_p:
                guess = progs.run(stage[kind_of["predict"][i + 1]], self.predict_p[i + 1], xs)
        return progs.run(stage["head"], self.head_p, heads, xs)

    def _stream_layer(self, i: int, stage: dict, parts, ids: np.ndarray, ys,
                      counters: ExpertCounters, decode: bool):
        """--pcie-frac: the device reads some of the layer's missed experts from host memory (their
        rows go in ys, as a pass does) -> (ys, the ids the arena passes still serve: they always
        run, and give the layer's output)."""
        streamed = self.stream.choose(i, ids, self.arena.slot_of[i])
        if not streamed:
            return ys, ids
        tree, table = self.stream.stage(i, streamed, counters, decode)
        rows = np.isin(ids, streamed)
        counters.routed += int(rows.sum())
        _, ys = self.programs.run(stage[self.kind_of["sexperts"][i]], self.moe_p[i],
                                  self.arena_tree(i, tree), table, parts, ys)
        return ys, ids[~rows]

    def _host_wins(self, layer: int, ids: np.ndarray) -> bool:
        """Whether the host computes this layer's missed experts ("remote"): some miss, and the cost
        rule."""
        flat = ids.reshape(-1)
        missed = flat[self.arena.slot_of[layer][flat] < 0]
        return missed.size > 0 and self.rule.host_wins(np.unique(missed, return_counts=True)[1])

    def _remote_layer(self, i: int, stage: dict, parts, ids: np.ndarray, counters: ExpertCounters,
                      decode: bool):
        """One layer with misses, "remote": the host device computes the missed experts' rows from
        the host tier's blocks (host_experts_stage; the normed input and router ids cross the link,
        the rows come back), the device's experts program the held ones, adding the host's rows in
        (its y_acc)."""
        # the device cache as it is now: what the device computes
        table = self.arena.tables[i]
        absent = np.where(table < 0, self.identity, -1).astype(np.int32)
        hd, dev = self.host_device, jax.devices()[0]
        hparts = [(jax.device_put(p[1], hd), jax.device_put(p[3], hd)) for p in parts]
        host_ys = self.programs.run(stage[self.kind_of["rexperts"][i]], self.host_trees[i],
                                    self.host_biases[i], absent, hparts)
        # counted as host-computed; free slots still take the misses, but this window reads `table`,
        # as it was
        self.arena.count_host(i, ids, counters, decode)
        ys = [jax.device_put(y, dev) for y in host_ys]
        return self.programs.run(stage[self.kind_of["experts"][i]], self.moe_p[i],
                                 self.arena_tree(i), table, parts, ys)

    def build(self, layout: Layout):
        """The program of one stage's layout (stepped_build.py): its stages' builder in the program
        cache."""
        return build_stage(self, layout)

    def close(self) -> None:
        self.arena.host.close()

    def stats(self) -> dict:
        a, host = self.arena, self.arena.host
        return {**self.total.as_dict(), "device_slots": a.n_slots, "device_bytes": a.nbytes,
                "exchanged": a.exchanged, "copy_seconds": round(a.copy_seconds, 3),
                "resident_bytes": host.resident_bytes, "resident_experts": len(host.resident),
                "file_reads": host.file_reads, "file_bytes": host.file_bytes,
                "experts_total": host.n_experts * len(host.layers),
                "pinned": sum(len(p) for p in a.pinned.values()), "prefetch": int(self.prefetch)}


def _by_count(guess: list, reals: list) -> list[int]:
    """The distinct experts of the predicted ids (real tokens only), most often chosen first."""
    ids = np.concatenate([np.asarray(g)[real] for g, real in zip(guess, reals)]).reshape(-1)
    counts = np.bincount(ids)
    return [int(e) for e in np.argsort(-counts, kind="stable") if counts[e] > 0]
