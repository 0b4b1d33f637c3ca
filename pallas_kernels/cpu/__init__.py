"""The `cpu` backend: quantized and expert matmul as XLA custom calls into C++ (this folder).

    y = qmatmul(x, w_blocks, lay)                  # x [M, k] @ W^T, W [n, k] as GGUF blocks -> [M, n]
    q, k, v = qmatmul_many(x, [(wq, lq), (wk, lk), (wv, lv)])   # one call for several weights
    y = expert_matmul(x, w_blocks, ids, lay)       # row r times expert ids[r] of [E, n, row_bytes]
    o = attention(q, k_cache, v_cache, layer, slots, pos)   # queries over the KV cache where it lies

The library (`_strata_cpu_<level>*.so`, one a CPU instruction-set level, built by `pip install` from
the .cc files here, see setup.py; library.py loads the best level this CPU runs, or
STRATA_CPU_ISA's) is loaded with ctypes and its handlers registered with `jax.ffi` on first use.
Weights are read as GGUF blocks where they lie. Two maths (MATHS, the `math` argument; --cpu-math):
- "int8" (the default): each row of x quantized per block to 8 bits as llama.cpp's vec_dot_type
  does, integer dot products (AVX2 maddubs/madd, VNNI dpbusd), float scales a block (q8.h defines
  the order);
- "exact": x stays float32 and the weights are dequantized in registers exactly as gguf.quants does,
  each output one fixed-order float32 sum (simd.h): the oracle.
Either way a row's result depends only on that row, whatever else is in the call, and every level
gives the same bits.

Which path each type takes:
- FAST (C++ dequantization): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL,
  IQ4_XS, MXFP4; all but the float types (F32, F16, BF16: always exact) have the int8 path.
- every other supported type (the IQ2_* / IQ3_* grid types): a loop over tiles of weight rows, each
  tile dequantized by the xla backend into a float32 buffer of ~256 KiB and multiplied by the C++
  F32 kernel (so the same fixed-order sums). No float copy of the whole matrix exists.

Expert ids outside [0, E) (-1: no expert) give zero rows and read no weights.

Packed weights (`pack`, packed.h): resident matrices of the PACKS types repacked at load, 8 rows'
blocks side by side, read by the int8 products only (same bits as their GGUF rows, about twice as
fast at decode), also the expert kernel's when every expert is resident (each expert packed alone);
the exact math refuses them.
"""  # noqa: E501

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from quant_types import QType

from ..layout import Layout
from . import library
from .library import ISA_ENV, LIB_ENV  # noqa: F401 - re-exported: tests and scripts name them here

_TARGETS = {"strata_qmatmul": "StrataQMatmul", "strata_expert_matmul": "StrataExpertMatmul",
            "strata_attention": "StrataAttention", "strata_qmatmul_many": "StrataQMatmulMany",
            "strata_expert_matmul_many": "StrataExpertMatmulMany",
            "strata_attention_part": "StrataAttentionPart",
            "strata_norm_qmatmul_many": "StrataNormQMatmulMany",
            "strata_greedy_pick": "StrataGreedyPick", "strata_top_k": "StrataTopK"}

FAST: frozenset[QType] = frozenset(
    QType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
)

# The types with a packed layout (packed.h), and the bit of the kernels' qtype attribute that marks
# a packed weight.
PACKS: frozenset[QType] = frozenset(QType[name]
                                    for name in ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL", "Q4_K", "MXFP4"))
_PACKED_BIT = 1 << 16

# The arithmetic of the FAST types' products: "int8" (each row of x quantized per block to 8 bits as
# llama.cpp's vec_dot_type, integer dot products, float scales per block: the default, fast) or
# "exact" (x stays float32, weights dequantized in registers exactly as gguf.quants does: the
# oracle). The float types (F32, F16, BF16) and the slow-path types always take the exact path.
MATHS = ("int8", "exact")

# Bytes of float32 a slow-path tile dequantizes at a time (L2-sized: the tile is read right back).
_SLOW_TILE_BYTES = 256 << 10


class CpuKernelsUnavailable(RuntimeError):
    """backend="cpu" was asked for but the C++ library is not built or does not load."""


def library_path() -> Path | None:
    """The library file in use (library.py chooses it: the best ISA level built that this CPU
    runs)."""
    return library.library_path()


@cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) once loaded and registered, or (None, why not)."""
    lib, why = library.load()
    if lib is None:
        return None, why
    for name, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    lib.strata_cpu_isa.restype = ctypes.c_char_p
    return lib, None


def available() -> bool:
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    return _load()[1]


def isa() -> str:
    """The float path's SIMD width in the library in use: "avx512", "avx2" or "scalar"."""
    return _require().strata_cpu_isa().decode()


