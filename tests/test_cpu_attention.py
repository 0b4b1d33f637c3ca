"""The cpu backend's attention kernel (pallas_kernels/cpu/attention.cc) against the xla path's
attend(), for each cache dtype; its bits independent of the other rows and of the window's shape;
and a lone decode row on the cpu backend (ModelRunner.min_rows = 1) giving the bits it gets among
other rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from isa_levels import outputs_by_level

from pallas_kernels import cpu
from strata_jax.config import EngineConfig
from strata_jax.engine.execute.layouts import GroupInput
from strata_jax.engine.execute.sampler import SamplingRows
from strata_jax.engine.runner import ModelRunner
from strata_jax.gguf.reader import GGUFModel
from strata_jax.model.layers import attend
from strata_jax.model.transformer import quantize_int8

LAYERS, SLOTS, POSITIONS, K, H = 3, 4, 201, 2, 6     # 201: 200 positions and the scratch one
ROWS_POS = [[10, 11, 12, 13, 14], [0, 1, -1, -1, -1], [150, 151, 152, 153, 199]]   # -1: padding
ROW_SLOTS = [2, 0, 3]


def _caches(dtype: str, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    kf = jnp.asarray(rng.normal(size=(LAYERS, SLOTS, POSITIONS, K, d)).astype(np.float32))
    vf = jnp.asarray(rng.normal(size=(LAYERS, SLOTS, POSITIONS, K, d)).astype(np.float32))
    if dtype == "int8":
        (k, ks), (v, vs) = quantize_int8(kf), quantize_int8(vf)
        return k, v, ks, vs
    cast = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    return kf.astype(cast), vf.astype(cast), None, None


def _reference(q, k, v, ks, vs, layer, slots, pos):
    """The xla path: the slots' first 200 positions gathered, dequantized, then attend()."""
    def read(c, s):
        x = c[layer, slots, :POSITIONS - 1].astype(jnp.float32)
        return x * s[layer, slots, :POSITIONS - 1][..., None] if s is not None else x
    return attend(q, read(k, ks), read(v, vs), pos, 40)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "int8"])
@pytest.mark.parametrize("d", [64, 40])          # 40: a head dim that is not a multiple of 16
def test_attention_matches_the_xla_path(dtype, d):
    k, v, ks, vs = _caches(dtype, d)
    q = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, H, d)).astype(np.float32))
    slots, pos = jnp.asarray(ROW_SLOTS, jnp.int32), jnp.asarray(ROWS_POS, jnp.int32)
    out = cpu.attention(q, k, v, 1, slots, pos, ks, vs)
    ref = _reference(q, k, v, ks, vs, 1, slots, pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-6)
    assert np.all(np.asarray(out)[1, 2:] == 0)                     # padding queries give zeros
    # a traced layer index inside jit: the same bits
    jitted = jax.jit(lambda q, lay: cpu.attention(q, k, v, lay, slots, pos, ks, vs))(q,
                                                                                     jnp.int32(1))
    assert np.array_equal(np.asarray(jitted), np.asarray(out))


def test_a_query_bits_depend_only_on_its_own_row_and_position():
    """Alone, in a batch, as a decode query (L = 1) or inside a prefill window: the same bits."""
    k, v, _, _ = _caches("f32", 64)
    q = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5, H, 64)).astype(np.float32))
    slots, pos = jnp.asarray(ROW_SLOTS, jnp.int32), jnp.asarray(ROWS_POS, jnp.int32)
    full = np.asarray(cpu.attention(q, k, v, 2, slots, pos))
    alone = np.asarray(cpu.attention(q[2:], k, v, 2, slots[2:], pos[2:]))
    assert np.array_equal(alone, full[2:])
    # each token as a one-token decode query
    for t in range(5):
        one = np.asarray(cpu.attention(q[2:, t:t + 1], k, v, 2, slots[2:], pos[2:, t:t + 1]))
        assert np.array_equal(one, full[2:, t:t + 1])


