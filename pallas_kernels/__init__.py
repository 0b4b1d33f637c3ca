"""Quantized-block kernels for GGUF weights: dequantize, quantized matmul, expert (grouped) matmul.

    import pallas_kernels as pk
    pk.dequantize(blocks_uint8, "IQ4_XS", backend="xla")     # -> float32 [..., n_values]
    pk.qmatmul(x, w_blocks, "Q4_K", backend="pallas")        # x [T, k] @ W^T, W stored as GGUF blocks
    pk.expert_matmul(x, w_blocks, expert_ids, "Q4_K")        # row r times expert expert_ids[r]

Backends: "xla" (plain jax.numpy), "cpu" (C++ custom calls through jax.ffi, cpu/: the GGUF blocks
read in place; each row of x quantized per block to 8 bits and multiplied with integer dot products,
as llama.cpp does; dequantize itself runs on xla), "cpu-exact" (the same C++ kernels with x kept in
float32 and the weights dequantized in registers exactly: the oracle; cpu.MATHS), "pallas" (Pallas
kernels through Triton, for GPUs: weights are dequantized in registers, the float matrix never
exists), "interpret" (the same Pallas kernels in interpret mode, for tests on a CPU), "auto" (pallas
on a GPU; on a CPU, cpu when its library is built, else xla with one log line saying why).
`is_cpu(backend)` is true for both cpu backends; `cpu_backend(math)` names the one of a math
("int8" | "exact"). One dequant body per type (bodies.py) serves xla and the Pallas kernels and is
checked bit for bit against `gguf.quants.dequantize`; the C++ dequantization follows the same bodies
and is checked against the xla backend.

Packed weights (`pack(blocks, qtype)` -> the bytes in cpu/packed.h's layout, named `qtype +
PACKED_SUFFIX`, e.g. "Q4_1+packed"): the "cpu" backend's int8 kernels read 8 rows' blocks side by
side at twice the speed, with the same bits; every other path refuses them with an error that says
so.
"""  # noqa: E501

from __future__ import annotations

import logging
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np

from quant_types import (
    SUPPORTED,
    QType,
    UnsupportedQuantType,
    as_qtype,
    block_size,
    row_bytes,
    type_size,
)

from . import cpu, gpu, xla
from .bodies import FLOAT_BYTES
from .grouping import gather_rows, group_rows, scatter_rows
from .layout import PACKED_SUFFIX, Layout, layout_for
from .random_blocks import random_blocks

BACKENDS = ("xla", "cpu", "cpu-exact", "pallas", "interpret", "auto")
# The cpu backends and the arithmetic of their quantized products (cpu.MATHS): the math is part of
# the backend's name, so it travels as plain data wherever a backend does (a program's static
# options), never as a setting.
_CPU_MATH = {"cpu": "int8", "cpu-exact": "exact"}

_log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "PACKED_SUFFIX",
    "SUPPORTED",
    "Layout",
    "QType",
    "UnsupportedQuantType",
    "as_qtype",
    "block_size",
    "cpu_backend",
    "cpu_math",
    "dequantize",
    "expert_matmul",
    "expert_matmul_many",
    "expert_matmul_tiles",
    "expert_tile",
    "gather_rows",
    "group_rows",
    "is_cpu",
    "layout_for",
    "norm_qmatmul_many",
    "pack",
    "packs",
    "qmatmul",
    "qmatmul_many",
    "random_blocks",
    "resolve_backend",
    "row_bytes",
    "scatter_rows",
    "type_size",
]


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if jax.default_backend() == "gpu":
            return "pallas"
        if jax.default_backend() == "cpu" and cpu.available():
            return "cpu"
        _say_auto_is_xla()
        return "xla"
    return backend


def is_cpu(backend: str) -> bool:
    """True for the backends of the C++ CPU kernels ("cpu", "cpu-exact", and "auto" where it
    resolves to cpu)."""
    return resolve_backend(backend) in _CPU_MATH


def cpu_math(backend: str) -> str:
    """The math ("int8" | "exact") of a cpu backend's products."""
    resolved = resolve_backend(backend)
    if resolved not in _CPU_MATH:
        raise ValueError(f"backend {backend!r} is not a cpu backend ({', '.join(_CPU_MATH)}): it "
                         "has no cpu math")
    return _CPU_MATH[resolved]


def cpu_backend(math: str) -> str:
    """The cpu backend whose products use `math` ("int8" -> "cpu", "exact" -> "cpu-exact")."""
    for name, m in _CPU_MATH.items():
        if m == math:
            return name
    raise ValueError(f"cpu math {math!r} is not one of {', '.join(cpu.MATHS)}")


@cache
def _say_auto_is_xla() -> None:
    why = cpu.unavailable_reason() or f"the default JAX backend is {jax.default_backend()!r}"
    _log.warning("pallas_kernels: backend auto uses xla: %s", why)


def packs(qtype) -> bool:
    """True for the quant types with a packed layout (cpu.PACKS: Q4_0, Q4_1, Q8_0, IQ4_NL, Q4_K,
    MXFP4)."""
    return as_qtype(qtype) in cpu.PACKS


