"""One dequantization body per GGUF type, shared by every backend.

A body turns a batch of blocks into values: `body(src) -> float32 [rows, block_size]`. It never sees
the block bytes as an array; it asks `src.u8(offsets)` for the bytes at given offsets inside each
block (-> int32 [rows, *offsets.shape]) and `src.lookup(table, idx)` for IQ table entries. Offsets
are computed from `src.iota(n)`: numpy arrays for the XLA backend (so they are static and the
gathers become slices), traced arrays inside Pallas kernels. The XLA
backend answers with gathers on a [rows, type_size] array; the Pallas kernels answer with indexed
loads from the raw weight buffer (Triton has no slicing or concatenation of values, but gathers from
memory are native). So every value is computed as "value j of the block", j = 0..block_size-1, and
the index arithmetic below is llama.cpp's block layout written per value.

The float arithmetic follows `gguf.quants` operation for operation (same products, same order), so
the results are bit-identical to that reference on any backend that does not contract a*b+c into an
FMA. Layouts: ggml-quants.c / ggml-common.h (block_q4_0 ... block_iq2_s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

from quant_types import QK_K, QType

f32 = jnp.float32
i32 = jnp.int32
u32 = jnp.uint32


class BlockSource(Protocol):
    def iota(self, n: int): ...                                  # int32 [n]: 0..n-1
    def u8(self, offsets) -> jax.Array: ...                      # int32 [rows, *offsets.shape]
    def lookup(self, table: str, idx: jax.Array) -> jax.Array: ...


def _at(src: BlockSource, offset: int):
    """A one-element offset: a per-block scalar field, broadcast over the block's values."""
    return src.iota(1) + offset