def test_a_row_split_over_threads_has_the_bits_it_has_in_a_full_window():
    """A lone decode row at a long position has its keys' tiles split over the threads, each tile's
    softmax kept and joined in position order afterwards; in a window of many rows each row's tiles
    are walked by one thread, joined as they come: the same bits (attention.cc: Attention::combine),
    with gpt-oss's sinks and window too."""
    rng = np.random.default_rng(6)
    slots_n, positions, kh, d = 12, 1001, 3, 64
    k = jnp.asarray(rng.normal(size=(2, slots_n, positions, kh, d)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(2, slots_n, positions, kh, d)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(slots_n, 1, 9, d)).astype(np.float32))
    slots = jnp.arange(slots_n, dtype=jnp.int32)
    sinks = jnp.asarray(rng.normal(size=9).astype(np.float32))
    # long positions, and short ones from 29 to 117 (from 270 (query head, key) pairs: split alone
    # since session 35; from 1,024 before)
    long_pos = jnp.asarray([[997 - 37 * r] for r in range(slots_n)], jnp.int32)
    for pos in (long_pos, jnp.asarray([[29 + 8 * r] for r in range(slots_n)], jnp.int32)):
        for extra in ({}, {"sinks": sinks, "window": 300}):
            # 12 rows: a thread a row; alone, a row's tiles are split over the threads
            full = np.asarray(cpu.attention(q, k, v, 1, slots, pos, **extra))
            for r in (0, 5, 11):
                alone = np.asarray(cpu.attention(q[r:r + 1], k, v, 1, slots[r:r + 1],
                                                 pos[r:r + 1], **extra))
                assert np.array_equal(alone, full[r:r + 1]), (r, int(pos[r, 0]), extra.keys())
    ref = attend(q, k[1, :, :1000], v[1, :, :1000], long_pos, 40)
    np.testing.assert_allclose(np.asarray(cpu.attention(q, k, v, 1, slots, long_pos)),
                               np.asarray(ref), rtol=2e-5, atol=2e-6)


_LEVEL_BITS = """
import hashlib
import jax.numpy as jnp, numpy as np
from pallas_kernels import cpu
from strata_jax.model.transformer import quantize_int8
rng = np.random.default_rng(7)
k = rng.normal(size=(2, 3, 401, 3, 64)).astype(np.float32)
v = rng.normal(size=(2, 3, 401, 3, 64)).astype(np.float32)
q = jnp.asarray(rng.normal(size=(3, 2, 9, 64)).astype(np.float32))
slots = jnp.asarray([2, 0, 1], jnp.int32)
pos = jnp.asarray([[390, 391], [5, 6], [200, -1]], jnp.int32)
(k8, ks), (v8, vs) = quantize_int8(jnp.asarray(k)), quantize_int8(jnp.asarray(v))
outs = [cpu.attention(q, jnp.asarray(k).astype(t), jnp.asarray(v).astype(t), 1, slots, pos)
        for t in (jnp.float32, jnp.float16, jnp.bfloat16)]
outs.append(cpu.attention(q, k8, v8, 1, slots, pos, ks, vs))
outs.append(cpu.attention(q, jnp.asarray(k), jnp.asarray(v), 0, slots, pos,
                          sinks=jnp.linspace(-1, 1, 9, dtype=jnp.float32), window=128))
outs.append(cpu.attention(q[:1, :1], jnp.asarray(k), jnp.asarray(v), 1, slots[:1], pos[:1, :1]))
print(*(hashlib.sha1(np.asarray(o).tobytes()).hexdigest() for o in outs))
"""


def test_every_isa_level_gives_the_same_attention_bits():
    """The kernel's exponential (simd.h exp1 / exp8) and sums are fixed sequences of operations:
    float32, float16, bfloat16 and int8 caches, gpt-oss's sinks and window, and a lone row split
    over the threads give the same bits on every level this CPU runs."""
    got = outputs_by_level(_LEVEL_BITS)
    first = next(iter(got.values()))
    assert len(first) == 6
    assert all(words == first for words in got.values()), got


def test_nan_keys_give_nan_not_a_finite_answer():
    k, v, _, _ = _caches("f32", 64)
    k = k.at[1, 0, 0].set(jnp.nan)                                  # slot 0's first key, layer 1
    q = jnp.ones((1, 1, H, 64), jnp.float32)
    out = cpu.attention(q, k, v, 1, jnp.asarray([0], jnp.int32), jnp.asarray([[5]], jnp.int32))
    assert np.all(np.isnan(np.asarray(out)))


