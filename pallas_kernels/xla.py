"""The `xla` backend: plain jax.numpy over the same bodies (the fast path on a CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from quant_types import table

from .layout import Layout, layout_for


class _ArraySource:
    """Answers a body's byte requests from a [rows, nbytes] uint8 array; offsets are static numpy
    arrays.

    A gather is slow on XLA:CPU (each request materializes a [rows, values] int32 array), but the
    offsets of every body are affine in the bits of the value index j (they are sums of terms like
    (j // 32) * 32 and j % 16). Such a pattern is a strided view of the block bytes: slices,
    reshapes, a transpose and broadcasts, which XLA fuses into one loop. `_strided_view` builds it;
    anything else falls back to a gather.
    """

    def __init__(self, blocks: jax.Array):
        self.blocks = blocks

    def iota(self, n):
        return np.arange(n, dtype=np.int32)

    def u8(self, offsets):
        off = np.asarray(offsets, dtype=np.int64)
        view = _strided_view(self.blocks, off.reshape(-1))
        if view is None:
            view = jnp.take(self.blocks, off.reshape(-1), axis=1)
        return view.reshape(self.blocks.shape[0], *off.shape).astype(jnp.int32)

    def lookup(self, name, idx):
        return jnp.take(jnp.asarray(table(name)), idx)


def _bit_dims(off: np.ndarray) -> list[tuple[int, int]] | None:
    """Write off[j] = base + sum_d stride_d * digit_d(j) over mixed-radix digits of j (outermost
    first), as [(extent, stride), ...]; None when off is not affine in the bits of j."""
    n = len(off)
    if n & (n - 1):
        return None
    bits = n.bit_length() - 1
    coef = [int(off[1 << k] - off[0]) for k in range(bits)]            # least significant bit first
    j = np.arange(n)
    if not np.array_equal(off, off[0] + sum(c * ((j >> k) & 1) for k, c in enumerate(coef))):
        return None
    # [extent, stride], low bits first
    dims: list[list[int]] = []
    for c in coef:
        if dims and ((c == 0 and dims[-1][1] == 0) or (c != 0 and c == dims[-1][1] * dims[-1][0])):
            dims[-1][0] *= 2
        else:
            dims.append([2, c])
    return [(e, s) for e, s in reversed(dims)]


def _strided_view(blocks: jax.Array, off: np.ndarray) -> jax.Array | None:
    rows, _width = blocks.shape
    base = int(off[0])
    if len(off) == 1:
        return blocks[:, base:base + 1]
    dims = _bit_dims(off)
    if dims is None or any(s < 0 for _, s in dims):
        return None
    # by stride, outer first
    moving = sorted([(s, e, i) for i, (e, s) in enumerate(dims) if s > 0], reverse=True)
    spans = [sum((e - 1) * s for s, e, _ in moving[k:]) + 1 for k in range(len(moving) + 1)]
    # views need nested, non-overlapping dims
    for k in range(len(moving) - 1):
        if moving[k][0] < spans[k + 1]:
            return None
    x = blocks[:, base:]
    need = moving[0][0] * moving[0][1] if moving else 1
    if x.shape[1] < need:
        x = jnp.pad(x, ((0, 0), (0, need - x.shape[1])))
    x = x[:, :need]
    shape = [rows]
    for k, (s, e, _) in enumerate(moving):                              # peel one dim at a time
        x = x.reshape(*shape, e, s)[..., :spans[k + 1] if k + 1 < len(moving) else 1]
        shape.append(e)
    # [rows, moving dims by stride]
    x = x.reshape(shape)
    order = [i for _, _, i in moving]
    full = [rows] + [e for e, _ in dims]
    expanded = [rows] + [e if s > 0 else 1 for e, s in dims]
    perm = [0] + [1 + order.index(i) for i in range(len(dims)) if dims[i][1] > 0]
    x = jnp.transpose(x, perm).reshape(expanded)
    return jnp.broadcast_to(x, full).reshape(rows, len(off))


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
    """GGUF tensor data as uint8 [..., row_bytes] (float16/float32/bfloat16 arrays are viewed as
    bytes)."""
    if isinstance(blocks, np.ndarray):
        if blocks.dtype != np.uint8:
            blocks = blocks.view(np.uint8)
        return jnp.asarray(blocks)
    if blocks.dtype != jnp.uint8:
        item = blocks.dtype.itemsize
        blocks = jax.lax.bitcast_convert_type(blocks, jnp.uint8)      # [..., n, item]
        blocks = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * item)
    return blocks