def cpu_multiplies(qtype) -> bool:
    """True for the quant types (a name may end in PACKED_SUFFIX) that the C++ kernels multiply
    themselves (cpu.FAST), not through dequantized tiles."""
    if isinstance(qtype, str):
        qtype = qtype.removesuffix(PACKED_SUFFIX)
    return as_qtype(qtype) in cpu.FAST


def pack(blocks, qtype):
    """GGUF blocks uint8 [n, row_bytes] of a `packs` type (a numpy array) -> numpy uint8, the same
    shape, in cpu/packed.h's layout, to be used as quant type `qtype + PACKED_SUFFIX` on the "cpu"
    backend only."""
    return cpu.pack(blocks, as_qtype(qtype))


def _unpacked(lay: Layout, backend: str) -> Layout:
    if lay.packed:
        raise ValueError(f"{lay.qtype.name}{PACKED_SUFFIX}: packed weights are read only by the "
                         f"cpu backend's int8 products (backend {backend!r} here; load the model "
                         "without packing for it)")
    return lay


def dequantize(blocks, qtype, backend: str = "xla") -> jax.Array:
    """GGUF blocks uint8 [..., row_bytes] (float16/float32/bfloat16 data may be given as is)
    -> float32 [..., n_values]."""
    if isinstance(blocks, np.ndarray) and not _is_packed(qtype):
        plain = _plain_floats(blocks, as_qtype(qtype))
        if plain is not None:
            return jnp.asarray(plain)
    blocks = xla._as_bytes(blocks)
    lay = _unpacked(layout_for(qtype, blocks.shape[-1]), "dequantize")
    backend = resolve_backend(backend)
    if backend == "xla" or backend in _CPU_MATH:
        return xla.dequantize_rows(blocks, lay)
    return gpu.dequantize_rows(blocks, lay, interpret=backend == "interpret")


# the host type of a float type's values (bfloat16's: its bits)
_HOST_FLOAT = {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}


def _is_packed(qtype) -> bool:
    return isinstance(qtype, str) and qtype.endswith(PACKED_SUFFIX)


def _plain_floats(data: np.ndarray, qtype: QType) -> np.ndarray | None:
    """A float type's host data (its values, or their bytes) as float32, on the host: the same
    values the blocks' body gives, bit for bit (the conversions are exact), without a device
    program for each tensor's shape (a model's loader met ~270 of them: seconds at every start).
    None for a block type."""
    if qtype not in FLOAT_BYTES:
        return None
    if data.dtype == np.uint8:
        if data.shape[-1] % FLOAT_BYTES[qtype]:
            return None             # the body's error names it
        data = np.ascontiguousarray(data).view(_HOST_FLOAT[qtype])
    if qtype == QType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return data.view(_HOST_FLOAT[qtype]).astype(np.float32)


def qmatmul(x: jax.Array, w_blocks, qtype, backend: str = "xla") -> jax.Array:
    """x [T, k] @ W^T, W [n, k] stored as GGUF blocks uint8 [n, row_bytes] -> float32 [T, n].

    The product runs in x's dtype (float32 on a CPU, bfloat16 on a GPU) and accumulates in float32;
    the cpu backends take x as float32 (upcast) and sum in a fixed order a row: "cpu" quantizes it
    per block to 8 bits, "cpu-exact" multiplies it in float32."""
    w_blocks = xla._as_bytes(w_blocks)
    lay = layout_for(qtype, w_blocks.shape[-1])
    backend = resolve_backend(backend)
    if backend in _CPU_MATH:
        return cpu.qmatmul(x, w_blocks, lay, math=_CPU_MATH[backend])
    _unpacked(lay, backend)
    if backend == "xla":
        w = xla.dequantize_rows(w_blocks, lay).astype(x.dtype)
        return jnp.einsum("tk,nk->tn", x, w, preferred_element_type=jnp.float32)
    return gpu.qmatmul(x, w_blocks, lay, interpret=backend == "interpret")


def qmatmul_many(x: jax.Array, weights: list, backend: str = "xla") -> list[jax.Array]:
    """x [T, k] times each (w_blocks, qtype) of `weights` -> [float32 [T, n] each], as qmatmul gives
    them; the cpu backend runs them in one call (its rows share the threads: fewer calls a decode
    step)."""
    if not is_cpu(backend):
        return [qmatmul(x, w, qtype, backend) for w, qtype in weights]
    blocks = [xla._as_bytes(w) for w, _ in weights]
    return cpu.qmatmul_many(x, [(b, layout_for(qtype, b.shape[-1]))
                                for b, (_, qtype) in zip(blocks, weights)],
                            math=cpu_math(backend))


def norm_qmatmul_many(x: jax.Array, norm: jax.Array, eps: float, weights: list,
                      backend: str = "cpu") -> tuple[jax.Array, list[jax.Array]]:
    """The cpu backends only: RMSNorm of x [T, k] by norm [k] and the result times each (w_blocks,
    qtype) of `weights` in one call -> (hx float32 [T, k], [float32 [T, n] each])
    (cpu.norm_qmatmul_many)."""
    math = cpu_math(backend)          # raises for a backend without these kernels
    blocks = [xla._as_bytes(w) for w, _ in weights]
    return cpu.norm_qmatmul_many(x, norm, eps,
                                 [(b, layout_for(qtype, b.shape[-1])) for b, (_, qtype) in
                                                zip(blocks, weights)], math=math)


