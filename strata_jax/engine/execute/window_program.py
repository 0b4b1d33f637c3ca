"""The window program: a whole window, every group of it, as one compiled forward() (the runner's
"window" stage in the program cache; the layer stepper's stages are stepped_build.py's).

Its inputs are the weights, the KV cache (donated: updated in place), the expert profile's counts
when counted (donated too), then each group's tokens, positions and slots (and picks); it returns
forward()'s ForwardOut. Sampling is a small program of its own (runner.py): keeping it out of every
window program makes each build ~0.7 s faster on a CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...model import Group, forward
from .kv_cache import KVCache
from .programs import Layout


def build_window(layout: Layout, params: dict, spec, opts, kv: KVCache, with_hidden: bool,
                 counts=None, shards=None):
    """Compile the window program of `layout`, lowered from shapes only: the builder thread compiles
    while the engine thread runs, donates and replaces the arrays. The program takes the weights as
    one flat list (`flat_weights(params)`), not the nested dicts: a call hands XLA ~280 arrays a
    window, and flattening the dicts each call cost 0.28 ms of a ~12 ms SmolLM2 decode step on
    Zen 1 (docs/BENCHMARKS.md, "Where a SmolLM2 decode step goes"). counts: the expert profile's
    counts array (its shape), or None when routing is not counted in the program. shards: --split
    experts' mesh (devices.ExpertShards): the program runs over every device of it, else None (one
    device)."""
    counting = counts is not None
    weights, tree = jax.tree_util.tree_flatten(params)

    def window(weights, cache, *flat):
        params = jax.tree_util.tree_unflatten(tree, weights)
        counts, flat = (flat[0], flat[1:]) if counting else (None, flat)
        groups, at = [], 0
        for _, _, all_logits, picks in layout.groups:
            groups.append(Group(*flat[at:at + 3], all_logits, flat[at + 3] if picks else None))
            at += 4 if picks else 3
        return forward(params, spec, opts, tuple(groups), cache, layout.kv_len,
                       with_hidden=with_hidden, host=kv.host, counts=counts)

    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    args = [counts] if counting else []
    for rows, length, _, picks in layout.groups:
        args += ([S((rows, length), i32), S((rows, length), i32), S((rows,), i32)]
                 + [S((picks,), i32)] * bool(picks))
    donate = (1, 2) if counting else (1,)
    if shards is not None:
        fn = shards.wrap(window, params, 1 + len(args))
        rep = shards.replicated
        return jax.jit(fn, donate_argnums=donate).lower(shards.shapes(weights),
                                                        shards.shapes(kv.arrays, rep),
                                                        *shards.shapes(args, rep)).compile()
    return jax.jit(window, donate_argnums=donate).lower(shapes(weights), shapes(kv.arrays),
                                                        *shapes(args)).compile()


def flat_weights(params: dict) -> list:
    """The weights as a window program takes them: the leaves in the tree's own order."""
    return jax.tree_util.tree_leaves(params)


def shapes(tree):
    """Arrays -> ShapeDtypeStructs (other leaves as they are): what lowering a program needs of
    them."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "dtype") else a, tree)


def cache_last(res):
    """A window program's ForwardOut -> (it, its cache): KVCache.through's form."""
    return res, res.cache
