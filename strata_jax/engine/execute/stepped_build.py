"""The layer stepper's programs (stepped.py): one a stage and kind of layer, each lowered from
shapes only, and the one-program window ("resident") that chains the same stages on the device; and
the kinds of layer (group_kinds: which layers share a program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk

from ...model import Group, QTensor
from ...model.layers import norm_linear_many, route
from ...model.stages import (
    attn_router_stage,
    dense_stage,
    experts_stage,
    host_experts_stage,
    tiered_experts_stage,
)
from ...model.transformer import embed_stage, head_stage
from .programs import Layout

# stages built once per kind of layer
KINDED = ("attn", "experts", "hexperts", "rexperts", "sexperts", "predict", "dense")


def resident_window(core: dict, arenas: dict, tables, host_trees: dict | None, moe: list[int], spec,
                    opts, groups, cache, kv_len: int, kv_host=None, with_hidden: bool = False):
    """One window as one program over the arena (and the host tier's blocks): the stages of the
    layer-stepped chain, in its order, with each MoE layer's page table (tables [n_moe, E] int32, in
    `moe`'s order) read on the device. -> (head_stage's logits (and hiddens), the cache, each MoE
    layer's router ids [n_moe, tokens, k] (the groups' rows concatenated)). Without host_trees a row
    whose expert is absent gets zeros: the caller checks the ids against the tables and runs such a
    window again, layer-stepped."""
    k, h = spec.n_experts_used, spec.hidden
    xs = embed_stage(core["embed"], opts, tuple(g.tokens for g in groups))
    # the host blocks hold every expert
    identity = jnp.arange(spec.n_experts, dtype=jnp.int32)
    ids_of = []
    for i in range(spec.n_layers):
        if i in core["dense"]:
            xs, cache = dense_stage(core["dense"][i], i, spec, opts, groups, xs, cache, kv_len)
            continue
        j = moe.index(i)
        parts, cache = attn_router_stage(core["attn"][i], spec.kv_layer(i), spec, opts, groups, xs,
                                         cache, kv_len, kv_host)
        ys = [jnp.zeros((p[3].shape[0], k, h), jnp.float32) for p in parts]
        moe_p, table = core["shared"][i], tables[j]

        def from_arena(parts=parts, ys=ys, moe_p=moe_p, arena=arenas[i], table=table):
            return experts_stage(moe_p, arena, table, spec, opts, parts, ys)[0]
        if host_trees is None:
            xs = from_arena()
        elif _one_call(arenas[i], host_trees[i], opts):
            xs = tiered_experts_stage(moe_p, arenas[i], host_trees[i], table, spec, opts,
                                      groups, parts)
        else:
            # [tokens, 1]
            real = jnp.concatenate([(g.pos.reshape(-1) >= 0)[:, None] for g in groups])
            ids = jnp.concatenate([p[3] for p in parts])
            here = jnp.all((table[ids] >= 0) | ~real)

            def from_host(parts=parts, ys=ys, moe_p=moe_p, tree=host_trees[i]):
                return experts_stage(moe_p, tree, identity, spec, opts, parts, ys)[0]
            xs = jax.lax.cond(here, from_arena, from_host)
        ids_of.append(jnp.concatenate([p[3] for p in parts]))
    out = head_stage(core["head"], spec, opts, groups, xs, with_hidden)
    return out, cache, jnp.stack(ids_of)


def _one_call(arena: dict, host: dict, opts) -> bool:
    """Whether a layer's experts run as one kernel call over its arena slots and its host blocks
    (tiered_experts_stage): the cpu kernels, and block weights of the kernels' own types in both (a
    float arena, or a type multiplied through dequantized tiles, takes the lax.cond)."""
    return pk.is_cpu(opts.backend) and all(isinstance(t[n], QTensor)
                                           and pk.cpu_multiplies(t[n].qtype)
                                           for t in (arena, host) for n in t)


def predict_stage(p: tuple, spec, opts, xs) -> list:
    """The next layer's router over this layer's output: p (its ffn_norm, its Router), x [R, L, h]
    per group -> expert ids [R*L, k]."""
    norm, router = p
    out = []
    for x in xs:
        R, L, _ = x.shape
        hx = norm_linear_many(x, norm, spec.rms_eps, [], opts.backend)[0].reshape(R * L, -1)
        out.append(route(hx, router.weight, spec, opts.backend, router.bias,
                         router.logit_bias)[1])
    return out


def _signature(tree) -> tuple:
    """What a program built for `tree` depends on: its structure (QTensors' quant types and logical
    shapes are static aux data there) and every leaf's shape and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in leaves)


def group_kinds(stage: str, trees: dict[int, object]) -> tuple[dict[int, str], dict[str, int]]:
    """Layers -> the stage name of their kind ("attn" for the first signature met, then "attn.1",
    ...), and each kind's stage name -> its first layer (whose weights' shapes its program is built
    for)."""
    sigs: list[tuple] = []
    kind_of: dict[int, str] = {}
    first_of: dict[str, int] = {}
    for i in sorted(trees):
        sig = _signature(trees[i])
        if sig not in sigs:
            sigs.append(sig)
        k = sigs.index(sig)
        kind_of[i] = stage if k == 0 else f"{stage}.{k}"
        first_of.setdefault(kind_of[i], i)
    return kind_of, first_of


