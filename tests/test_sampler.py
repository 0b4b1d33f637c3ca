"""The sampler's greedy pick and its non-finite rows (engine/execute/sampler.py, and the cpu
backend's kernel for it: pallas_kernels/cpu/pick.cc), against numpy on rows that hold ties,
-inf, +inf and NaN, at vocabulary sizes that are and are not a multiple of the chunk and of the 8
lanes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from strata_jax.engine.execute.sampler import SamplingRows, first_argmax, sample, sample_and_next


def rows(vocab: int) -> np.ndarray:
    x = np.random.default_rng(vocab).standard_normal((7, vocab)).astype(np.float32)
    x[0, [vocab // 3, vocab // 2]] = 9.0             # a tie: the first one wins
    x[1] = -np.inf                                    # all -inf: index 0
    x[2, [3, 9]] = np.nan                             # NaN: argmax ranks it first
    x[3, vocab - 1] = np.inf
    x[4, vocab - 1] = np.nan                          # one NaN, last
    x[5, :] = 1.0                                     # all equal: index 0
    return x


@pytest.mark.parametrize("vocab", [16, 77, 128, 129, 1000, 49152])
def test_first_argmax_is_numpy_argmax(vocab):
    x = rows(vocab)
    got = np.asarray(jax.jit(first_argmax)(x))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))


def test_greedy_sample_marks_every_row_with_a_nan_or_an_inf():
    """A row with one NaN or one inf among 49,152 logits answers -1 (the engine ends its request
    with an error); XLA:CPU's max over such a row can be finite, so the check reads every logit."""
    x = rows(49152)
    g = SamplingRows.greedy(len(x))
    got = np.asarray(jax.jit(sample)(x, *g.as_tuple()))
    finite = np.isfinite(x).all(axis=-1)
    np.testing.assert_array_equal(got, np.where(finite, np.argmax(x, axis=-1), -1))
    assert list(finite) == [True, False, False, False, False, True, True]


def expected(x: np.ndarray) -> np.ndarray:
    """argmax a row, -1 where it holds a NaN or an inf."""
    return np.where(np.isfinite(x).all(axis=-1), np.argmax(x, axis=-1), -1).astype(np.int32)


@pytest.mark.parametrize("vocab", [16, 17, 77, 128, 1000, 49152])
def test_the_cpu_kernels_greedy_pick_is_argmax_and_minus_one_for_non_finite_rows(vocab):
    x = rows(vocab)
    got = np.asarray(jax.jit(pk.cpu.greedy_pick)(x))
    np.testing.assert_array_equal(got, expected(x))
    g = SamplingRows.greedy(len(x))
    for cpu_pick in (False, True):
        tokens, nxt = jax.jit(sample_and_next, static_argnames="cpu_pick")(
            x, *g.as_tuple(), np.array([True] * 6 + [False]), cpu_pick=cpu_pick)
        np.testing.assert_array_equal(np.asarray(tokens), expected(x))
        # the next window's tokens: padding and NaN rows 0, the others their token
        np.testing.assert_array_equal(np.asarray(nxt)[:, 0],
                                      np.where(expected(x) >= 0, expected(x), 0) * ([1] * 6 + [0]))


def test_greedy_pick_names_a_bad_shape():
    with pytest.raises(ValueError, match=r"\[R, V\].*\(3,\)"):
        pk.cpu.greedy_pick(jnp.zeros(3))