def _f16(src: BlockSource, offset: int) -> jax.Array:
    """The little-endian float16 at `offset`, as float32 [rows, 1]."""
    lo, hi = src.u8(_at(src, offset)), src.u8(_at(src, offset + 1))
    bits = (lo | (hi << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(f32)


def _u32(src: BlockSource, offsets: jax.Array) -> jax.Array:
    """Little-endian uint32 starting at each offset."""
    b = [src.u8(offsets + k).astype(u32) for k in range(4)]
    return b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)


def _nibble(src: BlockSource, offsets: jax.Array, high: jax.Array) -> jax.Array:
    return (src.u8(offsets) >> (4 * high)) & 0xF


def _signed8(x: jax.Array) -> jax.Array:
    return jnp.where(x >= 128, x - 256, x)


# ---- plain floats (a "block" is a run of `n` values; the caller picks n) -------------------------

def f32_body(n: int) -> Callable:
    def body(src: BlockSource) -> jax.Array:
        b = 4 * src.iota(n)
        bits = _u32(src, b)
        return jax.lax.bitcast_convert_type(bits, f32)
    return body


def f16_body(n: int) -> Callable:
    def body(src: BlockSource) -> jax.Array:
        b = 2 * src.iota(n)
        bits = (src.u8(b) | (src.u8(b + 1) << 8)).astype(jnp.uint16)
        return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(f32)
    return body


def bf16_body(n: int) -> Callable:
    def body(src: BlockSource) -> jax.Array:
        b = 2 * src.iota(n)
        bits = (src.u8(b).astype(u32) << 16) | (src.u8(b + 1).astype(u32) << 24)
        return jax.lax.bitcast_convert_type(bits, f32)
    return body


# ---- 32-value blocks -----------------------------------------------------------------------------

def q8_0(src):          # d: f16, qs: int8[32]
    d = _f16(src, 0)
    x = _signed8(src.u8(2 + src.iota(32))).astype(f32)
    return x * d


def q4_0(src):          # d, qs[16]: value j is nibble (j // 16) of byte j % 16
    j = src.iota(32)
    d = _f16(src, 0)
    q = _nibble(src, 2 + j % 16, j // 16) - 8
    return d * q.astype(f32)


def q4_1(src):          # d, m, qs[16]
    j = src.iota(32)
    d, m = _f16(src, 0), _f16(src, 2)
    q = _nibble(src, 4 + j % 16, j // 16).astype(f32)
    return (d * q) + m


def _q5_bits(src, qh_at: int, qs_at: int) -> jax.Array:
    """5-bit values: low nibble from qs as in Q4, fifth bit j of the little-endian uint32 qh."""
    j = src.iota(32)
    hi = (src.u8(qh_at + j // 8) >> (j % 8)) & 1
    return _nibble(src, qs_at + j % 16, j // 16) | (hi << 4)


def q5_0(src):          # d, qh[4], qs[16]
    d = _f16(src, 0)
    q = _q5_bits(src, 2, 6) - 16
    return d * q.astype(f32)


def q5_1(src):          # d, m, qh[4], qs[16]
    d, m = _f16(src, 0), _f16(src, 2)
    q = _q5_bits(src, 4, 8).astype(f32)
    return (d * q) + m


def iq4_nl(src):        # d, qs[16] -> indices into the 16 non-linear levels
    j = src.iota(32)
    d = _f16(src, 0)
    q = _nibble(src, 2 + j % 16, j // 16)
    return d * src.lookup("kvalues", q)


def _e8m0_half(src: BlockSource, offset: int) -> jax.Array:
    """The E8M0 scale byte e at `offset` as gguf's (and ggml's) e8m0_to_fp32_half: 2^(e - 128), as
    float32 bits: (e - 1) << 23 for e >= 2, the denormals 2^-128 and 2^-127 for e = 0, 1 (e = 255:
    2^127, finite; there is no NaN). float32 [rows, 1]."""
    e = src.u8(_at(src, offset)).astype(u32)
    bits = jnp.where(e < 2, u32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, f32)


def mxfp4(src):         # e (E8M0), qs[16] -> the doubled e2m1 values times 2^(e - 128)
    j = src.iota(32)
    d = _e8m0_half(src, 0)
    q = _nibble(src, 1 + j % 16, j // 16)
    return d * src.lookup("mxfp4", q)


# ---- 256-value super-blocks (k-quants) -----------------------------------------------------------

def q2_k(src):          # scales[16] (4-bit scale | 4-bit min), qs[64] (2 bits), d, dmin
    j = src.iota(QK_K)
    d, dmin = _f16(src, 80), _f16(src, 82)
    sc = src.u8(j // 16)
    dl = d * (sc & 0xF).astype(f32)
    ml = dmin * (sc >> 4).astype(f32)
    half, k, l = j // 128, (j // 32) % 4, j % 32
    q = ((src.u8(16 + half * 32 + l) >> (2 * k)) & 3).astype(f32)
    return dl * q - ml


def q3_k(src):          # hmask[32], qs[64], scales[12] (6-bit, offset 32), d
    j = src.iota(QK_K)
    d = _f16(src, 108)
    s = j // 16
    low = (src.u8(96 + s % 8) >> (4 * (s // 8))) & 0xF
    high = (src.u8(104 + s % 4) >> (2 * (s // 4))) & 3
    scale = ((low | (high << 4)) - 32).astype(f32)
    dl = d * scale
    half, k, l = j // 128, (j // 32) % 4, j % 32
    ql = (src.u8(32 + half * 32 + l) >> (2 * k)) & 3
    # the offset 4 applies when the mask bit is 0
    hbit = ((src.u8(j % 32) >> (j // 32)) & 1) ^ 1
    q = (ql - (hbit << 2)).astype(f32)
    return dl * q


def _k_scale_min(src, s: jax.Array, at: int) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K 6-bit scale and min of sub-block s from the 12 packed bytes at `at`."""
    lo = s % 4
    dq, mq, md = src.u8(at + lo), src.u8(at + 4 + lo), src.u8(at + 8 + lo)
    first = s < 4
    sc = jnp.where(first, dq & 0x3F, (md & 0xF) | ((dq >> 2) & 0x30))
    mn = jnp.where(first, mq & 0x3F, (md >> 4) | ((mq >> 2) & 0x30))
    return sc, mn


def q4_k(src):          # d, dmin, scales[12], qs[128]
    j = src.iota(QK_K)
    d, dmin = _f16(src, 0), _f16(src, 2)
    sc, mn = _k_scale_min(src, j // 32, 4)
    ds = d * sc.astype(f32)
    dm = dmin * mn.astype(f32)
    q = _nibble(src, 16 + (j // 64) * 32 + j % 32, (j // 32) % 2).astype(f32)
    return ds * q - dm


def q5_k(src):          # d, dmin, scales[12], qh[32], qs[128]
    j = src.iota(QK_K)
    d, dmin = _f16(src, 0), _f16(src, 2)
    sc, mn = _k_scale_min(src, j // 32, 4)
    ds = d * sc.astype(f32)
    dm = dmin * mn.astype(f32)
    ql = _nibble(src, 48 + (j // 64) * 32 + j % 32, (j // 32) % 2)
    qh = (src.u8(16 + j % 32) >> (j // 32)) & 1
    q = (ql | (qh << 4)).astype(f32)
    return ds * q - dm


def q6_k(src):          # ql[128], qh[64], scales[16] (int8), d
    j = src.iota(QK_K)
    d = _f16(src, 208)
    ds = d * _signed8(src.u8(192 + j // 16)).astype(f32)
    half, r = j // 128, j % 128
    ql = _nibble(src, half * 64 + r % 64, r // 64)
    qh = (src.u8(128 + half * 32 + r % 32) >> (2 * (r // 32))) & 3
    q = ((ql | (qh << 4)) - 32).astype(f32)
    return ds * q


# ---- 256-value i-quants --------------------------------------------------------------------------

def iq4_xs(src):        # d, scales_h (u16), scales_l[4], qs[128]
    j = src.iota(QK_K)
    d = _f16(src, 0)
    s = j // 32
    low = (src.u8(4 + s // 2) >> (4 * (s % 2))) & 0xF
    high = (src.u8(2 + s // 4) >> (2 * (s % 4))) & 3
    dl = d * ((low | (high << 4)) - 32).astype(f32)
    q = _nibble(src, 8 + s * 16 + j % 16, (j // 16) % 2)
    return dl * src.lookup("kvalues", q)


def _sign(bits: jax.Array) -> jax.Array:
    return jnp.where(bits == 0, f32(1), f32(-1))


def _ksign_bit(src, packed: jax.Array, group: jax.Array, bit: jax.Array) -> jax.Array:
    """Sign bit `bit` of group `group`: 7 stored bits a group, expanded to 8 by the ksigns table."""
    idx = ((packed >> (7 * group).astype(u32)) & 0x7F).astype(i32)
    return (src.lookup("ksigns", idx) >> bit) & 1


def iq3_xxs(src):       # d, qs[64] (grid indices), scales_and_signs (u32 x 8)
    j = src.iota(QK_K)
    d = _f16(src, 0)
    ib = j // 32
    aux = _u32(src, 66 + 4 * ib)
    db = d * (f32(0.5) + (aux >> 28).astype(f32)) * f32(0.5)
    grid = src.lookup("iq3xxs", src.u8(2 + j // 4) * 4 + j % 4)
    sign = _sign(_ksign_bit(src, aux, (j % 32) // 8, j % 8))
    return db * grid * sign


def iq3_s(src):         # d, qs[64], qh[8], signs[32], scales[4]
    j = src.iota(QK_K)
    d = _f16(src, 0)
    s = j // 32
    sc = (src.u8(106 + s // 2) >> (4 * (s % 2))) & 0xF
    db = d * (1 + 2 * sc).astype(f32)
    i = j // 4
    idx = src.u8(2 + i) | (((src.u8(66 + i // 8) >> (i % 8)) & 1) << 8)
    grid = src.lookup("iq3s", idx * 4 + j % 4)
    sign = _sign((src.u8(74 + j // 8) >> (j % 8)) & 1)
    return db * grid * sign


def iq2_xxs(src):       # d, then 8 x (u32 grid indices, u32 signs+scale)
    j = src.iota(QK_K)
    d = _f16(src, 0)
    ib = j // 32
    aux1 = _u32(src, 2 + 8 * ib + 4)
    db = d * (f32(0.5) + (aux1 >> 28).astype(f32)) * f32(0.25)
    g = (j % 32) // 8
    grid = src.lookup("iq2xxs", src.u8(2 + 8 * ib + g) * 8 + j % 8)
    sign = _sign(_ksign_bit(src, aux1, g, j % 8))
    return db * grid * sign


def _iq2_scale(src, j, at: int) -> jax.Array:
    """IQ2_XS/IQ2_S block scale of value j: d * (0.5 + 4-bit scale of its 16 values) * 0.25."""
    s = j // 16
    sc = ((src.u8(at + s // 2) >> (4 * (s % 2))) & 0xF).astype(f32)
    return _f16(src, 0) * (f32(0.5) + sc) * f32(0.25)


def iq2_xs(src):        # d, qs (u16 x 32: 9-bit grid index | 7 sign bits), scales[8]
    j = src.iota(QK_K)
    db = _iq2_scale(src, j, 66)
    i = j // 8
    q16 = src.u8(2 + 2 * i) | (src.u8(3 + 2 * i) << 8)
    grid = src.lookup("iq2xs", (q16 & 511) * 8 + j % 8)
    sign = _sign((src.lookup("ksigns", q16 >> 9) >> (j % 8)) & 1)
    return db * grid * sign


def iq2_s(src):         # d, qs[32], signs[32], qh[8], scales[8]
    j = src.iota(QK_K)
    db = _iq2_scale(src, j, 74)
    i = j // 8
    idx = src.u8(2 + i) | (((src.u8(66 + i // 4) >> (2 * (i % 4))) & 3) << 8)
    grid = src.lookup("iq2s", idx * 8 + j % 8)
    sign = _sign((src.u8(34 + j // 8) >> (j % 8)) & 1)
    return db * grid * sign


BODIES: dict[QType, Callable] = {
    QType.Q8_0: q8_0, QType.Q4_0: q4_0, QType.Q4_1: q4_1, QType.Q5_0: q5_0, QType.Q5_1: q5_1,
    QType.IQ4_NL: iq4_nl, QType.Q2_K: q2_k, QType.Q3_K: q3_k, QType.Q4_K: q4_k, QType.Q5_K: q5_k,
    QType.Q6_K: q6_k, QType.IQ4_XS: iq4_xs, QType.IQ3_XXS: iq3_xxs, QType.IQ3_S: iq3_s,
    QType.IQ2_XXS: iq2_xxs, QType.IQ2_XS: iq2_xs, QType.IQ2_S: iq2_s, QType.MXFP4: mxfp4,
}

FLOAT_BODIES = {QType.F32: f32_body, QType.F16: f16_body, QType.BF16: bf16_body}
FLOAT_BYTES = {QType.F32: 4, QType.F16: 2, QType.BF16: 2}
