"""Attention over KV that lives partly in host RAM (`--kv-resident N`).

A slot's first N positions sit in the device cache; positions N.. sit in a host store (engine/kv_host.py).
Inside a window program whose KV length reaches past N, each layer's attention
  1. writes the window's new keys and values at positions >= N to the host store (a host callback; the
     device cache sends them to its scratch position, which nobody reads),
  2. attends over the device part [0, N) exactly as before,
  3. then over the host part [N, kv_len), brought in block by block by a second host callback (each
     block a few attention chunks), through the same online-softmax step, in the same chunk order.
So the arithmetic is that of all-KV-on-the-device, op for op: the logits are the same bits. Only one
block of host KV is on the device at a time (the window program's temporary memory, which the
program cache reserves from memory_analysis); the persistent device KV is parallel x N.

The fetch takes the write's result as an operand, so XLA cannot run it before the write: a token's own
key and value (and its prompt chunk's) are in the store before any query of the window reads them.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


class HostKV(Protocol):
    """What the model needs from a host store (engine/kv_host.py holds the numpy one)."""
    resident: int                         # positions a slot keeps on the device
    names: tuple[str, ...]                # the cache's entries: k, v (and k_scale, v_scale for int8)

    def write(self, layer, slots, pos, *arrays) -> np.ndarray: ...          # -> int32 token
    def fetch(self, length: int, token, layer, slots, ends, start) -> tuple: ...  # [R, length, ...] by name
    def block(self, rows: int, n_positions: int, chunk: int) -> int: ...   # positions a fetch brings


def write_host(host: HostKV, i, slots: jax.Array, pos: jax.Array, stored: dict[str, jax.Array]) -> jax.Array:
    """Hand layer i's new entries (as the cache stores them: cast, or int8 with scales; [R, L, ...]) at
    positions >= host.resident to the host store. -> an int32 token that fetches must take."""
    args = [stored[n] for n in host.names]
    return io_callback(host.write, jax.ShapeDtypeStruct((), jnp.int32), jnp.asarray(i, jnp.int32), slots, pos, *args)


def host_source(host: HostKV, i, slots: jax.Array, pos: jax.Array, token: jax.Array, kv_len: int, chunk: int,
                entry_shapes: dict[str, tuple], entry_dtypes: dict[str, jnp.dtype], dtype):
    """The host part of layer i's keys and values, positions [host.resident, kv_len), for attend():
    (fetch(start) -> (k [R, block, K, D], v [R, block, K, Dv]) in dtype, block starts [n], block).
    A row's keys past its last query position are never visible: the store need not copy them (it sends
    zeros), so padding rows and short rows cost nothing."""
    R = slots.shape[0]
    ends = jnp.max(pos, axis=1) + 1                                                   # [R]
    n_host = kv_len - host.resident
    block = host.block(R, n_host, chunk)
    shapes = tuple(jax.ShapeDtypeStruct((R, block, *entry_shapes[n]), entry_dtypes[n]) for n in host.names)
    layer = jnp.asarray(i, jnp.int32)

    def fetch(start):
        got = dict(zip(host.names, jax.pure_callback(partial(host.fetch, block), shapes, token, layer, slots, ends,
                                                            start)))
        return tuple(_dequantize(got, n, dtype) for n in ("k", "v"))

    starts = host.resident + jnp.arange(n_host // block, dtype=jnp.int32) * block
    return fetch, starts, block


def _dequantize(got: dict, name: str, dtype) -> jax.Array:
    """As transformer._read does for the device cache, so the values are the same bits."""
    x = got[name]
    if x.dtype == jnp.int8:
        return (x.astype(jnp.float32) * got[name + "_scale"][..., None]).astype(dtype)
    return x.astype(dtype)
