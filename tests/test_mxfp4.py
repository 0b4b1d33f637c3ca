"""MXFP4 (GGML type 39, gpt-oss's experts) at the ends of its exponent range, on every backend.

A block is {uint8 e; uint8 qs[16]}: value j = level[nibble j] * 2^(e - 128) (gguf.quants.MXFP4,
ggml's dequantize_row_mxfp4; the levels are the e2m1 values doubled). The random blocks of the
other tests keep e near 120; here every e from 0 to 255 appears:
- e = 2 .. 252: every backend gives gguf's bits (the products level * 2^(e - 128) are exact);
- e = 253 .. 255: the large levels overflow to +-inf, in gguf and in our kernels alike;
- e = 0, 1: gguf's scales 2^-128, 2^-127 are float32 denormals, which XLA (and our C++ kernels,
  which run on XLA's threads) flush to zero: those blocks are +-0 here. No real weight is near
  1e-38 (gguf's own quantizer picks e from the block's largest value).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

import pallas_kernels as pk
from pallas_kernels import cpu
from quant_types import table

MX = pk.QType.MXFP4


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _rows_by_exponent(exponents, blocks_a_row: int = 4, seed: int = 0) -> np.ndarray:
    """A row an exponent (every block of the row has it), random nibbles: uint8 [n, bytes]."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (len(exponents), blocks_a_row, 17), dtype=np.uint8)
    b[:, :, 0] = np.asarray(exponents, np.uint8)[:, None]
    return b.reshape(len(exponents), -1)


def test_the_levels_and_scales_are_ggmls():
    """The table and the scale the kernels use are gguf's (which copies ggml-quants.c)."""
    assert list(table("mxfp4")) == [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    assert (pk.block_size(MX), pk.type_size(MX)) == (32, 17)
    # e = 128: scale 1, so the values are the levels themselves
    b = np.zeros((1, 17), np.uint8)
    nib = np.arange(16, dtype=np.uint8)
    b[0, 0], b[0, 1:] = 128, nib | (nib[::-1] << 4)
    want = np.concatenate([table("mxfp4"), table("mxfp4")[::-1]])
    np.testing.assert_array_equal(gq.dequantize(b, MX)[0], want)
    np.testing.assert_array_equal(np.asarray(pk.dequantize(jnp.asarray(b), "MXFP4")), [want])


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_every_exponent_dequantizes_to_ggufs_bits(backend):
    b = _rows_by_exponent(range(256))
    with np.errstate(over="ignore"):
        ref = gq.dequantize(b, MX)
    out = np.asarray(pk.dequantize(jnp.asarray(b), "MXFP4", backend=backend))
    np.testing.assert_array_equal(_bits(out[2:]), _bits(ref[2:]), err_msg=backend)
    assert np.isinf(out[253:]).any() and not np.isfinite(ref[253:]).all()
    # e = 0, 1: flushed denormals, the level's sign kept
    assert (out[:2] == 0).all() and (ref[:2] != 0).any()
    np.testing.assert_array_equal(np.signbit(out[:2]), np.signbit(ref[:2]))


@pytest.mark.parametrize("backend", ["cpu-exact", "xla"])
def test_the_exact_products_read_every_finite_exponent_bit_for_bit(backend):
    """x = the identity: the product is the dequantized matrix (e up to 252: no inf, so no 0 * inf
    NaN in the sums)."""
    b = _rows_by_exponent(range(253), seed=1)
    ref = gq.dequantize(b, MX)
    y = np.asarray(pk.qmatmul(jnp.eye(128, dtype=jnp.float32), jnp.asarray(b), "MXFP4",
                              backend=backend)).T
    np.testing.assert_array_equal(_bits(y[2:]), _bits(ref[2:]), err_msg=backend)
    assert (y[:2] == 0).all()


@pytest.mark.parametrize("backend", ["cpu-exact", "cpu", "xla"])
def test_an_overflowing_block_gives_inf_as_in_gguf(backend):
    """e = 255 with non-negative levels (nibbles 0..7): 12 * 2^127 overflows to +inf in gguf, and
    a product with positive x is +inf on every path (int8 too: its scale 2^127 times x's)."""
    rng = np.random.default_rng(2)
    b = _rows_by_exponent([255, 254, 130], seed=2)
    b3 = b.reshape(3, 4, 17)
    b3[:, :, 1:] &= 0x77                                   # levels 0..12: no negative values
    b3[:, 0, 1] = 0x77                                     # a 12 in every row
    with np.errstate(over="ignore"):
        ref = gq.dequantize(b, MX)
    assert np.isposinf(ref[0]).any() and np.isposinf(ref[1]).any() and np.isfinite(ref[2]).all()
    x = rng.uniform(0.5, 1.0, (2, 128)).astype(np.float32)
    y = np.asarray(pk.qmatmul(jnp.asarray(x), jnp.asarray(b), "MXFP4", backend=backend))
    assert np.isposinf(y[:, :2]).all(), (backend, y)
    assert np.isfinite(y[:, 2]).all()


def test_mxfp4_is_a_cpu_kernel_type_with_int8_and_packed_paths():
    assert MX in pk.SUPPORTED and MX in cpu.FAST and MX in cpu.PACKS
