"""--split layers' micro-batches: a window cut into parts that flow through the stages one after
another, so device s+1 runs part p while device s runs part p+1 (pipeline.py dispatches them;
docs/DISTRIBUTED.md).

A cut is a static function of the window's layout (so the program cache knows a window's programs
before its inputs exist: `Cut.parts`), and every part's layout is one the warm-up's set already
holds: cutting adds no programs. Two ways to cut, both keeping each row's arithmetic, so the logits
are one device's bits:

- rows: where every row is computed alone (the cpu backend's kernels: ModelRunner.min_rows = 1),
  each group's R rows are cut into m slices of R/m (m: the largest number up to --micro-batches
  dividing every group's R; rows are powers of two). A packed group's picks go with their rows: a
  part's picks bucket is min(its tokens, the window's), its picks those in its rows (local indices)
  padded with 0, and the parts' logits are gathered back into the window's order (a padding pick,
  token 0's logits, comes from part 0's own token 0, so even the padding rows keep their bits). A
  prompt chunk cut in two is fine: at every stage the first part runs before the second (the donated
  KV chains them), so the second part's queries read the first part's keys from the cache as the
  whole window's queries would.
- groups: elsewhere (XLA's dots give other bits for another row count), whole groups go to parts
  (decode rows in one, a prompt chunk in another): each group keeps its own matmuls (model.Group),
  as in the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import jax
import jax.numpy as jnp
import numpy as np

from ..execute.programs import Layout


@dataclass(frozen=True)
class Cut:
    layout: Layout
    parts: tuple[Layout, ...]       # each part's layout, in the order they run
    # each group's rows in len(parts) slices; else whole groups to parts
    rows: bool
    members: tuple[tuple[int, ...], ...]     # groups mode: the window's groups each part holds


def cut(layout: Layout, most: int, rows_alone: bool) -> Cut:
    """`layout`'s window in up to `most` parts (1 part: the window as it is)."""
    groups = layout.groups
    if rows_alone:
        m = max(d for d in range(1, most + 1) if all(r % d == 0 for r, _, _, _ in groups))
        part = Layout(tuple((r // m, n, a, min(r // m * n, e) if e else 0)
                            for r, n, a, e in groups), layout.kv_len)
        return Cut(layout, (part,) * m, True, ())
    m = min(most, len(groups))
    # contiguous runs of groups, as even as can be
    bounds = [len(groups) * p // m for p in range(m + 1)]
    members = tuple(tuple(range(a, b)) for a, b in pairwise(bounds))
    parts = tuple(Layout(tuple(groups[i] for i in ids), layout.kv_len) for ids in members)
    return Cut(layout, parts, False, members)


def part_inputs(c: Cut, groups: list) -> tuple[list[list[np.ndarray]], list[np.ndarray | None]]:
    """The window's groups (layouts.GroupInput: tokens, pos, slots, picks) -> (each part's program
    inputs, in model.Group's order; per window group, the order its picked logits come back in from
    the parts' joined ones, or None where they are joined as they are)."""
    if not c.rows:
        return ([[a for i in ids for a in groups[i].arrays()] for ids in c.members],
                [None] * len(groups))
    m = len(c.parts)
    args: list[list[np.ndarray]] = [[] for _ in range(m)]
    orders: list[np.ndarray | None] = []
    for g, (r, n, _, _), (_, _, _, e) in zip(groups, c.layout.groups, c.parts[0].groups):
        k = r // m
        local: list[list[int]] = [[] for _ in range(m)]
        order = None
        if g.picks is not None:
            # padding picks are 0s after the first
            real = [int(x) for j, x in enumerate(g.picks) if j == 0 or x != 0]
            where = {}
            for x in real:
                p = x // (k * n)
                where[x] = p * e + len(local[p])
                local[p].append(x - p * k * n)
            for p in range(m):
                local[p] += [0] * (e - len(local[p]))
            # token 0's logits (module doc)
            zero = where.get(0, local[0].index(0) if 0 in local[0] else 0)
            order = np.array([where[int(x)] if (j == 0 or x != 0) else zero
                              for j, x in enumerate(g.picks)], np.int32)
            if np.array_equal(order, np.arange(m * e)):
                order = None
        orders.append(order)
        for p in range(m):
            rows = slice(p * k, (p + 1) * k)
            args[p] += ([g.tokens[rows], g.pos[rows], g.slots[rows]]
                        + ([np.array(local[p], np.int32)] if e else []))
    return args, orders


def join(c: Cut, outs: list[list[jax.Array]], orders: list[np.ndarray | None]) -> list[jax.Array]:
    """The parts' logits (per part, per group of the part) -> the window's, per group."""
    if len(outs) == 1:
        return outs[0]
    if not c.rows:
        return [x for part in outs for x in part]
    return [_concat(tuple(part[i] for part in outs)) if order is None
            else _gather(tuple(part[i] for part in outs), order)
            for i, order in enumerate(orders)]


@jax.jit
def _concat(xs: tuple) -> jax.Array:
    return jnp.concatenate(xs, axis=0)


@jax.jit
def _gather(xs: tuple, order: jax.Array) -> jax.Array:
    return jnp.concatenate(xs, axis=0)[order]
