"""The cpu backend (C++ custom calls through jax.ffi, pallas_kernels/cpu) against gguf's reference
and the xla backend: dequantization bit for bit, products to float32 rounding, a row's bits
independent of the other rows, and experts that no row chose never read."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

import pallas_kernels as pk
from pallas_kernels import cpu
from pallas_kernels.random_blocks import SCALE_FIELDS

FAST = [t.name for t in pk.SUPPORTED if t in cpu.FAST]
SLOW = [t.name for t in pk.SUPPORTED if t not in cpu.FAST]
FLOATS = ("F32", "F16", "BF16")
EPS = float(np.finfo(np.float32).eps)


def _blocks(qtype, shape, seed=0):
    return pk.random_blocks(qtype, shape, np.random.default_rng(seed))


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _mm(backend):
    return jax.jit(lambda x, b, t: pk.qmatmul(x, b, t, backend=backend), static_argnums=2)


def _emm(backend):
    return jax.jit(lambda x, b, i, t: pk.expert_matmul(x, b, i, t, backend=backend),
                   static_argnums=3)


# this file: the exact path (test_cpu_int8.py: int8)
cpu_mm, xla_mm = _mm("cpu-exact"), _mm("xla")
cpu_emm, xla_emm = _emm("cpu-exact"), _emm("xla")


def _assert_close(y, y_ref, x, w, what):
    """|y - y_ref| within float32 summation error: a few eps * sqrt(k) * (|x| @ |w|^T),
    elementwise."""
    k = x.shape[1]
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    bound = 4 * EPS * np.sqrt(k) * scale + 1e-30
    err = np.abs(np.asarray(y, np.float64) - np.asarray(y_ref, np.float64))
    assert np.isfinite(y).all(), what
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{what}: error {worst:.2f}x the float32 bound"


def test_the_library_is_built():
    """Part of "pip install builds the extension": on this machine it must exist and load (a
    failure, not a skip, if it does not)."""
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu.isa() in ("avx512", "avx2", "scalar")
    if not os.environ.get(cpu.LIB_ENV):
        assert cpu.library_path().parent == Path(cpu.__file__).parent
    if jax.default_backend() == "cpu":
        assert pk.resolve_backend("auto") == "cpu"


def test_a_clean_checkout_builds_the_extension(tmp_path):
    """`pip install` of the repository's tracked files (what a clean clone holds) compiles the
    kernels into the package: the wheel pip builds from them carries
    pallas_kernels/cpu/_strata_cpu*.so."""
    root = Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    src = tmp_path / "clone"
    for f in files:
        if (root / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, src / f)
    assert not list(src.rglob("_strata_cpu*.so"))                     # nothing prebuilt travels
    # no build isolation: the build's one requirement beyond setuptools, jaxlib (the FFI headers),
    # is here. Only the base level (STRATA_CPU_LEVELS): each level is one compiler run of a minute
    # or more on a slow 2-core machine, and the suite's own install has built every level.
    env = {**os.environ, "STRATA_CPU_LEVELS": "scalar"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import zipfile
    (wheel,) = (tmp_path / "dist").glob("strata_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    built = sorted(n for n in names
                   if n.startswith("pallas_kernels/cpu/_strata_cpu") and n.endswith(".so"))
    assert len(built) == 1 and "_strata_cpu_scalar" in built[0], names


@pytest.mark.parametrize("qtype", FAST)
def test_dequantization_is_bit_exact(qtype):
    """x = the identity makes the product the dequantized matrix itself: the C++ dequantization
    gives gguf.quants.dequantize's float32 values exactly (each output is one weight times 1 plus
    zeros)."""
    k = 512
    b = _blocks(qtype, (40, k), seed=1)
    ref = gq.dequantize(b, pk.as_qtype(qtype))                       # [40, k]
    y = np.asarray(cpu_mm(jnp.eye(k, dtype=jnp.float32), jnp.asarray(b), qtype))   # [k, 40]
    np.testing.assert_array_equal(y.T, ref, err_msg=qtype)


@pytest.mark.parametrize("qtype", FAST)
def test_qmatmul_matches_xla(qtype):
    # k: whole groups of 8 blocks (512), and for 32-value blocks a group cut short (576: 18 blocks,
    # as SmolLM2's rows) and a row shorter than one group (224: the fields' masked loads end inside
    # it)
    ks = (512, 576, 224) if pk.block_size(pk.as_qtype(qtype)) == 32 else (512, 768)
    n = 40                                           # n = 40: not a whole number of register tiles
    rng = np.random.default_rng(3)
    for k in ks:
        b = _blocks(qtype, (n, k), seed=2)
        w = gq.dequantize(b, pk.as_qtype(qtype))
        for m in (1, 3, 8, 64):
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = np.asarray(cpu_mm(jnp.asarray(x), jnp.asarray(b), qtype))
            assert y.shape == (m, n)
            what = f"{qtype} k={k} M={m}"
            _assert_close(y, xla_mm(jnp.asarray(x), jnp.asarray(b), qtype), x, w, f"{what} vs xla")
            _assert_close(y, x.astype(np.float64) @ w.astype(np.float64).T, x, w,
                          f"{what} vs float64")


def test_calls_from_several_threads_at_once():
    """The kernels' helper threads (cpu/parallel.h) serve one call at a time; calls that come
    meanwhile from other threads run on their own thread. Either way each result has the bits of a
    call made alone."""
    import threading

    rng = np.random.default_rng(11)
    jobs = []
    for qtype, m, k, n in (("Q4_1", 1, 576, 1536), ("Q8_0", 4, 576, 960), ("Q4_K", 2, 512, 1200)):
        b = jnp.asarray(_blocks(qtype, (n, k), seed=int(rng.integers(1 << 30))))
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        jobs.append((x, b, qtype, _bits(cpu_mm(x, b, qtype))))
    wrong: list[str] = []

    def hammer(x, b, qtype, alone):
        for i in range(40):
            if not np.array_equal(_bits(cpu_mm(x, b, qtype)), alone):
                wrong.append(f"{qtype} call {i}")

    threads = [threading.Thread(target=hammer, args=job) for job in jobs for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_tall_product_in_long_units_has_the_bits_of_short_ones(qtype):
    """1-2 rows of x split a product's weight rows into about two long units a thread, more rows
    into short units of at most 256 (ffi.cc rows_per_unit): a row's result has the same bits either
    way. n = 1030 rows: units over 256 long, not a whole number of register tiles."""
    k, n = 576, 1030
    b = jnp.asarray(_blocks(qtype, (n, k), seed=9))
    x = np.random.default_rng(6).standard_normal((64, k)).astype(np.float32)
    y64 = _bits(cpu_mm(jnp.asarray(x), b, qtype))
    y2 = _bits(cpu_mm(jnp.asarray(x[:2]), b, qtype))
    np.testing.assert_array_equal(y2, y64[:2], err_msg=f"{qtype}: 2 rows vs the same rows in 64")
    np.testing.assert_array_equal(_bits(cpu_mm(jnp.asarray(x[5:6]), b, qtype))[0], y64[5],
                                  err_msg=qtype)
    w = gq.dequantize(np.asarray(b), pk.as_qtype(qtype))
    _assert_close(np.asarray(cpu_mm(jnp.asarray(x[:1]), b, qtype)),
                  x[:1].astype(np.float64) @ w.astype(np.float64).T,
                  x[:1], w, f"{qtype} 1 x {n} rows vs float64")


@pytest.mark.parametrize("qtype", FAST + SLOW[:1])
def test_a_row_alone_equals_the_row_in_a_batch(qtype):
    """Batch invariance: the bits of a row's result do not depend on M or on the other rows."""
    k, n = 512, 72
    b = jnp.asarray(_blocks(qtype, (n, k), seed=4))
    x = np.random.default_rng(5).standard_normal((64, k)).astype(np.float32)
    y64 = _bits(cpu_mm(jnp.asarray(x), b, qtype))
    y8 = _bits(cpu_mm(jnp.asarray(x[:8]), b, qtype))
    for i in (0, 3, 7):
        alone = _bits(cpu_mm(jnp.asarray(x[i:i + 1]), b, qtype))[0]
        np.testing.assert_array_equal(alone, y8[i], err_msg=f"{qtype}: row {i} alone vs in 8")
        np.testing.assert_array_equal(alone, y64[i], err_msg=f"{qtype}: row {i} alone vs in 64")