def level() -> str:
    """The ISA level of the library in use ("avx512vnni", "avx2", ...: library.LEVELS)."""
    _require()
    return library.level()


def _require() -> ctypes.CDLL:
    lib, why = _load()
    if lib is None:
        raise CpuKernelsUnavailable(f'backend="cpu" is not available: {why}')
    return lib


def _math_code(math: str) -> np.int32:
    if math not in MATHS:
        raise ValueError(f"cpu math {math!r} is not one of {', '.join(MATHS)}")
    return np.int32(MATHS.index(math) == 0)          # the kernels' attribute: 1 = int8, 0 = exact


def _qtype_attr(lay: Layout, math: str) -> int:
    """The kernels' qtype attribute: the GGML type, with _PACKED_BIT for a packed weight (int8 math
    only)."""
    if lay.packed and math != "int8":
        raise ValueError(f"a packed {lay.qtype.name} weight is read by the int8 math only, not "
                         f"{math!r}: load the model without packing (--weights blocks) for "
                         f"--cpu-math {math}")
    return int(lay.qtype) | (_PACKED_BIT if lay.packed else 0)


def pack(blocks: np.ndarray, qtype: QType) -> np.ndarray:
    """GGUF blocks uint8 [n, row_bytes] (or experts [E, n, row_bytes], each packed alone) of a PACKS
    type -> a new 64-byte aligned uint8 array of the same shape in packed.h's layout (so that
    jax.device_put on a CPU takes it without a copy)."""
    if qtype not in PACKS:
        raise ValueError(f"{qtype.name} has no packed layout (packed types: "
                         f"{', '.join(sorted(q.name for q in PACKS))})")
    src = np.ascontiguousarray(blocks, dtype=np.uint8)
    if src.ndim not in (2, 3):
        raise ValueError("pack takes blocks [n, row_bytes] or experts [E, n, row_bytes], not shape "
                         f"{tuple(src.shape)}")
    raw = np.empty(src.size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    dst = raw[start:start + src.size].reshape(src.shape)
    ptr = ctypes.POINTER(ctypes.c_uint8)
    n, row_bytes = src.shape[-2:]
    # experts each alone: no tile spans two
    for e in range(src.shape[0] if src.ndim == 3 else 1):
        at = e * n * row_bytes
        rc = _require().strata_pack_rows(ctypes.c_int32(int(qtype)),
                                         ctypes.cast(src.ctypes.data + at, ptr),
                                         ctypes.c_int64(n), ctypes.c_int64(row_bytes),
                                         ctypes.cast(dst.ctypes.data + at, ptr))
        if rc != 0:
            raise ValueError(f"{qtype.name}: rows of {row_bytes} bytes are not whole blocks of the "
                             "type")
    return dst


def _qmatmul_call(x: jax.Array, w: jax.Array, qtype: int, math: str = "exact") -> jax.Array:
    """The C++ kernel: x float32 [M, k], w [n, row_bytes] bytes of a FAST type (qtype:
    _qtype_attr's) -> [M, n]."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("strata_qmatmul", out, vmap_method="sequential")(
        x, w, qtype=np.int32(qtype), int8=_math_code(math))


def _check_k(x: jax.Array, w_blocks: jax.Array, lay: Layout) -> None:
    k = lay.blocks_in(w_blocks.shape[-1]) * lay.values
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)} but the {lay.qtype.name} weight rows of "
                         f"{w_blocks.shape[-1]} bytes hold k = {k} values: x must be [M, {k}]")


def qmatmul(x: jax.Array, w_blocks: jax.Array, lay: Layout, math: str = "int8") -> jax.Array:
    """x [M, k] @ W^T, W [n, k] given as GGUF blocks uint8 [n, row_bytes] -> float32 [M, n]."""
    _require()
    _check_k(x, w_blocks, lay)
    x = x.astype(jnp.float32)
    if lay.qtype in FAST:
        return _qmatmul_call(x, w_blocks, _qtype_attr(lay, math), math)
    return _tiled_qmatmul(x, w_blocks, lay)


def qmatmul_many(x: jax.Array, weights: list[tuple[jax.Array, Layout]],
                 math: str = "int8") -> list[jax.Array]:
    """x [M, k] times each (w_blocks, lay) of `weights` -> [x @ W^T for each]: one call for the FAST
    types, whose rows share the threads (a decode step's q, k, v or gate, up: fewer calls, one
    wait), with the bits of separate qmatmul calls."""
    _require()
    for w, lay in weights:
        _check_k(x, w, lay)
    x = x.astype(jnp.float32)
    fast = [j for j, (_, lay) in enumerate(weights) if lay.qtype in FAST]
    out: list = [None] * len(weights)
    if fast:
        shapes = [jax.ShapeDtypeStruct((x.shape[0], weights[j][0].shape[0]), jnp.float32)
                  for j in fast]
        qtypes = np.array([_qtype_attr(weights[j][1], math) for j in fast], np.int32)
        ys = jax.ffi.ffi_call("strata_qmatmul_many", shapes, vmap_method="sequential")(
            x, *(weights[j][0] for j in fast), qtypes=qtypes, int8=_math_code(math))
        for j, y in zip(fast, ys):
            out[j] = y
    for j, (w, lay) in enumerate(weights):
        if out[j] is None:
            out[j] = _tiled_qmatmul(x, w, lay)
    return out


def norm_qmatmul_many(x: jax.Array, norm: jax.Array, eps: float,
                      weights: list[tuple[jax.Array, Layout]],
                      math: str = "int8") -> tuple[jax.Array, list[jax.Array]]:
    """RMSNorm of x [M, k] by `norm` [k] (hx = x / sqrt(mean(x^2) + eps) * norm), then hx times each
    (w_blocks, lay) of `weights` (none: the norm alone) -> (hx, [hx @ W^T for each]), in one call
    for the FAST types: a decode step's norm and its q, k, v (or gate, up) without XLA's four small
    operations a norm between kernel calls. The sum of squares has a fixed order a row (ffi.cc
    rms_norm_rows); the products have qmatmul_many's bits for that hx."""
    _require()
    if x.ndim != 2 or norm.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)} and norm {tuple(norm.shape)} must be [M, k] and [k]")
    for w, lay in weights:
        _check_k(x, w, lay)
    x = x.astype(jnp.float32)
    fast = [j for j, (_, lay) in enumerate(weights) if lay.qtype in FAST]
    shapes = [jax.ShapeDtypeStruct(x.shape, jnp.float32)]
    shapes += [jax.ShapeDtypeStruct((x.shape[0], weights[j][0].shape[0]), jnp.float32)
               for j in fast]
    qtypes = np.array([_qtype_attr(weights[j][1], math) for j in fast], np.int32)
    hx, *ys = jax.ffi.ffi_call("strata_norm_qmatmul_many", shapes, vmap_method="sequential")(
        x, norm.astype(jnp.float32), *(weights[j][0] for j in fast), qtypes=qtypes,
        eps=np.float32(eps), int8=_math_code(math))
    out: list = [None] * len(weights)
    for j, y in zip(fast, ys):
        out[j] = y
    for j, (w, lay) in enumerate(weights):
        if out[j] is None:
            out[j] = _tiled_qmatmul(hx, w, lay)
    return hx, out


