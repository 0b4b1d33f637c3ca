"""pallas_kernels against the gguf package's reference dequantization, on every type and backend.

On a CPU the kernels run on the xla backend and the Pallas kernels in interpret mode. On a machine
with a GPU, `STRATA_TEST_BACKEND=pallas` runs them on the GPU's real Pallas (Triton) backend instead
of interpret mode, beside xla (scripts/device_check.sh does); any other value is a comma list of
backends taken as is (e.g. `STRATA_TEST_BACKEND=pallas,interpret`). Without a GPU the pallas cases
are skipped, saying why.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

import pallas_kernels as pk

TYPES = [t.name for t in pk.SUPPORTED]
_ENV_BACKEND = os.environ.get("STRATA_TEST_BACKEND", "").strip()
if not _ENV_BACKEND:
    BACKENDS = ["xla", "interpret"]
elif _ENV_BACKEND == "pallas":
    BACKENDS = ["xla", "pallas"]
else:
    BACKENDS = [b.strip() for b in _ENV_BACKEND.split(",") if b.strip()]
ON_GPU = jax.default_backend() == "gpu"
# A float32 product on a GPU may run in TF32 (10-bit mantissa): XLA's default precision there, and
# Triton's dot. Its error is ~1e-3 of a product, so the matmul checks allow 3e-3 of the scale there,
# 1e-4 elsewhere.
MATMUL_ATOL = 3e-3 if ON_GPU else 1e-4


def _need_device(backend):
    if backend == "pallas" and not ON_GPU:
        pytest.skip(f"STRATA_TEST_BACKEND={_ENV_BACKEND}: the pallas backend needs a GPU; JAX's is "
                    f"{jax.default_backend()!r}")


def _blocks(qtype, shape, seed=0):
    return pk.random_blocks(qtype, shape, np.random.default_rng(seed))


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_bit_exact(qtype, backend):
    _need_device(backend)
    shapes = [(3, 512), (2, 2, 256)]
    if pk.block_size(pk.as_qtype(qtype)) <= 32:
        shapes.append((5, 96))                       # rows of 3 blocks (float types: runs of 32)
    if qtype in ("F32", "F16", "BF16"):
        shapes.append((3, 7))                        # rows of an odd length: runs of one value
    for i, shape in enumerate(shapes):
        b = _blocks(qtype, shape, seed=i)
        ref = gq.dequantize(b, pk.as_qtype(qtype))
        out = pk.dequantize(jnp.asarray(b), qtype, backend=backend)
        assert out.shape == ref.shape, shape
        np.testing.assert_array_equal(_bits(out), _bits(ref), err_msg=f"{qtype} {backend} {shape}")
        # host data (a float type's: converted on the host, as a model's loader gives it)
        host = pk.dequantize(b, qtype, backend=backend)
        np.testing.assert_array_equal(_bits(host), _bits(ref), err_msg=f"{qtype} host {shape}")


def test_dequantize_detects_a_wrong_bit():
    """The oracle comparison can fail: one flipped quant bit changes the result."""
    b = _blocks("Q4_K", (1, 256))
    ref = gq.dequantize(b, pk.QType.Q4_K)
    b2 = b.copy()
    b2[0, 40] ^= 0x01
    assert not np.array_equal(_bits(pk.dequantize(b2, "Q4_K")), _bits(ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", TYPES)
def test_qmatmul_matches_numpy(qtype, backend):
    _need_device(backend)
    rng = np.random.default_rng(1)
    k = 512
    b = _blocks(qtype, (40, k), seed=2)              # n = 40: not a multiple of the 64-row tile
    w = gq.dequantize(b, pk.as_qtype(qtype))
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = np.asarray(pk.qmatmul(jnp.asarray(x), jnp.asarray(b), qtype, backend=backend))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    # float32 sums of 512 products: error ~ sqrt(k) * eps * |x||w|, far below 1e-4 of the scale.
    np.testing.assert_allclose(y, ref, rtol=0, atol=MATMUL_ATOL * np.abs(ref).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", ["Q4_K", "IQ4_XS", "Q8_0", "IQ2_S", "BF16", "MXFP4"])
def test_expert_matmul(qtype, backend):
    _need_device(backend)
    rng = np.random.default_rng(3)
    E, n, k, R = 6, 24, 256, 19
    b = _blocks(qtype, (E, n, k), seed=4)
    w = gq.dequantize(b, pk.as_qtype(qtype))
    ids = rng.choice([0, 1, 3, 5], size=R).astype(np.int32)     # experts 2 and 4 never chosen
    x = rng.standard_normal((R, k)).astype(np.float32)
    ref = np.einsum("rk,rnk->rn", x.astype(np.float64), w[ids].astype(np.float64))
    # Poison the unchosen experts: if any kernel dequantized them, NaN would reach the output.
    poisoned = b.copy()
    poisoned[[2, 4]] = 0xFF
    y = np.asarray(pk.expert_matmul(jnp.asarray(x), jnp.asarray(poisoned), jnp.asarray(ids), qtype,
                                    backend=backend))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=0, atol=MATMUL_ATOL * np.abs(ref).max())


@pytest.mark.parametrize("qtype", TYPES)
def test_pallas_kernels_lower_for_cuda(qtype):
    """Every Pallas kernel lowers through Triton for a CUDA GPU, without one."""
    b = jnp.asarray(_blocks(qtype, (64, 512)))
    eb = jnp.asarray(_blocks(qtype, (4, 32, 512)))
    x = jnp.zeros((5, 512), jnp.bfloat16)
    ids = jnp.array([0, 3, 3, 1, 2], jnp.int32)
    cases = [
        (lambda b: pk.dequantize(b, qtype, backend="pallas"), (b,)),
        (lambda x, b: pk.qmatmul(x, b, qtype, backend="pallas"), (x, b)),
        (lambda x, b, i: pk.expert_matmul(x, b, i, qtype, backend="pallas"), (x, eb, ids)),
    ]
    for f, args in cases:
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower()


def test_qtype_names_and_errors():
    assert pk.as_qtype("iq4_xs") is pk.QType.IQ4_XS
    assert pk.as_qtype(pk.QType.Q4_K) is pk.QType.Q4_K
    assert pk.as_qtype(int(pk.QType.Q8_0)) is pk.QType.Q8_0
    with pytest.raises(pk.UnsupportedQuantType, match="IQ1_S"):
        pk.as_qtype("IQ1_S")
    with pytest.raises(pk.UnsupportedQuantType, match="'Q9_9'"):
        pk.as_qtype("Q9_9")
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        pk.dequantize(_blocks("Q8_0", (1, 32)), "Q8_0", backend="cuda")


def test_random_blocks_are_sane():
    for qtype in TYPES:
        w = gq.dequantize(_blocks(qtype, (16, 512)), pk.as_qtype(qtype))
        assert np.isfinite(w).all()
        assert abs(float(w.mean())) < 0.005 and 0.015 < float(w.std()) < 0.025, qtype