@pytest.mark.parametrize("k", [576, 512])
def test_norm_then_products_in_one_call(k):
    """norm_qmatmul_many: the RMSNorm within float32 rounding of the model's XLA rms_norm, its
    products the bits of qmatmul_many on that hx (a slow type through its tiles), the norm alone (no
    weights) the same hx, and a row alone the bits of the row among 16 (the norm's sum has a fixed
    order a row)."""
    from strata_jax.model.layers import rms_norm

    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((16, k)).astype(np.float32) * 3)
    norm = jnp.asarray(rng.standard_normal(k).astype(np.float32))
    ws = [(jnp.asarray(_blocks(t, (n, k), seed=n)), t) for t, n in (("Q4_1", 64), ("Q8_0", 24))]
    if k % 256 == 0:
        ws.append((jnp.asarray(_blocks(SLOW[0], (8, k), seed=3)), SLOW[0]))
    fn = jax.jit(lambda x, norm: pk.norm_qmatmul_many(x, norm, 1e-5, ws, backend="cpu-exact"))
    hx, ys = fn(x, norm)
    ref = np.asarray(rms_norm(x, norm, 1e-5))
    np.testing.assert_allclose(np.asarray(hx), ref, rtol=4 * EPS,
                               atol=4 * EPS * float(np.abs(ref).max()))
    for (b, t), y in zip(ws, ys):
        want = (pk.qmatmul_many(hx, [(b, t)], backend="cpu-exact")[0] if t in FAST
                else xla_mm(hx, b, t))
        if t in FAST:
            np.testing.assert_array_equal(_bits(y), _bits(want), err_msg=t)
        else:
            w = np.asarray(pk.dequantize(b.reshape(-1), t)).reshape(8, k)
            _assert_close(y, want, np.asarray(hx), w, t)
    alone, _ = jax.jit(lambda x, norm: pk.norm_qmatmul_many(x, norm, 1e-5, []))(x, norm)
    np.testing.assert_array_equal(_bits(alone), _bits(hx))
    row, (y_row, *_) = fn(x[5:6], norm)
    np.testing.assert_array_equal(_bits(row)[0], _bits(hx)[5])
    np.testing.assert_array_equal(_bits(y_row)[0], _bits(ys[0])[5])
    # k not a multiple of 16: the tail
    odd, _ = pk.norm_qmatmul_many(x[:, :100], norm[:100], 1e-5, [])
    np.testing.assert_allclose(np.asarray(odd), np.asarray(rms_norm(x[:, :100], norm[:100], 1e-5)),
                               rtol=4 * EPS, atol=4 * EPS * float(np.abs(ref).max()))