def f32_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, k] @ W^T for a float32 W [n, k] (a router): the F32 kernel on the array as it is (a
    byte view would cost XLA a copy a call)."""
    _require()
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, k] and [n, k]")
    return _qmatmul_call(x.astype(jnp.float32), w.astype(jnp.float32), int(QType.F32))


def expert_matmul(x: jax.Array, w_blocks: jax.Array, expert_ids: jax.Array, lay: Layout,
                  math: str = "int8") -> jax.Array:
    """Row r of x [R, k] times expert expert_ids[r] of w_blocks [E, n, row_bytes] -> float32 [R,
    n]."""
    _require()
    _check_k(x, w_blocks, lay)
    if w_blocks.ndim != 3 or expert_ids.shape != (x.shape[0],):
        raise ValueError(f"w_blocks must be [E, n, row_bytes] (got {tuple(w_blocks.shape)}) and "
                         f"expert_ids [{x.shape[0]}] (got {tuple(expert_ids.shape)})")
    x = x.astype(jnp.float32)
    ids = expert_ids.astype(jnp.int32)
    if lay.qtype in FAST:
        out = jax.ShapeDtypeStruct((x.shape[0], w_blocks.shape[1]), jnp.float32)
        return jax.ffi.ffi_call("strata_expert_matmul", out, vmap_method="sequential")(
            x, w_blocks, ids, qtype=np.int32(_qtype_attr(lay, math)), int8=_math_code(math))
    return _tiled_expert_matmul(x, w_blocks, ids, lay)


def greedy_pick(logits: jax.Array) -> jax.Array:
    """A greedy sampler's answer for logits [R, V]: int32 [R], the first index of each row's
    largest logit, or -1 where the row holds a NaN or an inf (pick.cc; jnp.argmax and the
    sampler's mark_non_finite in one pass, for the engine's decode windows run ahead)."""
    _require()
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be [R, V] with V >= 1, not {tuple(logits.shape)}")
    out = jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32)
    return jax.ffi.ffi_call("strata_greedy_pick", out, vmap_method="sequential")(
        logits.astype(jnp.float32))


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k of x [R, E] float32 (a router's scores): the k largest of each row [R, k]
    float32 and their indices [R, k] int32, descending, the lower index first among equal values,
    in XLA's total order of floats (pick.cc: one pass a row, where XLA:CPU sorts each row
    whole)."""
    _require()
    if x.ndim != 2 or not 1 <= k <= min(x.shape[1], 64):
        raise ValueError(f"top_k of x {tuple(x.shape)} with k = {k}: x must be [R, E] and "
                         "1 <= k <= min(E, 64)")
    rows = x.shape[0]
    out = (jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((rows, k), jnp.int32))
    return jax.ffi.ffi_call("strata_top_k", out, vmap_method="sequential")(x.astype(jnp.float32))


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, slots: jax.Array,
              pos: jax.Array, k_scale: jax.Array | None = None,
              v_scale: jax.Array | None = None, sinks: jax.Array | None = None,
              window=None) -> jax.Array:
    """q [R, L, H, D] over the cached keys and values [layers, slots, positions, K, D] (float32,
    bfloat16, or int8 with scales [layers, slots, positions, K]) of `layer` (an int or a traced
    int32) for rows in slots [R]: a query at position p = pos[r, l] sees keys 0..p of its slot; p <
    0 (padding) gives zeros. -> float32 [R, L, H, Dv]. Reads the cache in place (attention.cc says
    in which order). gpt-oss: sinks [H], each head's sink logit in the denominator; window (an int
    or int32 scalar, 0 or None: none) masks keys with p - key >= window."""
    _require()
    R, L, H, D = q.shape
    if k_cache.ndim != 5 or k_cache.shape[-1] != D or H % k_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the key cache {tuple(k_cache.shape)}: "
                         f"the cache must be [layers, slots, positions, K, {D}] with H a multiple "
                         "of K")
    none = jnp.zeros((1,), jnp.float32)
    out = jax.ShapeDtypeStruct((R, L, H, v_cache.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call("strata_attention", out, vmap_method="sequential")(
        q.astype(jnp.float32), k_cache, v_cache, none if k_scale is None else k_scale,
        none if v_scale is None else v_scale, jnp.asarray(layer, jnp.int32),
        slots.astype(jnp.int32), pos.astype(jnp.int32),
        jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32).reshape(H),
        jnp.asarray(0 if window is None else window, jnp.int32))


# Key positions a tile of the attention kernel: every part's lo (and hi) must be a multiple.
ATTENTION_TILE = 16


def attention_part(q: jax.Array, k_src: jax.Array, v_src: jax.Array, layer, slots: jax.Array,
                   pos: jax.Array, bounds, state, k_scale: jax.Array | None = None,
                   v_scale: jax.Array | None = None):
    """attention() over the keys at positions [lo, hi) only, found at index position - base of the
    sources ([layers, slots, n, K, D]), starting from `state` (m, s [R, L, H], acc [R, L, H, Dv];
    None: fresh): -> (output as if these were the last keys, float32 [R, L, H, Dv]; the updated
    state). Parts in position order give the bits of one attention() call over all of them
    (--kv-resident: device part, host blocks). bounds: int32 (base, lo, hi), lo and hi multiples of
    ATTENTION_TILE."""
    _require()
    R, L, H, _ = q.shape
    Dv = v_src.shape[-1]
    if state is None:
        state = (jnp.full((R, L, H), -jnp.inf, jnp.float32), jnp.zeros((R, L, H), jnp.float32),
                 jnp.zeros((R, L, H, Dv), jnp.float32))
    none = jnp.zeros((1,), jnp.float32)
    shapes = [jax.ShapeDtypeStruct((R, L, H, Dv), jnp.float32),
              jax.ShapeDtypeStruct((R, L, H), jnp.float32),
              jax.ShapeDtypeStruct((R, L, H), jnp.float32),
              jax.ShapeDtypeStruct((R, L, H, Dv), jnp.float32)]
    out, *new = jax.ffi.ffi_call("strata_attention_part", shapes, vmap_method="sequential")(
        q.astype(jnp.float32), k_src, v_src, none if k_scale is None else k_scale,
        none if v_scale is None else v_scale, jnp.asarray(layer, jnp.int32),
        slots.astype(jnp.int32), pos.astype(jnp.int32), jnp.asarray(bounds, jnp.int32), *state)
    return out, tuple(new)


def expert_matmul_many(x: jax.Array, expert_ids: jax.Array, weights: list[tuple[jax.Array, Layout]],
                       math: str = "int8") -> list[jax.Array]:
    """expert_matmul of the same rows and ids for each (w_blocks, lay) of `weights` (an MoE layer's
    gate and up): one call for the FAST types, the rows grouped once, with the bits of separate
    calls."""
    _require()
    ids = expert_ids.astype(jnp.int32)
    x = x.astype(jnp.float32)
    for w, lay in weights:
        _check_k(x, w, lay)
        if w.ndim != 3 or ids.shape != (x.shape[0],):
            raise ValueError(f"w_blocks must be [E, n, row_bytes] (got {tuple(w.shape)}) and "
                             f"expert_ids [{x.shape[0]}] (got {tuple(ids.shape)})")
    if (not all(lay.qtype in FAST for _, lay in weights)
            or len({w.shape[0] for w, _ in weights}) != 1):
        return [expert_matmul(x, w, ids, lay, math) for w, lay in weights]
    shapes = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w, _ in weights]
    qtypes = np.array([_qtype_attr(lay, math) for _, lay in weights], np.int32)
    return list(jax.ffi.ffi_call("strata_expert_matmul_many", shapes, vmap_method="sequential")(
        x, ids, *(w for w, _ in weights), qtypes=qtypes, int8=_math_code(math)))


