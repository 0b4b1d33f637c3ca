"""Weights packed at load (pallas_kernels/cpu/packed.h): 8 rows' blocks side by side for the int8
products.

- the packed kernel gives the bits of the same matrix in GGUF blocks, for every packed type, every M
  (the decode sizes and prefill), rows past the last whole tile of 8, units of work cut anywhere,
  and in the calls of several weights at once;
- every ISA level this CPU runs gives those bits too (a fresh process each, as pip built them);
- packing is a permutation of the bytes (the same multiset, same size), and a type without a layout,
  the exact math, the expert kernel and the other backends refuse a packed weight with an error that
  says so;
- the engine packs on the cpu backend's int8 math (weights auto), not on exact, and a served model
  answers with the same tokens packed or not (test_cpu_math checks the server end to end).
"""

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest
from isa_levels import outputs_by_level

import pallas_kernels as pk
from pallas_kernels import cpu
from pallas_kernels.layout import layout_for

PACKED = ["Q4_0", "Q4_1", "Q8_0", "IQ4_NL", "Q4_K", "MXFP4"]


def _blocks(qtype: str, n: int, k: int, seed: int = 5) -> np.ndarray:
    return pk.random_blocks(qtype, (n, k), np.random.default_rng(seed))


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", PACKED)
def test_a_packed_matrix_gives_the_bits_of_its_gguf_blocks(qtype):
    """Every M from decode (1..8) to prefill (9, 40), 37 and 1536 rows (a tile of 8 cut short; many
    units)."""
    rng = np.random.default_rng(1)
    shapes = (((37, 576), (1536, 224)) if pk.block_size(pk.as_qtype(qtype)) == 32
              else ((37, 512), (1536, 256)))
    for n, k in shapes:
        b = _blocks(qtype, n, k)
        p = pk.pack(b, qtype)
        assert p.shape == b.shape and p.dtype == np.uint8
        plain, packed = (layout_for(qtype, b.shape[1]),
                         layout_for(qtype + pk.PACKED_SUFFIX, b.shape[1]))
        assert packed.packed and not plain.packed and packed.qtype == plain.qtype
        for m in (1, 2, 5, 8, 9, 16, 17, 40):
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32) * 2)
            want = cpu.qmatmul(x, jnp.asarray(b), plain, math="int8")
            got = cpu.qmatmul(x, jnp.asarray(p), packed, math="int8")
            assert (_bits(got) == _bits(want)).all(), f"{qtype} n={n} k={k} M={m}"


def test_packing_moves_bytes_and_leaves_the_rows_past_the_last_tile():
    b = _blocks("Q4_1", 21, 576)
    p = pk.pack(b, "Q4_1")
    # the two whole tiles are rearranged
    assert not np.array_equal(p[:16], b[:16])
    assert np.array_equal(np.sort(p[:16], axis=None), np.sort(b[:16], axis=None))
    assert np.array_equal(p[16:], b[16:])                           # rows 16..20 stay GGUF rows
    # device_put takes it without a copy
    assert p.ctypes.data % 64 == 0


def test_several_packed_and_plain_weights_in_one_call_give_the_bits_of_separate_calls():
    """A decode step's norm + q, k, v call with packed weights beside a type without a packed layout
    (Q6_K)."""
    k = 512
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, k)).astype(np.float32))
    norm = jnp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, k).astype(np.float32))
    packed, plain = [], []
    for qtype, n in (("Q4_1", 576), ("Q8_0", 192), ("Q6_K", 64), ("Q4_K", 72), ("Q4_0", 1536)):
        b = _blocks(qtype, n, k)
        plain.append((jnp.asarray(b), qtype))
        packed.append((jnp.asarray(pk.pack(b, qtype)), qtype + pk.PACKED_SUFFIX) if pk.packs(qtype)
                      else plain[-1])
    hx, ys = pk.norm_qmatmul_many(x, norm, 1e-5, packed, backend="cpu")
    hx2, ys2 = pk.norm_qmatmul_many(x, norm, 1e-5, plain, backend="cpu")
    assert (_bits(hx) == _bits(hx2)).all()
    for y, y2 in zip(ys, ys2):
        assert (_bits(y) == _bits(y2)).all()
    for y, y2 in zip(pk.qmatmul_many(x, packed, backend="cpu"),
                     pk.qmatmul_many(x, plain, backend="cpu")):
        assert (_bits(y) == _bits(y2)).all()


