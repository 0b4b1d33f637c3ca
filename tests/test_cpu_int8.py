"""The cpu backend's int8 path (--cpu-math int8, pallas_kernels/cpu/q8.h, int8.cc): each x row
quantized per block to 8 bits, exact integer sums, float scales a block.

- against float64 of the SAME quantized activations: the integer sums are exact, so the only error
  left is a few float32 roundings a block (bound: 8 eps * sum |terms|);
- against the exact path: the difference is the activations' quantization error, at most half a step
  a value: |y_int8 - y_exact| <= sum_i |w_i| * d_x(i) / 2 (plus float32 rounding);
- a row's bits depend only on that row: alone, in a decode-sized call (M <= 8, registers) or a
  prefill-sized one (M > 8, an interleaved buffer), and in the expert kernel;
- every ISA level this CPU runs gives the same bits (scalar, AVX2, AVX-512 VNNI builds, as pip built
  them).
"""

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq
from isa_levels import outputs_by_level

import pallas_kernels as pk
from pallas_kernels import cpu
from pallas_kernels.layout import layout_for

INT8 = [t for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K",
                    "Q5_K", "Q6_K", "IQ4_XS", "MXFP4")]
EPS = float(np.finfo(np.float32).eps)


def _unit(qtype: str) -> int:
    """Values a block of x on the int8 path: 32 for the 32-value types, 256 for the super-blocks
    (Q8_K)."""
    return 256 if pk.block_size(pk.as_qtype(qtype)) == 256 else 32


def quantize_like_the_kernel(x: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """(q as float64 [m, k], d a value [m, k]): d = amax / 127, q = round-half-even(x * (1 / d)), in
    float32."""
    m, k = x.shape
    xb = x.reshape(m, k // unit, unit).astype(np.float32)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((xb * inv).astype(np.float32)), -127, 127)
    return (q.reshape(m, k).astype(np.float64),
            np.broadcast_to(d, xb.shape).reshape(m, k).astype(np.float64))


def _weights(qtype, n, k, seed=2):
    b = pk.random_blocks(qtype, (n, k), np.random.default_rng(seed))
    return (b, gq.dequantize(b, pk.as_qtype(qtype)).astype(np.float64),
            layout_for(pk.as_qtype(qtype), b.shape[-1]))


def _mm(x, b, lay, math):
    return np.asarray(cpu.qmatmul(jnp.asarray(x), jnp.asarray(b), lay, math=math))


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", INT8)
def test_int8_products_are_exact_integer_sums_of_the_quantized_x(qtype):
    """Against float64 of the same quantized x: within 8 float32 roundings of the terms' magnitude.
    A wrong block layout, scale, offset or minimum misses by a quantization step, ~1e5 times this
    bound."""
    # 576: 18 blocks (SmolLM2's rows); 224: 7
    ks = (576, 224) if _unit(qtype) == 32 else (512, 2048)
    rng = np.random.default_rng(3)
    for k in ks:
        b, w, lay = _weights(qtype, 37, k)                        # 37 rows: a tile of 8 cut short
        # registers (M <= 8) and the buffered path
        for m in (1, 3, 9, 40):
            x = rng.standard_normal((m, k)).astype(np.float32) * 3
            q, d = quantize_like_the_kernel(x, _unit(qtype))
            ref = (q * d) @ w.T
            bound = 8 * EPS * (np.abs(q * d) @ np.abs(w).T) + 1e-30
            y = _mm(x, b, lay, "int8")
            assert np.isfinite(y).all()
            worst = float((np.abs(y - ref) / bound).max())
            assert worst <= 1.0, f"{qtype} k={k} M={m}: {worst:.1f}x the bound"


@pytest.mark.parametrize("qtype", INT8)
def test_int8_is_within_half_a_step_a_value_of_the_exact_path(qtype):
    k = 512
    b, w, lay = _weights(qtype, 40, k, seed=5)
    x = np.random.default_rng(6).standard_normal((5, k)).astype(np.float32)
    _, d = quantize_like_the_kernel(x, _unit(qtype))
    # |x - q d| <= d / 2 for every value
    step = (d / 2) @ np.abs(w).T
    rounding = 8 * EPS * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    diff = np.abs(_mm(x, b, lay, "int8").astype(np.float64) - _mm(x, b, lay, "exact"))
    assert (diff <= step * (1 + 1e-3) + rounding).all(), float((diff / (step + rounding)).max())
    # the paths really differ: int8 ran
    assert diff.max() > 0


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "MXFP4"])
def test_a_rows_int8_bits_do_not_depend_on_the_other_rows(qtype):
    k = 512
    b, _, lay = _weights(qtype, 50, k, seed=7)
    x = np.random.default_rng(8).standard_normal((24, k)).astype(np.float32)
    alone = np.concatenate([_mm(x[i:i + 1], b, lay, "int8") for i in range(24)])
    # 6, 7: the buffered path's blocks of 4 rows and the rest (2, 3)
    for m in (2, 6, 7, 8, 9, 24):
        together = np.concatenate([_mm(x[i:i + m], b, lay, "int8") for i in range(0, 24, m)])
        np.testing.assert_array_equal(_bits(together), _bits(alone), err_msg=f"{qtype} M={m}")