def expert_matmul_sources(x: jax.Array, expert_ids: jax.Array,
                          weights: list[list[tuple[jax.Array, Layout]]],
                          math: str = "int8") -> list[jax.Array]:
    """Like expert_matmul_many, with each weight's experts in several places ("sources": weights[j]
    lists weight j's (w_blocks [E_s, n, row_bytes], lay), e.g. an expert tier's arena slots packed,
    then the host tier's GGUF blocks). The ids run over the sources in order: id e < E_0 is source
    0's expert e, then source 1's expert e - E_0, ...; -1 gives zeros. One call: each row's expert
    read where it is, with the bits of a call on that source alone. FAST types only (every source of
    every weight)."""
    _require()
    ids = expert_ids.astype(jnp.int32)
    x = x.astype(jnp.float32)
    if ids.shape != (x.shape[0],):
        raise ValueError(f"expert_ids must be [{x.shape[0]}] (got {tuple(ids.shape)})")
    counts = [w.shape[0] for w, _ in weights[0]]
    for sources in weights:
        shapes = [tuple(w.shape) for w, _ in sources]
        if ([s[0] for s in shapes] != counts or len({s[1] for s in shapes}) != 1
                or any(len(s) != 3 for s in shapes)):
            raise ValueError("each weight's sources must be [E_s, n, row_bytes] with E_s = "
                             f"{counts} and one n (got {shapes})")
        for w, lay in sources:
            _check_k(x, w, lay)
            if lay.qtype not in FAST:
                raise ValueError("expert_matmul_sources needs the kernels' own types, not "
                                 f"{lay.qtype.name}")
    shapes = [jax.ShapeDtypeStruct((x.shape[0], sources[0][0].shape[1]), jnp.float32)
              for sources in weights]
    qtypes = np.array([_qtype_attr(lay, math) for sources in weights for _, lay in sources],
                      np.int32)
    return list(jax.ffi.ffi_call("strata_expert_matmul_many", shapes, vmap_method="sequential")(
        x, ids, *(w for sources in weights for w, _ in sources), qtypes=qtypes,
        int8=_math_code(math)))