@pytest.mark.parametrize("qtype", FLOATS)
def test_float_rows_of_any_length(qtype):
    """Float weights have no blocks: k need not be a multiple of 16 (x's tail is padded inside)."""
    rng = np.random.default_rng(6)
    for k in (7, 100):
        b = _blocks(qtype, (9, k), seed=k)
        w = gq.dequantize(b, pk.as_qtype(qtype))
        x = rng.standard_normal((3, k)).astype(np.float32)
        y = np.asarray(cpu_mm(jnp.asarray(x), jnp.asarray(b), qtype))
        _assert_close(y, x.astype(np.float64) @ w.astype(np.float64).T, x, w, f"{qtype} k={k}")


def _poison(blocks: np.ndarray, qtype: str, experts) -> np.ndarray:
    """The experts' blocks with NaN scales and inf offsets (float types: all NaN; MXFP4: inf
    values): a kernel that read any of them would put NaN or inf in its output."""
    out = blocks.copy()
    if qtype in FLOATS:
        out[list(experts)] = 0xFF
        return out
    t = pk.as_qtype(qtype)
    per = out[list(experts)].reshape(len(experts), -1, pk.type_size(t))
    for pos, role in SCALE_FIELDS[t]:
        if role == "e8m0":          # MXFP4: the largest exponent and level: 12 * 2^127 = inf
            per[..., pos], per[..., pos + 1:] = 255, 0x77
            continue
        per[..., pos:pos + 2] = np.frombuffer(np.float16(np.nan if role == "scale"
                                                         else np.inf).tobytes(), np.uint8)
    out[list(experts)] = per.reshape(out[list(experts)].shape)
    return out


