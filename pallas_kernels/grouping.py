"""Rows routed to experts, regrouped into tiles that each belong to one expert (static shapes).

An MoE layer sends each token to k experts. Sorting those rows by expert and padding every expert's
group to a whole number of tiles lets a kernel multiply each tile by one expert's weights, reading
only the experts that some row chose. The number of tiles is bounded statically by
ceil(R / tile) + min(E, R), so the shapes (and so the compiled program) depend only on R.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Groups:
    order: jax.Array         # [R] rows sorted by expert
    dest: jax.Array          # [R] padded position of the i-th sorted row
    tile_expert: jax.Array   # [n_tiles] expert of each tile, -1 where unused
    tile: int

    @property
    def n_tiles(self) -> int:
        return self.tile_expert.shape[0]


def group_rows(expert_ids: jax.Array, n_experts: int, tile: int) -> Groups:
    ids = expert_ids.astype(jnp.int32)
    R = ids.shape[0]
    n_tiles = -(-R // tile) + min(n_experts, R)
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    sizes = jnp.bincount(ids, length=n_experts)
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    group_start = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(R, dtype=jnp.int32) - group_start[sorted_ids]
    dest = (padded_start[sorted_ids] + rank).astype(jnp.int32)
    tile_pos = jnp.arange(n_tiles, dtype=jnp.int32) * tile
    owner = jnp.searchsorted(padded_end, tile_pos, side="right").astype(jnp.int32)
    tile_expert = jnp.where(owner < n_experts, owner, -1)
    return Groups(order, dest, tile_expert, tile)


def scatter_rows(x: jax.Array, g: Groups) -> jax.Array:
    """x [R, K] -> [n_tiles * tile, K], rows at their padded positions, zeros elsewhere."""
    out = jnp.zeros((g.n_tiles * g.tile, x.shape[1]), x.dtype)
    return out.at[g.dest].set(x[g.order])


def gather_rows(y: jax.Array, g: Groups) -> jax.Array:
    """The inverse of scatter_rows: [n_tiles * tile, N] -> [R, N] in the original row order."""
    out = jnp.zeros((g.order.shape[0], y.shape[1]), y.dtype)
    return out.at[g.order].set(y[g.dest])