# ---- the slow path: one tile of weight rows dequantized at a time --------------------------------

def _tiled_qmatmul(x: jax.Array, w_blocks: jax.Array, lay: Layout) -> jax.Array:
    from ..xla import dequantize_rows

    n, k = w_blocks.shape[0], x.shape[1]
    rows = max(1, min(n, _SLOW_TILE_BYTES // (4 * k)))
    full, rest = divmod(n, rows)

    def tile(blocks):                                              # uint8 [t, row_bytes] -> [M, t]
        return _qmatmul_call(x, dequantize_rows(blocks, lay), QType.F32)

    parts = []
    if full:
        ys = jax.lax.map(lambda i: tile(jax.lax.dynamic_slice_in_dim(w_blocks, i * rows, rows)),
                         jnp.arange(full))                         # [full, M, rows]
        parts.append(jnp.transpose(ys, (1, 0, 2)).reshape(x.shape[0], full * rows))
    if rest:
        parts.append(tile(w_blocks[full * rows:]))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _tiled_expert_matmul(x: jax.Array, w_blocks: jax.Array, ids: jax.Array,
                         lay: Layout) -> jax.Array:
    """Each distinct chosen expert once: all rows times it, kept where a row chose it."""
    n_exp, n = w_blocks.shape[0], w_blocks.shape[1]
    valid = (ids >= 0) & (ids < n_exp)
    slots = min(n_exp, ids.shape[0])
    # sorted, E = unused
    chosen = jnp.unique(jnp.where(valid, ids, n_exp), size=slots, fill_value=n_exp)

    def step(i, y):
        e = chosen[i]
        def one(y):
            w = jax.lax.dynamic_index_in_dim(w_blocks, e, axis=0, keepdims=False)
            return jnp.where((ids == e)[:, None], _tiled_qmatmul(x, w, lay), y)
        return jax.lax.cond(e < n_exp, one, lambda y: y, y)

    return jax.lax.fori_loop(0, slots, step, jnp.zeros((x.shape[0], n), jnp.float32))
