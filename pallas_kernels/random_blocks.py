"""Random GGUF quant blocks that are valid, finite weights.

Random bytes are valid blocks for every supported type except in their float16 scale fields, which
may decode to inf or NaN (and MXFP4's E8M0 exponent byte, whose large values overflow to inf). So:
random bytes, then the scale fields set to finite values chosen so that the dequantized weights have
mean ~0 and the standard deviation asked for. Used by kernel tests
and by `strata-jax make-model` ("random quant blocks with sane scales are valid random weights").
"""

from __future__ import annotations

from functools import cache

import numpy as np
from gguf import quants as gq

from quant_types import QType, as_qtype, block_size, type_size

# Float16 fields of each block: (byte offset, role). A "scale" multiplies the quantized values; an
# "offset" is added (Q4_1, Q5_1) or subtracted (K-quants' dmin) after; an "e8m0" is one byte e, the
# scale 2^(e - 128) (MXFP4): a scale asked for is rounded to the nearest power of two.
SCALE_FIELDS: dict[QType, tuple[tuple[int, str], ...]] = {
    QType.Q8_0: ((0, "scale"),),
    QType.Q4_0: ((0, "scale"),),
    QType.Q4_1: ((0, "scale"), (2, "offset")),
    QType.Q5_0: ((0, "scale"),),
    QType.Q5_1: ((0, "scale"), (2, "offset")),
    QType.Q2_K: ((80, "scale"), (82, "offset")),
    QType.Q3_K: ((108, "scale"),),
    QType.Q4_K: ((0, "scale"), (2, "offset")),
    QType.Q5_K: ((0, "scale"), (2, "offset")),
    QType.Q6_K: ((208, "scale"),),
    QType.IQ4_NL: ((0, "scale"),),
    QType.IQ4_XS: ((0, "scale"),),
    QType.IQ3_XXS: ((0, "scale"),),
    QType.IQ3_S: ((0, "scale"),),
    QType.IQ2_XXS: ((0, "scale"),),
    QType.IQ2_XS: ((0, "scale"),),
    QType.IQ2_S: ((0, "scale"),),
    QType.MXFP4: ((0, "e8m0"),),
}


def _e8m0(scale) -> np.ndarray:
    """The E8M0 byte whose scale 2^(e - 128) is nearest `scale` (in log2), within [2, 254]: normal
    float32 scales that no value of the block overflows (12 * 2^126 is finite)."""
    with np.errstate(divide="ignore"):
        e = np.rint(np.log2(np.abs(np.asarray(scale, np.float64)))) + 128
    return np.clip(np.nan_to_num(e, neginf=2), 2, 254).astype(np.uint8)


def _set_fields(blocks: np.ndarray, qtype: QType, scale: float | np.ndarray,
                offset: float | np.ndarray) -> None:
    for pos, role in SCALE_FIELDS[qtype]:
        if role == "e8m0":
            blocks[..., pos] = np.broadcast_to(_e8m0(scale), blocks.shape[:-1])
            continue
        value = np.asarray(scale if role == "scale" else offset, dtype=np.float16)
        blocks[..., pos:pos + 2] = np.broadcast_to(value,
                                                   blocks.shape[:-1])[..., None].view(np.uint8)


@cache
def _unit_stats(qtype: QType) -> tuple[float, float]:
    """(offset per unit scale that centres the values, std of the values at unit scale)."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(4096, type_size(qtype)), dtype=np.uint8)
    a, b = raw.copy(), raw.copy()
    _set_fields(a, qtype, 1.0, 0.0)
    _set_fields(b, qtype, 0.0, 1.0)
    mean_a = float(gq.dequantize(a, qtype).mean())
    mean_b = float(gq.dequantize(b, qtype).mean())
    off = -mean_a / mean_b if any(r == "offset" for _, r in SCALE_FIELDS[qtype]) and mean_b else 0.0
    c = raw.copy()
    _set_fields(c, qtype, 1.0, off)
    return off, float(gq.dequantize(c, qtype).std())


def random_blocks(qtype: QType | str, n_values_shape: tuple[int, ...], rng: np.random.Generator,
                  std: float = 0.02, jitter: float = 0.5) -> np.ndarray:
    """Random weights of logical shape `n_values_shape` (last dim a multiple of the block size), as
    GGUF bytes: uint8 [..., last // block_size * type_size]. Each block's scale varies
    by +-`jitter`."""
    qtype = as_qtype(qtype)
    *lead, n = n_values_shape
    bs, ts = block_size(qtype), type_size(qtype)
    if n % bs:
        raise ValueError(f"{qtype.name}: the last dimension ({n}) must be a multiple of the block "
                         f"size {bs}")
    if qtype in (QType.F32, QType.F16, QType.BF16):
        w = rng.standard_normal(n_values_shape, dtype=np.float32) * np.float32(std)
        if qtype == QType.F32:
            return w.view(np.uint8)
        if qtype == QType.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, size=(*lead, n // bs, ts), dtype=np.uint8)
    off, unit_std = _unit_stats(qtype)
    d = (std / unit_std) * (1.0 + jitter * rng.uniform(-1.0, 1.0, size=blocks.shape[:-1]))
    _set_fields(blocks, qtype, d, d * off)
    return blocks.reshape(*lead, n // bs * ts)


def _index_byte(qtype: QType) -> int:
    """A byte of the block that no float16 field covers: random, so it can pick the block's
    scale."""
    taken = {pos + i for pos, role in SCALE_FIELDS[qtype]
             for i in ((0,) if role == "e8m0" else (0, 1))}
    return next(i for i in range(type_size(qtype)) if i not in taken)


def random_blocks_fast(qtype: QType | str, n_values_shape: tuple[int, ...],
                       rng: np.random.Generator, std: float = 0.02,
                       jitter: float = 0.5) -> np.ndarray:
    """random_blocks' contract (valid finite blocks, mean ~0, the std asked for, each block's scale
    within +-`jitter`) at several times its speed, for models of tens of GB (`make-model --shape`):
    the bytes come from the bit generator's raw 64-bit words (not a bounded draw a byte), and each
    block's scale is one of 256 levels picked by one of its own random bytes (not a float draw and
    conversion a block). A different random stream from random_blocks: the tiny models of the tests
    keep theirs."""
    qtype = as_qtype(qtype)
    *lead, n = n_values_shape
    bs, ts = block_size(qtype), type_size(qtype)
    if qtype in (QType.F32, QType.F16, QType.BF16) or n % bs:
        return random_blocks(qtype, n_values_shape, rng, std, jitter)
    n_blocks = int(np.prod(lead, dtype=np.int64)) * (n // bs)
    words = rng.bit_generator.random_raw(-(-n_blocks * ts // 8))
    blocks = words.view(np.uint8)[:n_blocks * ts].reshape(n_blocks, ts)
    off, unit_std = _unit_stats(qtype)
    levels = (std / unit_std) * (1.0 + jitter * np.linspace(-1.0, 1.0, 256))
    pick = blocks[:, _index_byte(qtype)].copy()
    for pos, role in SCALE_FIELDS[qtype]:
        if role == "e8m0":
            blocks[:, pos] = _e8m0(levels)[pick]
            continue
        table = (levels if role == "scale" else levels * off).astype(np.float16).view(np.uint16)
        blocks[:, pos:pos + 2].view(np.uint16)[:, 0] = table[pick]
    return blocks.reshape(*lead, n // bs * ts)