def test_the_int8_expert_kernel_gives_each_row_the_bits_of_its_expert_alone():
    k, n, n_exp = 512, 48, 5
    rng = np.random.default_rng(9)
    weights = []
    for qtype in ("Q4_K", "Q5_0", "MXFP4"):
        b = pk.random_blocks(qtype, (n_exp, n, k),
                             np.random.default_rng(int(rng.integers(1 << 30))))
        weights.append((jnp.asarray(b), layout_for(pk.as_qtype(qtype), b.shape[-1])))
    for m in (3, 20):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ids = rng.integers(-1, n_exp, m).astype(np.int32)
        ys = cpu.expert_matmul_many(jnp.asarray(x), jnp.asarray(ids), weights, math="int8")
        for (w, lay), y in zip(weights, ys):
            y = np.asarray(y)
            for r in range(m):
                if ids[r] < 0:
                    assert not y[r].any()
                    continue
                own = _mm(x[r:r + 1], np.asarray(w[ids[r]]), lay, "int8")[0]
                np.testing.assert_array_equal(_bits(y[r]), _bits(own),
                                              err_msg=f"{lay.qtype.name} M={m} row {r}")


def test_norm_and_many_weights_in_one_int8_call_give_the_bits_of_separate_calls():
    rng = np.random.default_rng(10)
    ws = []
    for qtype, n in (("Q4_1", 96), ("Q6_K", 40), ("Q8_0", 64)):
        b = pk.random_blocks(qtype, (n, 512), np.random.default_rng(int(rng.integers(1 << 30))))
        ws.append((jnp.asarray(b), layout_for(pk.as_qtype(qtype), b.shape[-1])))
    for m in (1, 12):
        x = jnp.asarray(rng.standard_normal((m, 512)).astype(np.float32))
        for (w, lay), y in zip(ws, cpu.qmatmul_many(x, ws, math="int8")):
            np.testing.assert_array_equal(_bits(y), _bits(cpu.qmatmul(x, w, lay, math="int8")))
        norm = jnp.asarray(rng.standard_normal(512).astype(np.float32))
        hx, ys = cpu.norm_qmatmul_many(x, norm, 1e-5, ws, math="int8")
        for (w, lay), y in zip(ws, ys):
            np.testing.assert_array_equal(_bits(y), _bits(cpu.qmatmul(hx, w, lay, math="int8")))


def test_a_bad_math_is_refused():
    b, _, lay = _weights("Q4_0", 8, 64)
    with pytest.raises(ValueError, match="'int4'"):
        cpu.qmatmul(jnp.ones((1, 64)), jnp.asarray(b), lay, math="int4")


_HASH = """
import hashlib, numpy as np, jax.numpy as jnp, pallas_kernels as pk
from pallas_kernels import cpu
from pallas_kernels.layout import layout_for
out = []
for t in %r:
    k = 576 if pk.block_size(pk.as_qtype(t)) == 32 else 512
    b = jnp.asarray(pk.random_blocks(t, (37, k), np.random.default_rng(1)))
    lay = layout_for(pk.as_qtype(t), b.shape[-1])
    x = np.random.default_rng(2).standard_normal((20, k)).astype(np.float32)
    for math in ("int8", "exact"):
        ys = [np.asarray(cpu.qmatmul(jnp.asarray(x[a:z]), b, lay, math=math)) for a, z in ((0, 1), (1, 4), (4, 20))]
        out.append(hashlib.sha1(np.concatenate(ys).tobytes()).hexdigest())
print(" ".join(out))
"""  # noqa: E501


def test_every_isa_level_this_cpu_runs_gives_the_same_bits():
    """The builds pip made (one a level: setup.py), each loaded alone in a fresh process through
    STRATA_CPU_KERNELS_LIB, on the direct and buffered paths of both maths."""
    hashes = outputs_by_level(_HASH % (INT8,))
    first, *others = hashes
    for level in others:
        assert hashes[level] == hashes[first], f"{level} differs from {first}"
    # int8 and exact differ, every type
    assert len({h for h in hashes[first]}) == 2 * len(INT8)
    assert hashlib.sha1(b"").hexdigest() not in hashes[first]


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
def test_a_nan_or_inf_activation_gives_nan_in_its_row_only(qtype):
    """As on the exact path: the engine then ends that request with an error (test_server_limits),
    instead of 8-bit quantization turning the NaN into finite logits."""
    k = 512
    b, _, lay = _weights(qtype, 16, k)
    x = np.random.default_rng(11).standard_normal((12, k)).astype(np.float32)
    x[3, 17], x[10, 300] = np.nan, np.inf
    # the buffered path, and the direct one
    for m in (12, 4):
        y = np.concatenate([_mm(x[i:i + m], b, lay, "int8") for i in range(0, 12, m)])
        assert np.isnan(y[[3, 10]]).all()
        assert np.isfinite(np.delete(y, [3, 10], axis=0)).all()