def test_out_of_range_layer_and_slot_are_errors_that_name_them():
    k, v, _, _ = _caches("f32", 64)
    q = jnp.ones((1, 1, H, 64), jnp.float32)
    with pytest.raises(Exception, match="layer 3 outside"):
        jax.block_until_ready(cpu.attention(q, k, v, 3, jnp.asarray([0], jnp.int32),
                                            jnp.asarray([[1]], jnp.int32)))
    with pytest.raises(Exception, match="slot 7 outside"):
        jax.block_until_ready(cpu.attention(q, k, v, 0, jnp.asarray([7], jnp.int32),
                                            jnp.asarray([[1]], jnp.int32)))


MODELS = {
    "dense": {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96},
    "moe": {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
            "experts_used": 2, "expert_ffn": 32},
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_lone_decode_row_runs_alone_with_the_bits_it_has_among_others(tiny_model, family):
    runner = ModelRunner(GGUFModel.open(tiny_model(**MODELS[family])),
                         EngineConfig(parallel=4, max_context=64))
    assert runner.choices["backend"] == "cpu" and runner.min_rows == 1

    def logits(tokens, positions, slots):
        g = GroupInput(np.asarray(tokens, np.int32)[:, None],
                       np.asarray(positions, np.int32)[:, None],
                       np.asarray(slots, np.int32), SamplingRows.greedy(len(slots)))
        return np.asarray(runner.forward_logits([g], max(positions) + 1)[0])

    rng = np.random.default_rng(3)
    # a few keys in each slot's cache
    for slot in range(3):
        for p in range(6):
            logits([int(rng.integers(3, 200))], [p], [slot])
    alone = logits([17], [6], [1])                                  # [1, V]: a window of one row
    together = logits([5, 17, 9], [6, 6, 6], [0, 1, 2])             # the same row among others
    assert alone.shape[0] == 1
    assert np.array_equal(alone[0], together[1])


def test_greedy_rows_on_the_host_are_the_samplers_answer():
    """sampler.greedy_on_host (all-greedy windows skip the sample program) against
    sampler.sample."""
    from strata_jax.engine.execute.sampler import greedy_on_host, sample

    rng = np.random.default_rng(4)
    lg = rng.normal(size=(5, 300)).astype(np.float32)
    # a tie: the first index, as argmax
    lg[1, 7] = lg[1, 9] = 50.0
    lg[2, 3] = np.nan
    lg[3, 5] = np.inf
    s = SamplingRows.greedy(5)
    want = np.asarray(jax.jit(sample)(jnp.asarray(lg), *s.as_tuple()))
    got = greedy_on_host(lg)
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert list(got[1:4]) == [7, -1, -1]


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_parts_in_position_order_give_the_bits_of_one_call(dtype):
    """--kv-resident's way: the device part [0, 32), then host blocks of 48 positions handed over as
    their own arrays, the softmax state carried: the same bits as one call over the whole cache."""
    k, v, ks, vs = _caches(dtype, 64)
    q = jnp.asarray(np.random.default_rng(5).normal(size=(3, 5, H, 64)).astype(np.float32))
    slots, pos = jnp.asarray(ROW_SLOTS, jnp.int32), jnp.asarray(ROWS_POS, jnp.int32)
    whole = np.asarray(cpu.attention(q, k, v, 1, slots, pos, ks, vs))
    out, state = cpu.attention_part(q, k, v, 1, slots, pos, (0, 0, 32), None, ks, vs)
    rows = jnp.arange(3, dtype=jnp.int32)
    # a host block as a dequantized float array
    def block(c, s, b0):
        x = c[1, slots, b0:b0 + 48].astype(jnp.float32)
        return (x * s[1, slots, b0:b0 + 48][..., None] if s is not None else x)[None]

    for b0 in range(32, POSITIONS - 1, 48):
        out, state = cpu.attention_part(q, block(k, ks, b0), block(v, vs, b0), 0, rows, pos,
                                        (b0, b0, b0 + 48), state)
    assert np.array_equal(np.asarray(out), whole)
    with pytest.raises(Exception, match="multiple of 16"):
        jax.block_until_ready(cpu.attention_part(q, k, v, 1, slots, pos, (0, 8, 32), None,
                                                 ks, vs)[0])