def _sds(tree, sharding=None):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                 sharding=sharding), tree)


def build_stage(self, layout: Layout):
    """The program of a stage's layout for the layer stepper `self` (its weights' shapes, kinds and
    arena), lowered from shapes only and compiled."""
    spec, opts = self.spec, self.opts
    dtype = jnp.dtype(opts.dtype)
    S = jax.ShapeDtypeStruct
    k, h = spec.n_experts_used, spec.hidden
    groups = tuple(Group(S((r, n), jnp.int32), S((r, n), jnp.int32), S((r,), jnp.int32), a,
                         S((e,), jnp.int32) if e else None)
                   for r, n, a, e in layout.groups)
    xs = [S((r, n, h), dtype) for r, n, _, _ in layout.groups]
    if layout.stage == "resident":
        kv, kv_host, hidden, moe = layout.kv_len, self.kv.host, self.with_hidden, self.moe
        const_tree = self.resident_consts[1]

        # Flat lists, not the nested trees: a call hands XLA ~400 arrays, and the trees'
        # QTensors flattened in Python each call cost as much again (as window_program.py's).
        def window(consts, arena_leaves, tables, gs, cache):
            core, host = jax.tree_util.tree_unflatten(const_tree, consts)
            return resident_window(core, self.arena_trees(arena_leaves), tables, host, moe, spec,
                                   opts, gs, cache, kv, kv_host, hidden)
        fn = jax.jit(window, donate_argnums=(4,))
        return fn.lower(_sds(self.resident_consts[0]), _sds(self.arena_leaves()),
                        S((len(self.moe), spec.n_experts), jnp.int32),
                        groups, _sds(self.kv.arrays)).compile()
    if layout.stage == "embed":
        fn = jax.jit(lambda p, tokens: embed_stage(p, opts, tokens))
        return fn.lower(_sds(self.embed_p), tuple(g.tokens for g in groups)).compile()
    base = layout.stage.partition(".")[0]
    first = self.first_of.get(layout.stage)       # the first layer of the stage's kind
    if base in KINDED and first is None:
        raise ValueError(f"unknown stage {layout.stage!r}: this model's kinds are "
                         f"{sorted(self.first_of)}")
    if base == "attn":
        kv = layout.kv_len
        host = self.kv.host
        fn = jax.jit(lambda lp, i, cache, gs, xs: attn_router_stage(lp, i, spec, opts, gs, xs,
                                                                    cache, kv, host),
                     donate_argnums=(2,))
        return fn.lower(_sds(self.attn_p[first]), S((), jnp.int32), _sds(self.kv.arrays), groups,
                        xs).compile()
    if base == "dense":
        kv = layout.kv_len
        fn = jax.jit(lambda lp, i, cache, gs, xs: dense_stage(lp, i, spec, opts, gs, xs, cache, kv),
                     donate_argnums=(2,))
        return fn.lower(_sds(self.dense_p[first]), S((), jnp.int32), _sds(self.kv.arrays), groups,
                        xs).compile()
    if base in ("experts", "hexperts", "sexperts"):
        tree = (self.arena_tree(first) if base == "experts" else self.stream_sds(first)
                if base == "sexperts"
                else self.host_trees[first])
        parts = [(S((r, n, h), dtype), S((r * n, h), dtype), S((r * n, k), jnp.float32),
                  S((r * n, k), jnp.int32))
                 for r, n, _, _ in layout.groups]
        ys = [S((r * n, k, h), jnp.float32) for r, n, _, _ in layout.groups]
        fn = jax.jit(lambda lp, arena, table, parts, ys: experts_stage(lp, arena, table, spec, opts,
                                                                       parts, ys),
                     donate_argnums=(4,))
        # the streamed ones keep their memory kind
        trees = tree if base == "sexperts" else _sds(tree)
        return fn.lower(_sds(self.moe_p[first]), trees, S((spec.n_experts,), jnp.int32), parts,
                        ys).compile()
    # on the host device: its inputs' and blocks' shardings say so
    if base == "rexperts":
        on = jax.sharding.SingleDeviceSharding(self.host_device)
        hparts = [(S((r * n, h), dtype, sharding=on), S((r * n, k), jnp.int32, sharding=on))
                  for r, n, _, _ in layout.groups]
        fn = jax.jit(lambda tree, biases, absent, hparts: host_experts_stage(
            tree, absent, spec, hparts, opts.host_backend, biases))
        return fn.lower(_sds(self.host_trees[first], on), _sds(self.host_biases[first], on),
                        S((spec.n_experts,), jnp.int32, sharding=on), hparts).compile()
    if base == "predict":
        fn = jax.jit(lambda p, xs: predict_stage(p, spec, opts, xs))
        return fn.lower(_sds(self.predict_p[first]), xs).compile()
    if layout.stage == "head":
        hidden = self.with_hidden
        fn = jax.jit(lambda p, gs, xs: head_stage(p, spec, opts, gs, xs, hidden))
        return fn.lower(_sds(self.head_p), groups, xs).compile()
    raise ValueError(f"unknown stage {layout.stage!r}")