def expert_matmul_many(x: jax.Array, expert_ids: jax.Array, weights: list,
                       backend: str = "xla") -> list[jax.Array]:
    """[expert_matmul(x, w, expert_ids, qtype) for (w, qtype) in weights], the same bits; the cpu
    backend runs them in one call (an MoE layer's gate and up)."""
    if not is_cpu(backend):
        return [expert_matmul(x, w, expert_ids, qtype, backend) for w, qtype in weights]
    blocks = [xla._as_bytes(w) for w, _ in weights]
    return cpu.expert_matmul_many(x, expert_ids, [(b, layout_for(q, b.shape[-1]))
                                                  for b, (_, q) in zip(blocks, weights)],
                                  math=cpu_math(backend))


def expert_matmul_sources(x: jax.Array, expert_ids: jax.Array, weights: list[list],
                          backend: str = "cpu") -> list[jax.Array]:
    """The cpu backends only: cpu.expert_matmul_sources, weights[j] weight j's (w_blocks, qtype)
    sources in order (an expert tier's slots, then the host tier's blocks), the ids over the sources
    in order."""
    math = cpu_math(backend)          # raises for a backend without these kernels
    return cpu.expert_matmul_sources(x, expert_ids, [[(b, layout_for(q, b.shape[-1])) for b, q in
                                                      ((xla._as_bytes(w), q) for w, q in sources)]
                                                     for sources in weights], math=math)


# Rows a tile of the expert matmul: small on the XLA path, where a tile costs one expert
# dequantization whatever its fill; Triton's dot wants at least 16. The cpu kernel takes an expert a
# row (padding rows cost it nothing), but float expert weights on a CPU still go through XLA's
# tiles, so cpu keeps 8.
_XLA_TILE, _PALLAS_TILE, _CPU_TILE = 8, 16, 8


def expert_tile(backend: str = "xla") -> int:
    backend = resolve_backend(backend)
    return _CPU_TILE if backend in _CPU_MATH else {"xla": _XLA_TILE}.get(backend, _PALLAS_TILE)


def expert_matmul_tiles(x_tiles: jax.Array, tile_expert: jax.Array, w_blocks, qtype,
                        backend: str = "xla") -> jax.Array:
    """Grouped rows x_tiles [n_tiles * tile, k] (see grouping.py), tile i times expert
    tile_expert[i] (-1: empty, gives zeros) of w_blocks [E, n, row_bytes] -> float32 [n_tiles *
    tile, n].

    An MoE layer groups its rows once and runs gate, up and down in this layout."""
    w_blocks = xla._as_bytes(w_blocks)
    backend = resolve_backend(backend)
    lay = _unpacked(layout_for(qtype, w_blocks.shape[-1]), backend)
    n_tiles = tile_expert.shape[0]
    tile = x_tiles.shape[0] // n_tiles
    if backend in _CPU_MATH:                      # every row of tile i takes expert tile_expert[i]
        return cpu.expert_matmul(x_tiles, w_blocks, jnp.repeat(tile_expert, tile), lay,
                                 math=_CPU_MATH[backend])
    if backend == "xla":
        # Empty tiles repeat tile 0's expert (always a chosen one), so no unchosen expert is ever
        # read.
        te = jnp.where(tile_expert >= 0, tile_expert, tile_expert[0])
        # [n_tiles, n, k]
        w = xla.dequantize_rows(w_blocks[te], lay).astype(x_tiles.dtype)
        y = jnp.einsum("gtk,gnk->gtn", x_tiles.reshape(n_tiles, tile, -1), w,
                       preferred_element_type=jnp.float32)
        return jnp.where((tile_expert >= 0)[:, None, None], y, 0.0).reshape(n_tiles * tile, -1)
    return gpu.expert_matmul_tiles(x_tiles, tile_expert, w_blocks, lay, bt=tile,
                                   interpret=backend == "interpret")


def expert_matmul(x: jax.Array, w_blocks, expert_ids: jax.Array, qtype,
                  backend: str = "xla") -> jax.Array:
    """Row r of x [R, k] times expert expert_ids[r] of w_blocks [E, n, row_bytes] -> float32 [R, n].

    Rows are grouped by expert (grouping.py; the cpu kernel groups them itself); only the experts
    some row chose are read. An id outside [0, E) gives a zero row on the cpu backends."""
    if is_cpu(backend):
        w_blocks = xla._as_bytes(w_blocks)
        return cpu.expert_matmul(x, w_blocks, expert_ids, layout_for(qtype, w_blocks.shape[-1]),
                                 math=cpu_math(backend))
    g = group_rows(expert_ids, w_blocks.shape[0], expert_tile(backend))
    y = expert_matmul_tiles(scatter_rows(x, g), g.tile_expert, w_blocks, qtype, backend)
    return gather_rows(y, g)
