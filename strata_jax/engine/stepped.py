"""Layer-stepped windows: how a window runs when the experts do not all sit on the device.

The window becomes a chain of small programs, each built once per layout shape and shared by every
layer (the layer's weights and index are arguments), all held in the ProgramCache (so its bound and its
out-of-memory handling apply; their layouts carry a `stage` name):

    embed -> for each layer: attn (attention, FFN norm, router: the expert ids come back to the host)
                             the host makes the chosen experts resident in the device arena
                             experts (the expert matmul over arena slots; the shared expert; residual)
          -> head (final norm and logits)

The arithmetic is forward()'s, op for op and in the same order, so logits are the same bits as with
every expert on the device. A layer whose window chose more distinct experts than the arena has slots
runs its experts program in several passes; each pass fills in the rows whose experts it holds.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from ..experts import EXPERT_TENSORS, ExpertArena, ExpertCounters
from ..model import Group, QTensor
from ..model.transformer import attn_router_stage, embed_stage, experts_stage, head_stage
from .programs import Layout

STAGES = ("embed", "attn", "experts", "head")


def _sds(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


class LayerStepper:
    def __init__(self, runner, arena: ExpertArena, qtypes: dict[str, str], expert_shapes: dict[str, tuple]):
        self.runner = runner
        self.arena = arena
        self.spec, self.opts = runner.spec, runner.opts
        params = runner.params
        layers = params["layers"]
        if not all("router" in lp for lp in layers):
            raise NotImplementedError("the expert tiers need every layer to be a MoE layer (dense layers among "
                                      "MoE ones are not supported yet); use --expert-cache auto")
        self.embed_p = {"embed": params["embed"]}
        self.head_p = {"norm": params["norm"], "output": params["output"]}
        self.attn_p = [{k: v for k, v in lp.items() if not k.startswith("sh_")} for lp in layers]
        self.moe_p = [{k: v for k, v in lp.items() if k.startswith("sh_")} for lp in layers]
        for i in range(1, len(layers)):     # one program serves every layer: their weights must match
            if _sds(self.attn_p[i]) != _sds(self.attn_p[0]) or _sds(self.moe_p[i]) != _sds(self.moe_p[0]):
                raise NotImplementedError(f"layer {i}'s weights differ in shape or type from layer 0's: "
                                          "the expert tiers need uniform layers; use --expert-cache auto")
        self.qtypes = qtypes                 # tensor -> quant type name, or None where the arena holds floats
        self.shapes = expert_shapes          # tensor -> logical shape of one expert [n, k]
        self.index = [jnp.int32(i) for i in range(len(layers))]
        self.last = ExpertCounters()         # the last window's counters
        self.total = ExpertCounters()

    def arena_tree(self, layer: int) -> dict:
        leaves, N = self.arena.arena[layer], self.arena.n_slots
        return {n: QTensor(leaves[n], self.qtypes[n], (N, *self.shapes[n])) if self.qtypes[n] else leaves[n]
                for n in EXPERT_TENSORS}

    def stage_layouts(self, layout: Layout) -> list[Layout]:
        return [replace(layout, stage=s, kv_len=layout.kv_len if s == "attn" else 0) for s in STAGES]

    def run(self, groups, layout: Layout) -> list:
        """One window (GroupInputs) -> logits per group, as forward() gives them."""
        counters = self.last = ExpertCounters()
        try:
            return self._run(groups, self.stage_layouts(layout), counters)
        finally:
            self.total.add(counters)          # a window that failed half way still moved what it moved

    def _run(self, groups, layouts: list[Layout], counters: ExpertCounters) -> list:
        progs, r = self.runner.programs, self.runner
        embed_l, attn_l, experts_l, head_l = layouts
        k, h = self.spec.n_experts_used, self.spec.hidden
        gs = tuple(Group(g.tokens, g.pos, g.slots, g.all_logits) for g in groups)
        decode = all(g.tokens.shape[1] == 1 for g in groups)            # no prompt chunk in the window
        reals = [np.asarray(g.pos).reshape(-1) >= 0 for g in groups]      # [R*L] per group: real tokens
        xs = progs.run(embed_l, self.embed_p, tuple(g.tokens for g in groups))
        for i in range(len(self.attn_p)):
            parts, r.cache = progs.run(attn_l, self.attn_p[i], self.index[i], r.cache, gs, xs)
            # Only real tokens' experts are brought in: padding rows (pos -1) whose experts are absent get
            # zeros, and nothing reads a padding row's output.
            ids = np.concatenate([np.asarray(p[3])[real] for p, real in zip(parts, reals)])
            ys = [jnp.zeros((p[3].shape[0], k, h), jnp.float32) for p in parts]
            for table in self.arena.passes(i, ids, counters, decode):
                xs, ys = progs.run(experts_l, self.moe_p[i], self.arena_tree(i), table, parts, ys)
        return progs.run(head_l, self.head_p, gs, xs)

    def build(self, layout: Layout):
        spec, opts = self.spec, self.opts
        dtype = jnp.dtype(opts.dtype)
        S = jax.ShapeDtypeStruct
        k, h = spec.n_experts_used, spec.hidden
        groups = tuple(Group(S((r, n), jnp.int32), S((r, n), jnp.int32), S((r,), jnp.int32), a)
                       for r, n, a in layout.groups)
        xs = [S((r, n, h), dtype) for r, n, _ in layout.groups]
        if layout.stage == "embed":
            fn = jax.jit(lambda p, tokens: embed_stage(p, opts, tokens))
            return fn.lower(_sds(self.embed_p), tuple(g.tokens for g in groups)).compile()
        if layout.stage == "attn":
            kv = layout.kv_len
            host = self.runner.kv_host
            fn = jax.jit(lambda lp, i, cache, gs, xs: attn_router_stage(lp, i, spec, opts, gs, xs, cache, kv, host),
                         donate_argnums=(2,))
            return fn.lower(_sds(self.attn_p[0]), S((), jnp.int32), _sds(self.runner.cache), groups, xs).compile()
        if layout.stage == "experts":
            parts = [(S((r, n, h), dtype), S((r * n, h), dtype), S((r * n, k), jnp.float32), S((r * n, k), jnp.int32))
                     for r, n, _ in layout.groups]
            ys = [S((r * n, k, h), jnp.float32) for r, n, _ in layout.groups]
            fn = jax.jit(lambda lp, arena, table, parts, ys: experts_stage(lp, arena, table, spec, opts, parts, ys),
                         donate_argnums=(4,))
            return fn.lower(_sds(self.moe_p[0]), _sds(self.arena_tree(self.arena.layers[0])),
                            S((spec.n_experts,), jnp.int32), parts, ys).compile()
        if layout.stage == "head":
            fn = jax.jit(lambda p, gs, xs: head_stage(p, spec, opts, gs, xs))
            return fn.lower(_sds(self.head_p), groups, xs).compile()
        raise ValueError(f"unknown stage {layout.stage!r}")

    def stats(self) -> dict:
        a, host = self.arena, self.arena.host
        return {**self.total.as_dict(), "device_slots": a.n_slots, "device_bytes": a.nbytes,
                "exchanged": a.exchanged, "copy_seconds": round(a.copy_seconds, 3),
                "resident_bytes": host.resident_bytes, "resident_experts": len(host.resident),
                "file_reads": host.file_reads, "experts_total": host.n_experts * len(host.layers)}