@pytest.mark.parametrize("qtype", FAST + SLOW[:1])
def test_expert_matmul_reads_only_chosen_experts(qtype):
    E, n, k, R = 6, 24, 256, 19
    b = _blocks(qtype, (E, n, k), seed=7)
    rng = np.random.default_rng(8)
    ids = rng.choice([0, 1, 3, 5], size=R).astype(np.int32)     # experts 2 and 4 never chosen
    ids[[4, 11]] = -1                                            # no expert: a zero row
    ids[15] = E                                                  # out of range: a zero row too
    valid = (ids >= 0) & (ids < E)
    x = rng.standard_normal((R, k)).astype(np.float32)
    poisoned = _poison(b, qtype, [2, 4])
    y = np.asarray(cpu_emm(jnp.asarray(x), jnp.asarray(poisoned), jnp.asarray(ids), qtype))
    assert np.isfinite(y).all(), qtype
    assert (y[~valid] == 0).all()
    clean = np.asarray(cpu_emm(jnp.asarray(x), jnp.asarray(b), jnp.asarray(ids), qtype))
    np.testing.assert_array_equal(_bits(y), _bits(clean),
                                  err_msg="poisoned experts changed the result")
    ref = np.asarray(xla_emm(jnp.asarray(x), jnp.asarray(b),
                             jnp.asarray(np.where(valid, ids, 0)), qtype))
    w = gq.dequantize(b, pk.as_qtype(qtype))
    for r in np.flatnonzero(valid):
        _assert_close(y[r:r + 1], ref[r:r + 1], x[r:r + 1], w[ids[r]], f"{qtype} row {r} vs xla")
    # Each row as the plain qmatmul of its expert gives the same bits (the same kernel, row by row).
    for r in np.flatnonzero(valid)[:3]:
        alone = cpu_mm(jnp.asarray(x[r:r + 1]), jnp.asarray(b[ids[r]]), qtype)
        np.testing.assert_array_equal(_bits(alone)[0], _bits(y)[r])


def test_expert_matmul_tiles_and_no_expert_at_all():
    qtype, E, n, k = "Q4_K", 4, 16, 256
    b = jnp.asarray(_blocks(qtype, (E, n, k), seed=9))
    x = jnp.asarray(np.random.default_rng(10).standard_normal((6, k)).astype(np.float32))
    ids = jnp.array([3, 0, 3, 1, 0, 3], jnp.int32)
    tile = pk.expert_tile("cpu")
    g = pk.group_rows(ids, E, tile)
    xt = pk.scatter_rows(x, g)
    f = jax.jit(lambda xt, te, b: pk.expert_matmul_tiles(xt, te, b, qtype, backend="cpu-exact"))
    y = np.asarray(pk.gather_rows(f(xt, g.tile_expert, b), g))
    np.testing.assert_array_equal(_bits(y), _bits(cpu_emm(x, b, ids, qtype)))
    none = np.asarray(cpu_emm(x, b, jnp.full((6,), -1, jnp.int32), qtype))
    assert (none == 0).all()


@pytest.mark.parametrize("qtype", SLOW)
def test_slow_path_types_run(qtype):
    """Types without a C++ dequantization: a tile of rows dequantized by xla at a time, then the C++
    float32 kernel."""
    k, n = 256, 40
    b = _blocks(qtype, (n, k), seed=11)
    w = gq.dequantize(b, pk.as_qtype(qtype))
    x = np.random.default_rng(12).standard_normal((3, k)).astype(np.float32)
    y = np.asarray(cpu_mm(jnp.asarray(x), jnp.asarray(b), qtype))
    _assert_close(y, xla_mm(jnp.asarray(x), jnp.asarray(b), qtype), x, w, qtype)


