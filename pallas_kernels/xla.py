"""The `xla` backend: plain jax.numpy over the same bodies (the fast path on a CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .layout import Layout, layout_for
from .qtypes import table


class _ArraySource:
    """Answers a body's byte requests from a [rows, nbytes] uint8 array; offsets are static numpy arrays."""

    def __init__(self, blocks: jax.Array):
        self.blocks = blocks

    def iota(self, n):
        return np.arange(n, dtype=np.int32)

    def u8(self, offsets):
        return jnp.take(self.blocks, np.asarray(offsets), axis=1).astype(jnp.int32)

    def lookup(self, name, idx):
        return jnp.take(jnp.asarray(table(name)), idx)


def dequantize_rows(blocks: jax.Array, lay: Layout) -> jax.Array:
    """uint8 [..., n_blocks * nbytes] -> float32 [..., n_blocks * values]."""
    lead, row_bytes = blocks.shape[:-1], blocks.shape[-1]
    nb = lay.blocks_in(row_bytes)
    flat = blocks.reshape(-1, lay.nbytes)
    vals = lay.body(_ArraySource(flat))                    # [rows * nb, values]
    return vals.reshape(*lead, nb * lay.values)


def dequantize(blocks, qtype) -> jax.Array:
    blocks = _as_bytes(blocks)
    return dequantize_rows(blocks, layout_for(qtype, blocks.shape[-1]))


def qmatmul(x: jax.Array, w_blocks, qtype, *, precision=None) -> jax.Array:
    """x [T, k] @ W^T with W [n, k] stored as GGUF blocks uint8 [n, row_bytes] -> [T, n] float32."""
    w = dequantize(w_blocks, qtype).astype(x.dtype)
    return jnp.einsum("tk,nk->tn", x, w, precision=precision, preferred_element_type=jnp.float32)


def _as_bytes(blocks) -> jax.Array:
    """GGUF tensor data as uint8 [..., row_bytes] (float16/float32/bfloat16 arrays are viewed as bytes)."""
    if isinstance(blocks, np.ndarray):
        if blocks.dtype != np.uint8:
            blocks = blocks.view(np.uint8)
        return jnp.asarray(blocks)
    if blocks.dtype != jnp.uint8:
        item = blocks.dtype.itemsize
        blocks = jax.lax.bitcast_convert_type(blocks, jnp.uint8)      # [..., n, item]
        blocks = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * item)
    return blocks
