"""Attention over KV that lives partly in host RAM (`--kv-resident N`).

A slot's first N positions sit in the device cache; positions N.. sit in a host store
(engine/execute/kv_host.py). Inside a window program whose KV length reaches past N, each layer's
attention
  1. attends over the device part [0, N) exactly as before (the window's new keys and values at
     positions >= N go to the device cache's scratch position, which nobody reads),
  2. then over the host part [N, kv_len), brought in block by block by a host callback (each block a
     few attention chunks), through the same online-softmax step, in the same chunk order. Each
     fetch first stores the window's new keys and values at positions >= N (idempotent: every block
     of the layer hands them over), so a token's own key and value, and its prompt chunk's, are in
     what it reads.
So the arithmetic is that of all-KV-on-the-device, op for op: the logits are the same bits. Only one
block of host KV is on the device at a time (the window program's temporary memory, which the
program cache reserves from memory_analysis); the persistent device KV is parallel x N.

One callback a block (a decode window on a CPU: one a layer): a callback costs ~65 us on an idle
CPU, and much more when the machine is oversubscribed (the thread that runs it must be scheduled).
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp


class HostKV(Protocol):
    """What the model needs from a host store (engine/execute/kv_host.py holds the numpy one)."""
    resident: int                         # positions a slot keeps on the device
    # the cache's entries: k, v (and k_scale, v_scale for int8)
    names: tuple[str, ...]

    # store new [R, L, ...] entries at positions pos >= resident, then -> [R, length, ...] by name
    def fetch(self, length: int, layer, slots, ends, start, pos, *new) -> tuple: ...
    # positions a fetch brings
    def block(self, rows: int, n_positions: int, chunk: int) -> int: ...


def host_source(host: HostKV, i, slots: jax.Array, pos: jax.Array, stored: dict[str, jax.Array],
                kv_len: int, chunk: int, dtype):
    """The host part of layer i's keys and values, positions [host.resident, kv_len), for attend():
    (fetch(start) -> (k [R, block, K, D], v [R, block, K, Dv]) in dtype, block starts [n], block).
    stored: the window's new entries as the cache keeps them (cast, or int8 with scales; [R, L,
    ...]). A row's keys past its last query position are never visible: the store need not copy them
    (it sends zeros), so padding rows and short rows cost nothing."""
    R = slots.shape[0]
    ends = jnp.max(pos, axis=1) + 1                                                   # [R]
    n_host = kv_len - host.resident
    block = host.block(R, n_host, chunk)
    shapes = tuple(jax.ShapeDtypeStruct((R, block, *stored[n].shape[2:]), stored[n].dtype)
                   for n in host.names)
    layer = jnp.asarray(i, jnp.int32)
    new = [stored[n] for n in host.names]

    def fetch(start):
        got = jax.pure_callback(partial(host.fetch, block), shapes, layer, slots, ends, start,
                                pos, *new)
        got = dict(zip(host.names, got))
        return tuple(_dequantize(got, n, dtype) for n in ("k", "v"))

    starts = host.resident + jnp.arange(n_host // block, dtype=jnp.int32) * block
    return fetch, starts, block


def _dequantize(got: dict, name: str, dtype) -> jax.Array:
    """As transformer._read does for the device cache, so the values are the same bits."""
    x = got[name]
    if x.dtype == jnp.int8:
        return (x.astype(jnp.float32) * got[name + "_scale"][..., None]).astype(dtype)
    return x.astype(dtype)
