"""The `pallas` and `interpret` backends: Pallas kernels for GPUs through Pallas' Triton backend.

Triton runs on Ampere and newer (RTX 3090, L40S, RTX PRO 5000, H100/H200), the cards Strata's users
have. The same kernels run in Pallas' interpret mode on a CPU, which is how the tests check them.

Every kernel reads weights as raw GGUF bytes through indexed loads (`_RefSource`) and dequantizes
them in registers with the shared bodies (bodies.py); the float matrix never exists in memory.
Triton wants power-of-two tensor shapes, so tiles are powers of two and ragged edges are handled by
clamping the rows read (loads stay in bounds) and slicing the padded output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from quant_types import table

from .layout import Layout

_TRITON = plt.CompilerParams(num_warps=4, num_stages=2)


class _RefSource:
    """Answers a body's byte requests with gathers from the flat weight buffer: block b's byte k is
    at base[b] + k. `base` is [rows] int32."""

    def __init__(self, w_ref, base, tables: dict):
        self.w_ref, self.base, self.tables = w_ref, base, tables

    def iota(self, n):
        return jnp.arange(n, dtype=jnp.int32)

    def u8(self, offsets):
        return self.w_ref[self.base[:, None] + offsets[None, :]].astype(jnp.int32)

    def lookup(self, name, idx):
        return self.tables[name][idx]


def _tables(lay: Layout) -> list[jax.Array]:
    return [jnp.asarray(table(name)) for name in lay.tables]


def _call(kernel, out_shape, grid, out_specs, interpret: bool):
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, out_specs=out_specs,
        interpret=interpret, compiler_params=None if interpret else _TRITON,
    )


# ---- dequantize ----------------------------------------------------------------------------------

def dequantize_rows(blocks: jax.Array, lay: Layout, *, interpret: bool) -> jax.Array:
    """uint8 [..., n_blocks * nbytes] -> float32 [..., n_blocks * values]."""
    lead, row_bytes = blocks.shape[:-1], blocks.shape[-1]
    nb = lay.blocks_in(row_bytes)
    total = blocks.size // lay.nbytes
    per_prog = max(1, min(4096 // lay.values, pl.next_power_of_2(total)))   # ~4K values a program

    def kernel(w_ref, *refs):
        *tbl_refs, o_ref = refs
        b = jnp.minimum(pl.program_id(0) * per_prog + jnp.arange(per_prog, dtype=jnp.int32),
                        total - 1)
        src = _RefSource(w_ref, b * lay.nbytes, dict(zip(lay.tables, tbl_refs)))
        o_ref[...] = lay.body(src)

    n_prog = pl.cdiv(total, per_prog)
    out = _call(kernel, jax.ShapeDtypeStruct((n_prog * per_prog, lay.values), jnp.float32),
                (n_prog,),
                pl.BlockSpec((per_prog, lay.values), lambda i: (i, 0)),
                interpret)(blocks.reshape(-1), *_tables(lay))
    return out[:total].reshape(*lead, nb * lay.values)


# ---- quantized matmul ----------------------------------------------------------------------------

def _tile_k(lay: Layout, nb_row: int) -> int:
    """Blocks a K step: up to 256 values (the dot wants >= 16), a divisor of the blocks in a row."""
    nb = max(1, 256 // lay.values)
    while nb > 1 and nb_row % nb:
        nb //= 2
    if nb * lay.values < 16:
        raise ValueError(f"{lay.qtype.name}: rows of {nb_row * lay.values} values cannot be cut "
                         "into K tiles of >= 16 values for the Pallas matmul; use the xla backend")
    return nb


def _matmul_tile(x_ref, w_ref, tbls, lay: Layout, *, t0, n0, n_rows, w_base, row_bytes, nb_row, bt,
                 bn, nb, out_dtype):
    """acc[bt, bn] = x[t0:t0+bt] @ W[n0:n0+bn]^T, W's rows at w_base + row * row_bytes."""
    rr = jnp.arange(bn * nb, dtype=jnp.int32)
    row = jnp.minimum(n0 + rr // nb, n_rows - 1)                  # [bn * nb] block-rows, clamped
    row_base = w_base + row * row_bytes + (rr % nb) * lay.nbytes
    kv = nb * lay.values

    def step(c, acc):
        src = _RefSource(w_ref, row_base + c * (nb * lay.nbytes), tbls)
        w = lay.body(src).reshape(bn, kv).astype(x_ref.dtype)    # [bn, kv]
        x = x_ref[pl.ds(t0, bt), pl.ds(c * kv, kv)]               # [bt, kv]
        return acc + plt.dot(x, w, trans_b=True)

    return jax.lax.fori_loop(0, nb_row // nb, step,
                             jnp.zeros((bt, bn), jnp.float32)).astype(out_dtype)


def _tiles(T: int, N: int) -> tuple[int, int]:
    bt = max(16, min(64, pl.next_power_of_2(T)))
    bn = 64 if N >= 64 else max(16, pl.next_power_of_2(N))
    return bt, bn


def qmatmul(x: jax.Array, w_blocks: jax.Array, lay: Layout, *, interpret: bool) -> jax.Array:
    """x [T, K] @ W^T with W [N, K] as GGUF blocks uint8 [N, row_bytes] -> float32 [T, N]."""
    T, K = x.shape
    N, row_bytes = w_blocks.shape
    nb_row = lay.blocks_in(row_bytes)
    if nb_row * lay.values != K:
        raise ValueError(f"qmatmul: x has {K} columns but the weight rows hold "
                         f"{nb_row * lay.values} values")
    bt, bn = _tiles(T, N)
    nb = _tile_k(lay, nb_row)
    Tp = pl.cdiv(T, bt) * bt
    xp = jnp.pad(x, ((0, Tp - T), (0, 0)))

    def kernel(x_ref, w_ref, *refs):
        *tbl_refs, o_ref = refs
        o_ref[...] = _matmul_tile(
            x_ref, w_ref, dict(zip(lay.tables, tbl_refs)), lay, t0=pl.program_id(0) * bt,
            n0=pl.program_id(1) * bn, n_rows=N, w_base=0, row_bytes=row_bytes, nb_row=nb_row,
            bt=bt, bn=bn, nb=nb, out_dtype=jnp.float32)

    grid = (Tp // bt, pl.cdiv(N, bn))
    out = _call(kernel, jax.ShapeDtypeStruct((Tp, grid[1] * bn), jnp.float32), grid,
                pl.BlockSpec((bt, bn), lambda i, j: (i, j)), interpret)(xp, w_blocks.reshape(-1),
                                                                        *_tables(lay))
    return out[:T, :N]


# ---- expert (grouped) matmul ---------------------------------------------------------------------

def expert_matmul_tiles(x_tiles: jax.Array, tile_expert: jax.Array, w_blocks: jax.Array,
                        lay: Layout, *, bt: int, interpret: bool) -> jax.Array:
    """Row tiles x_tiles [n_tiles * bt, K], each tile multiplied by one expert (tile_expert
    [n_tiles], -1: an empty tile, left zero) of w_blocks [E, N, row_bytes] -> float32 [n_tiles * bt,
    N]. Only the experts named in tile_expert are read."""
    E, N, row_bytes = w_blocks.shape
    if E * N * row_bytes >= 2**31:
        raise ValueError("expert tensor over 2 GiB: the kernel's int32 byte offsets cannot "
                         "address it")
    nb_row = lay.blocks_in(row_bytes)
    _, bn = _tiles(bt, N)
    nb = _tile_k(lay, nb_row)
    n_tiles = tile_expert.shape[0]

    def kernel(te_ref, x_ref, w_ref, *refs):
        *tbl_refs, o_ref = refs
        i, j = pl.program_id(0), pl.program_id(1)    # read outside pl.when: interpret mode needs it
        e = te_ref[i]
        o_ref[...] = jnp.zeros((bt, bn), jnp.float32)

        @pl.when(e >= 0)
        def _():
            o_ref[...] = _matmul_tile(
                x_ref, w_ref, dict(zip(lay.tables, tbl_refs)), lay, t0=i * bt, n0=j * bn, n_rows=N,
                w_base=e * (N * row_bytes), row_bytes=row_bytes,
                nb_row=nb_row, bt=bt, bn=bn, nb=nb, out_dtype=jnp.float32)

    grid = (n_tiles, pl.cdiv(N, bn))
    out = _call(kernel, jax.ShapeDtypeStruct((n_tiles * bt, grid[1] * bn), jnp.float32), grid,
                pl.BlockSpec((bt, bn), lambda i, j: (i, j)), interpret)(
        tile_expert, x_tiles, w_blocks.reshape(-1), *_tables(lay))
    return out[:, :N]