def test_packed_experts_give_the_bits_of_their_gguf_blocks():
    """Every expert resident (--expert-cache auto, all fit): each expert packed alone, read in place
    by the expert kernel, rows of several experts and of none (-1) in one call, gate and up
    together."""
    E, n, k = 4, 44, 576
    rng = np.random.default_rng(9)
    gate, up = (_blocks("Q4_1", E * n, k, 1).reshape(E, n, -1),
                _blocks("Q8_0", E * n, k, 2).reshape(E, n, -1))
    pg, pu = pk.pack(gate, "Q4_1"), pk.pack(up, "Q8_0")
    assert np.array_equal(pg[1], pk.pack(gate[1], "Q4_1"))          # experts packed one by one
    ids = jnp.asarray(np.array([2, 0, -1, 2, 3, 1, 1, 0, 2, 3, 3], np.int32))
    x = jnp.asarray(rng.standard_normal((11, k)).astype(np.float32))
    want = pk.expert_matmul_many(x, ids, [(jnp.asarray(gate), "Q4_1"), (jnp.asarray(up), "Q8_0")],
                                 backend="cpu")
    got = pk.expert_matmul_many(x, ids, [(jnp.asarray(pg), "Q4_1" + pk.PACKED_SUFFIX),
                                         (jnp.asarray(pu), "Q8_0" + pk.PACKED_SUFFIX)],
                                backend="cpu")
    for y, y2 in zip(got, want):
        assert (_bits(y) == _bits(y2)).all()
    one = pk.expert_matmul(x[:1], jnp.asarray(pg), ids[:1], "Q4_1" + pk.PACKED_SUFFIX,
                           backend="cpu")
    assert (_bits(one) == _bits(want[0][:1])).all()
    # a super-block type, decode and prefill sizes
    k4 = _blocks("Q4_K", E * n, 512, 3).reshape(E, n, -1)
    x4 = jnp.asarray(rng.standard_normal((11, 512)).astype(np.float32))
    for rows in (slice(0, 3), slice(0, 11)):
        plain = pk.expert_matmul(x4[rows], jnp.asarray(k4), ids[rows], "Q4_K", backend="cpu")
        packed = pk.expert_matmul(x4[rows], jnp.asarray(pk.pack(k4, "Q4_K")), ids[rows],
                                  "Q4_K" + pk.PACKED_SUFFIX, backend="cpu")
        assert (_bits(packed) == _bits(plain)).all()


def test_an_expert_call_over_two_sources_gives_each_row_the_bits_of_its_source_alone():
    """The one-program window with host experts (model/stages.py, tiered_experts_stage): an expert
    cache's slots (packed) and every expert's GGUF blocks (the host tier) in one call, ids over both
    in order (slot s, or slots + expert e); each row gets the bits of a call on the source that
    holds its expert, -1 zeros. The same with both sources GGUF blocks on the exact math."""
    E, S, n, k = 6, 2, 44, 576
    rng = np.random.default_rng(11)
    gate, down = (_blocks("Q4_1", E * n, k, 4).reshape(E, n, -1),
                  _blocks("Q4_0", E * n, k, 5).reshape(E, n, -1))
    held = [4, 1]                                                   # slot s holds expert held[s]
    x = jnp.asarray(rng.standard_normal((9, k)).astype(np.float32))
    where = np.array([0, S + 2, 1, -1, S + 4, 0, S + 0, S + 5, 1], np.int32)
    for backend, suffix, slots_of in (("cpu", pk.PACKED_SUFFIX, lambda w, q: pk.pack(w[held], q)),
                                      ("cpu-exact", "", lambda w, q: w[held])):
        weights = [[(jnp.asarray(slots_of(w, q)), q + suffix), (jnp.asarray(w), q)]
                   for w, q in ((gate, "Q4_1"), (down, "Q4_0"))]
        got = pk.expert_matmul_sources(x, jnp.asarray(where), weights, backend=backend)
        for y, (w, q) in zip(got, ((gate, "Q4_1"), (down, "Q4_0"))):
            experts = np.where(where < 0, -1, np.where(
                where < S, np.array(held)[np.clip(where, 0, S - 1)], where - S))
            alone = pk.expert_matmul(x, jnp.asarray(w), jnp.asarray(experts.astype(np.int32)), q,
                                     backend=backend)
            assert (_bits(y) == _bits(alone)).all()
            assert not np.asarray(y)[where < 0].any() and np.asarray(y)[where >= 0].any()
    with pytest.raises(ValueError, match=r"E_s = \[2, 6\]"):
        pk.expert_matmul_sources(x, jnp.asarray(where),
                                 [[(jnp.asarray(gate[held]), "Q4_1"), (jnp.asarray(gate), "Q4_1")],
                                                         [(jnp.asarray(down), "Q4_0"),
                                                          (jnp.asarray(down), "Q4_0")]])


def test_what_cannot_read_a_packed_weight_says_so():
    b = _blocks("Q4_1", 16, 64)
    p = jnp.asarray(pk.pack(b, "Q4_1"))
    name = "Q4_1" + pk.PACKED_SUFFIX
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="int8 math only"):
        pk.qmatmul(x, p, name, backend="cpu-exact")
    with pytest.raises(ValueError, match="packed weights are read only by the cpu backend"):
        pk.qmatmul(x, p, name, backend="xla")
    with pytest.raises(ValueError, match="packed weights are read only by the cpu backend"):
        pk.dequantize(p, name)
    with pytest.raises(ValueError, match="Q6_K has no packed layout"):
        pk.pack(_blocks("Q6_K", 8, 256), "Q6_K")
    assert pk.packs("Q8_0") and pk.packs("Q4_K") and not pk.packs("Q6_K")


