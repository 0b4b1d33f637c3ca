"""The cpu kernels' top_k (pick.cc), which the cpu backends' routers use (model/layers.route): the
same values and indices as jax.lax.top_k, ties, signed zeros, infinities and NaNs included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu


def _same_as_lax(x: np.ndarray, k: int) -> None:
    values, ids = jax.jit(lambda a: cpu.top_k(a, k))(jnp.asarray(x))
    want_values, want_ids = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    # bit for bit: -0.0 and +0.0 apart, NaNs where lax has them
    np.testing.assert_array_equal(np.asarray(values).view(np.uint32),
                                  np.asarray(want_values).view(np.uint32))
    assert ids.dtype == jnp.int32 and values.dtype == jnp.float32


@pytest.mark.parametrize("k", [1, 2, 8, 10, 64])
def test_router_scores(k):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((37, 160)).astype(np.float32)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    _same_as_lax(probs, k)
    _same_as_lax(logits, k)


def test_ties_keep_the_lower_index_first():
    rng = np.random.default_rng(1)
    # a few distinct values a row, so most are tied (softmax underflowing to 0 ties many experts)
    x = rng.integers(0, 4, (64, 48)).astype(np.float32)
    for k in (1, 3, 8, 20, 48):
        _same_as_lax(x, k)
    _same_as_lax(np.zeros((3, 16), np.float32), 5)


def test_signed_zeros_infinities_and_nans_in_xlas_order():
    row = np.array([0.0, -0.0, 1.0, -np.inf, np.inf, np.nan, -1.0, -np.nan, 2.0, 0.0, np.inf, -0.0],
                   np.float32)
    x = np.stack([row, row[::-1].copy(), np.roll(row, 5)])
    for k in range(1, len(row) + 1):
        _same_as_lax(x, k)


def test_a_bad_k_is_refused_with_the_shape():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"top_k of x \(2, 8\) with k = 9"):
        cpu.top_k(x, 9)
    with pytest.raises(ValueError, match="k = 0"):
        cpu.top_k(x, 0)