def test_tiled_slow_path_with_a_partial_tile(monkeypatch):
    """Weight rows not a whole number of tiles: the last tile is shorter."""
    # 3 rows a tile, 40 = 13 * 3 + 1
    monkeypatch.setattr(cpu, "_SLOW_TILE_BYTES", 3 * 4 * 256)
    qtype, k, n = "IQ3_S", 256, 40
    b = _blocks(qtype, (n, k), seed=13)
    w = gq.dequantize(b, pk.as_qtype(qtype))
    x = np.random.default_rng(14).standard_normal((2, k)).astype(np.float32)
    y = np.asarray(pk.qmatmul(jnp.asarray(x), jnp.asarray(b), qtype, backend="cpu-exact"))
    _assert_close(y, x.astype(np.float64) @ w.astype(np.float64).T, x, w, qtype)


def test_weights_as_jit_constants_and_bfloat16_x():
    qtype, k, n = "Q4_1", 576, 48
    b = _blocks(qtype, (n, k), seed=15)
    x = np.random.default_rng(16).standard_normal((4, k)).astype(np.float32)
    # b: a constant
    f = jax.jit(lambda x: pk.qmatmul(x, jnp.asarray(b), qtype, backend="cpu-exact"))
    np.testing.assert_array_equal(_bits(f(jnp.asarray(x))),
                                  _bits(cpu_mm(jnp.asarray(x), jnp.asarray(b), qtype)))
    xb = jnp.asarray(x, jnp.bfloat16)                                              # upcast exactly
    np.testing.assert_array_equal(_bits(cpu_mm(xb, jnp.asarray(b), qtype)),
                                  _bits(cpu_mm(xb.astype(jnp.float32), jnp.asarray(b), qtype)))


def test_a_wrong_row_length_is_refused():
    b = jnp.asarray(_blocks("Q8_0", (4, 64)))
    with pytest.raises(ValueError, match="k = 64"):
        cpu_mm(jnp.ones((1, 96), jnp.float32), b, "Q8_0")


def test_missing_library_auto_uses_xla_and_cpu_raises(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(cpu.LIB_ENV, str(tmp_path / "nothing.so"))
    cpu._load.cache_clear()
    cpu.library.load.cache_clear()
    pk._say_auto_is_xla.cache_clear()
    try:
        assert not cpu.available()
        with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
            assert pk.resolve_backend("auto") == "xla"
        assert "nothing.so" in caplog.text
        with pytest.raises(cpu.CpuKernelsUnavailable, match="nothing.so"):
            pk.qmatmul(jnp.ones((1, 32)), jnp.asarray(_blocks("Q8_0", (4, 32))), "Q8_0",
                       backend="cpu-exact")
    finally:
        monkeypatch.undo()
        cpu._load.cache_clear()
        cpu.library.load.cache_clear()
        pk._say_auto_is_xla.cache_clear()
    assert cpu.available()


@pytest.mark.parametrize("m", [1, 3, 9])
def test_several_weights_in_one_call_give_the_bits_of_separate_calls(m):
    """qmatmul_many (q, k, v; gate, up) and expert_matmul_many (an MoE layer's gate, up): mixed
    types, a slow path type among them, rows on the direct and buffered paths."""
    from pallas_kernels.layout import layout_for

    rng = np.random.default_rng(m)

    def weight(qtype, shape):
        b = jnp.asarray(_blocks(qtype, shape, seed=int(rng.integers(1 << 30))))
        return b, layout_for(pk.QType[qtype], b.shape[-1])

    dense = [weight("Q4_1", (96, 512)), weight("Q6_K", (40, 512)), weight(SLOW[0], (16, 512)),
             weight("Q8_0", (200, 512))]
    x = jnp.asarray(rng.normal(size=(m, 512)).astype(np.float32))
    for (w, lay), y in zip(dense, jax.jit(lambda x: cpu.qmatmul_many(x, dense))(x)):
        assert np.array_equal(_bits(y), _bits(cpu.qmatmul(x, w, lay))), lay.qtype.name
    experts = [weight("Q4_K", (5, 48, 512)), weight("Q5_0", (5, 32, 512))]
    ids = jnp.asarray(rng.integers(-1, 5, m), jnp.int32)
    for (w, lay), y in zip(experts, cpu.expert_matmul_many(x, ids, experts)):
        assert np.array_equal(_bits(y), _bits(cpu.expert_matmul(x, w, ids, lay))), lay.qtype.name