_HASH = r"""
import hashlib, jax.numpy as jnp, numpy as np, pallas_kernels as pk
from pallas_kernels import cpu
from pallas_kernels.layout import layout_for
out = []
for qtype in %r:
    k = 512
    b = pk.random_blocks(qtype, (45, k), np.random.default_rng(7))
    lay = layout_for(qtype + pk.PACKED_SUFFIX, b.shape[1])
    p = jnp.asarray(pk.pack(b, qtype))
    x = np.random.default_rng(8).standard_normal((20, k)).astype(np.float32)
    ys = [np.asarray(cpu.qmatmul(jnp.asarray(x[a:z]), p, lay, math="int8")) for a, z in ((0, 1), (1, 4), (4, 20), (0, 20))]
    out.append(hashlib.sha1(np.concatenate(ys).tobytes()).hexdigest())
print(" ".join(out))
"""  # noqa: E501


def test_every_isa_level_this_cpu_runs_reads_packed_weights_with_the_same_bits():
    hashes = outputs_by_level(_HASH % (PACKED,))
    first, *others = hashes
    for level in others:
        assert hashes[level] == hashes[first], f"{level} differs from {first}"
    assert (len(set(hashes[first])) == len(PACKED)
            and hashlib.sha1(b"").hexdigest() not in hashes[first])


# a tiny MoE whose every product is Q4_0 (packed): attention, the experts (all resident), the tied
# head
MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 64, "quant": "Q4_0"}


def test_an_engine_packs_on_int8_and_gives_the_logits_of_blocks(tiny_model):
    from strata_jax.config import ConfigError, EngineConfig
    from strata_jax.engine import Engine
    from strata_jax.model.weights import QTensor

    path = tiny_model(**MOE)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 500, 40)]
    got = {}
    for weights in ("auto", "blocks"):
        with Engine.from_gguf(path, EngineConfig(parallel=1, max_context=64, warmup=False,
                                                 weights=weights)) as eng:
            assert eng.stats()["pack"] == (weights == "auto") and eng.stats()["weights"] == "blocks"
            layer = eng.runner.params["layers"][0]
            names = {layer.wq.qtype, layer.experts["exp_gate"].qtype}
            assert names == ({"Q4_0+packed"} if weights == "auto" else {"Q4_0"}), names
            assert (isinstance(eng.runner.params["embed"], QTensor)
                    and eng.runner.params["embed"].qtype == "Q4_0")
            got[weights] = (eng.logits(ids),
                            eng.generate(ids[:8], max_tokens=6, temperature=0.0).tokens)
    assert np.array_equal(got["auto"][0], got["blocks"][0])         # the same bits, packed or not
    assert got["auto"][1] == got["blocks"][1]
    with Engine.from_gguf(path, EngineConfig(parallel=1, max_context=64, warmup=False,
                                             cpu_math="exact")) as eng:
        assert eng.stats()["pack"] is False                          # exact reads GGUF blocks
    with pytest.raises(ConfigError,
                       match="weights = packed: packed weights are read by the cpu backend's int8"):
        Engine.from_gguf(path, EngineConfig(parallel=1, max_context=64, warmup=False,
                                            cpu_math="exact", weights="packed"))


def test_releasing_file_pages_keeps_the_data_and_leaves_anonymous_memory_alone(tmp_path):
    from strata_jax.model.weights import release_file_pages

    data = np.random.default_rng(3).integers(0, 256, 3 * 65536, dtype=np.uint8)
    f = tmp_path / "blocks.bin"
    data.tofile(f)
    view = np.memmap(f, dtype=np.uint8, mode="r")[100:].reshape(-1, 4)[:40000]
    assert view.sum() > 0
    # unmapped from this process; read back from the page cache
    release_file_pages(view)
    assert np.array_equal(view.ravel(), data[100:100 + view.size])
    anon = data.copy()
    # not a file map: MADV_DONTNEED would zero it, so nothing happens
    release_file_pages(anon)
    assert np.array_equal(anon, data)


def test_auto_does_not_pack_a_model_that_would_take_half_the_free_ram(tiny_model, monkeypatch,
                                                                      caplog):
    """A model near or past the RAM's size keeps reading the file's pages; --weights packed still
    packs."""
    import logging

    from strata_jax.config import EngineConfig
    from strata_jax.engine import Engine, choices
    from strata_jax.gguf import GGUFModel

    path = tiny_model(**MOE)
    need = choices.packable_bytes(GGUFModel.open(path))
    assert need > 0
    monkeypatch.setattr(choices, "available_ram", lambda: 2 * need - 1)
    with caplog.at_level(logging.INFO, logger="strata_jax.engine"), \
            Engine.from_gguf(path, EngineConfig(parallel=1, max_context=64, warmup=False)) as eng:
        assert eng.stats()["pack"] is False
    assert "not packed: packing would copy" in caplog.text
    with Engine.from_gguf(path, EngineConfig(parallel=1, max_context=64, warmup=False,
                                             weights="packed")) as eng:
        assert eng.stats()["pack"] is True
