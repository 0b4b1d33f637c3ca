"""Model weights as a pytree: GGUF tensors kept in their quant blocks, or dequantized once at load.

A `QTensor` holds a weight matrix as GGUF blocks (uint8 [..., rows, row_bytes]) with its quant type
and logical shape as static pytree data, so jit specializes on the type and the kernels read the
blocks. `linear` multiplies by either kind of weight.

Where weights are dequantized at load (`weights="dequantized"`): on a CPU a float32 matmul over a
dequantized matrix runs several times faster than XLA's dequantize-multiply fusion over the blocks
(DESIGN.md, Speed), so small models on a CPU keep a float copy; GPUs keep blocks and read them with
the Pallas kernels.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk


# A dataclass pytree: flattened in C++ (a class with Python tree_flatten costs a callback a weight
# on every program call: ~0.2 ms of a SmolLM2 decode step's dispatch).
@partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=["qtype", "shape"])
@dataclass(frozen=True)
class QTensor:
    data: jax.Array              # uint8 [..., rows, row_bytes]: GGUF blocks
    qtype: str                   # static
    shape: tuple[int, ...]       # static: logical shape [..., rows, cols]

    @property
    def nbytes(self) -> int:
        return int(self.data.size)


# A weight is a QTensor (GGUF blocks, [..., n, k] logically) or a float array stored transposed
# ([..., k, n]); the router and the embedding table are float [n, k] (see load.py).
Weight = jax.Array | QTensor


def linear(x: jax.Array, w: Weight, backend: str, transposed: bool = True) -> jax.Array:
    """x [..., k] @ W^T for W [n, k] (a float W stored [k, n], unless `transposed` is False)
    -> [..., n] in x's dtype (float32 accumulation)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, QTensor):
        y = pk.qmatmul(x2, w.data, w.qtype, backend=backend)
    elif transposed:
        y = jnp.matmul(x2, w.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        y = jnp.einsum("tk,nk->tn", x2, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*lead, -1)


def linear_many(x: jax.Array, ws: list[Weight], backend: str) -> list[jax.Array]:
    """[linear(x, w) for w in ws], with the same bits; weights in blocks go in one kernel call where
    the backend has one (cpu: q, k, v or gate, up of a decode step in one call)."""
    if not all(isinstance(w, QTensor) for w in ws):
        return [linear(x, w, backend) for w in ws]
    lead = x.shape[:-1]
    ys = pk.qmatmul_many(x.reshape(-1, x.shape[-1]), [(w.data, w.qtype) for w in ws],
                         backend=backend)
    return [y.astype(x.dtype).reshape(*lead, -1) for y in ys]


def embed_rows(table: Weight, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the embedding table, dequantizing only the rows asked for."""
    if isinstance(table, QTensor):
        return pk.dequantize(table.data[ids], table.qtype).astype(dtype)
    return table[ids].astype(dtype)


def expert_linear_tiles(x_tiles: jax.Array, tile_expert: jax.Array, w: Weight,
                        backend: str) -> jax.Array:
    """Grouped rows [n_tiles * tile, k] times their tile's expert of W [E, n, k] (float: stored [E,
    k, n]) -> [n_tiles * tile, n]."""
    if isinstance(w, QTensor):
        y = pk.expert_matmul_tiles(x_tiles, tile_expert, w.data, w.qtype, backend=backend)
    else:
        n_tiles = tile_expert.shape[0]
        te = jnp.where(tile_expert >= 0, tile_expert, tile_expert[0])
        xt = x_tiles.reshape(n_tiles, -1, x_tiles.shape[-1])
        y = jnp.einsum("gtk,gkn->gtn", xt, w[te].astype(x_tiles.dtype),
                       preferred_element_type=jnp.float32)
        y = jnp.where((tile_expert >= 0)[:, None, None], y, 0.0).reshape(x_tiles.shape[0], -1)
    return y.astype(x_tiles.dtype)


def to_device(info, mode: str, dtype, transpose: bool = True, pack: bool = False) -> Weight:
    """A GGUF tensor (strata_jax.gguf.TensorInfo) as a weight: a QTensor, or a float `dtype` array,
    which for matrices is stored transposed ([..., k, n]) unless `transpose` is False. `pack`
    (blocks mode, a matrix or experts of a type pk.packs): the QTensor holds a packed copy (pk.pack:
    the cpu backend's int8 products read it about twice as fast at decode) instead of the file's
    pages."""
    if mode == "dequantized" or len(info.shape) == 1:
        vals = pk.dequantize(np.ascontiguousarray(info.data),
                             info.qtype).reshape(info.shape).astype(dtype)
        if transpose and vals.ndim >= 2:
            vals = jnp.swapaxes(vals, -1, -2).copy()
        return vals
    # a matrix, or experts [E, n, k]
    if pack and len(info.shape) in (2, 3) and pk.packs(info.qtype):
        packed = pk.pack(info.data, info.qtype)
        release_file_pages(info.data)       # read once to pack: not held twice
        return QTensor(jax.device_put(packed), info.qtype.name + pk.PACKED_SUFFIX,
                       tuple(info.shape))
    return QTensor(blocks_in_place(info.data), info.qtype.name, tuple(info.shape))


def release_file_pages(a: np.ndarray) -> None:
    """Drop the pages of `a`, a view of a read-only file map (the GGUF reader's np.memmap), from
    this process's resident set: madvise(MADV_DONTNEED) unmaps clean file pages, which stay in the
    page cache and come back on the next read. Anything else (an array in anonymous memory, where it
    would zero the data) is left alone."""
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    if base is None or base.mode != "r" or not a.flags.c_contiguous:
        return
    page = mmap.PAGESIZE
    start = -(-a.ctypes.data // page) * page           # whole pages inside the array only
    end = (a.ctypes.data + a.nbytes) // page * page
    if end > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                  mmap.MADV_DONTNEED)


# XLA's CPU runtime takes a host array as it lies only at this boundary (else it copies it); GGUF's
# default alignment is 32, so about half of a file's tensors start off it
XLA_ALIGN = 64


def in_place(blocks: np.ndarray) -> bool:
    """Whether blocks_in_place on a CPU uses these bytes where they lie (no copy)."""
    return blocks.flags.c_contiguous and blocks.ctypes.data % XLA_ALIGN == 0


def copied_bytes(tensors) -> int:
    """Bytes of the GGUF tensors (TensorInfo) that blocks_in_place would copy into private memory on
    a CPU: those not at a 64-byte boundary in the file's map. A model larger than RAM served in
    place from such a file would need that much RAM."""
    return sum(t.n_bytes for t in tensors if not in_place(t.data))


def blocks_in_place(blocks: np.ndarray, device=None) -> jax.Array:
    """GGUF blocks as a device array (on `device`, else the default one). On a CPU, jax.device_put
    of a 64-byte aligned host array is that array itself (no copy), so the weights are the GGUF
    file's own memory-mapped pages: the process holds the file once, shared with the page cache,
    instead of a private copy of it (the file must not change while it is served, as with
    llama.cpp's mmap). Elsewhere, or unaligned, a copy."""
    return jax.device_put(np.ascontiguousarray(blocks), device)
