"""--cpu-math int8|exact (issue 33, item 4): the arithmetic of the C++ CPU kernels' products,
carried as data.

The math is part of the backend's name ("cpu" = int8, "cpu-exact" = exact): EngineConfig.cpu_math
picks it, engine/choices.py resolves the backend, every program's RunOptions carries it, and
pallas_kernels passes it to the kernels (math="int8" | "exact"). Checked here: the config's refusal,
the names and their dispatch, an engine of each math on a tiny MoE (the kernels see the math asked
for; logits close across maths, bit-equal within one; stats and choices name the backend), and a
real server started with --cpu-math exact (answers, and GET /props names cpu-exact) and with
--cpu-math int9 (refused at start, naming the value).

Across maths the logits differ, within tolerances (8-bit activations move them a little); within one
math, bits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import cpu
from strata_jax.config import CPU_MATHS, ConfigError, EngineConfig
from strata_jax.engine import Engine
from strata_jax.serve.launch import ServerProcess

# a tiny MoE whose every product is a FAST type in blocks (Q4_0): attention, experts, shared-free
# qwen3moe
MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 64, "quant": "Q4_0"}
PRODUCTS = ("qmatmul", "qmatmul_many", "norm_qmatmul_many", "expert_matmul", "expert_matmul_many")

def test_a_math_outside_the_choices_is_refused_naming_it():
    with pytest.raises(ConfigError) as e:
        EngineConfig(cpu_math="int4")
    assert "cpu_math = 'int4'" in str(e.value) and "int8, exact" in str(e.value)
    assert EngineConfig().cpu_math == "int8"
    assert CPU_MATHS == cpu.MATHS          # the config's list is the kernels' own


def test_the_cpu_backends_and_their_maths():
    assert "cpu-exact" in pk.BACKENDS and pk.resolve_backend("cpu-exact") == "cpu-exact"
    assert (pk.is_cpu("cpu") and pk.is_cpu("cpu-exact") and not pk.is_cpu("xla")
            and not pk.is_cpu("interpret"))
    assert (pk.cpu_math("cpu"), pk.cpu_math("cpu-exact")) == ("int8", "exact")
    assert (pk.cpu_backend("int8"), pk.cpu_backend("exact")) == ("cpu", "cpu-exact")
    assert pk.expert_tile("cpu-exact") == pk.expert_tile("cpu")
    with pytest.raises(ValueError, match="'int4' is not one of int8, exact"):
        pk.cpu_backend("int4")
    with pytest.raises(ValueError, match="'xla' is not a cpu backend"):
        pk.cpu_math("xla")
    with pytest.raises(ValueError, match="unknown kernel backend 'cpu-int4'"):
        pk.is_cpu("cpu-int4")


@pytest.fixture
def maths_seen(monkeypatch):
    """Wraps the cpu module's product functions: each call's math is recorded, then the real kernel
    runs."""
    seen: list[tuple[str, str]] = []
    for name in PRODUCTS:
        real = getattr(cpu, name)

        def spy(*args, _real=real, _name=name, math="int8", **kw):
            seen.append((_name, math))
            return _real(*args, math=math, **kw)

        monkeypatch.setattr(cpu, name, spy)
    return seen


@pytest.mark.parametrize("backend, math", [("cpu", "int8"), ("cpu-exact", "exact")])
def test_every_product_passes_its_backends_math(maths_seen, backend, math):
    # built at install: its absence is a failure
    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(0)
    w = jnp.asarray(pk.random_blocks("Q4_0", (3, 48, 64), rng))       # 3 experts [48, 64]
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    ids = jnp.asarray([0, 2, 1, 2, 0], jnp.int32)
    outs = [pk.qmatmul(x, w[0], "Q4_0", backend),
            *pk.qmatmul_many(x, [(w[0], "Q4_0"), (w[1], "Q4_0")], backend),
            pk.norm_qmatmul_many(x, jnp.ones(64), 1e-6, [(w[2], "Q4_0")], backend)[1][0],
            pk.expert_matmul(x, w, ids, "Q4_0", backend),
            *pk.expert_matmul_many(x, ids, [(w, "Q4_0")], backend)]
    tiles = pk.expert_matmul_tiles(jnp.repeat(x[:1], pk.expert_tile(backend), 0),
                                   jnp.asarray([1], jnp.int32), w, "Q4_0", backend)
    assert all(bool(jnp.isfinite(o).all()) for o in [*outs, tiles])
    assert ({n for n, _ in maths_seen} == set(PRODUCTS)
            and {m for _, m in maths_seen} == {math}), maths_seen
    with pytest.raises(ValueError, match="'xla' is not a cpu backend"):
        pk.norm_qmatmul_many(x, jnp.ones(64), 1e-6, [(w[2], "Q4_0")], "xla")


def _engine(path, **cfg) -> Engine:
    return Engine.from_gguf(path, EngineConfig(parallel=1, max_context=64, warmup=False, **cfg))


def test_an_engine_of_each_math(tiny_model, maths_seen):
    path = tiny_model(**MOE)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 500, 40)]
    got = {}
    for math, backend in (("exact", "cpu-exact"), ("int8", "cpu")):
        maths_seen.clear()
        cfg = {} if math == "int8" else {"cpu_math": "exact"}         # int8 is the default
        with _engine(path, **cfg) as eng:
            assert eng.stats()["backend"] == backend and eng.runner.choices["backend"] == backend
            assert eng.runner.opts.backend == backend and eng.runner.opts.host_backend == backend
            first, again = eng.logits(ids), eng.logits(ids)
        # the programs were traced with this math in every product the model has (norm and q, k, v;
        # experts)
        assert ({"norm_qmatmul_many", "expert_matmul_many", "expert_matmul"}
                <= {n for n, _ in maths_seen}), maths_seen
        assert {m for _, m in maths_seen} == {math}, maths_seen
        assert first.shape == (len(ids), 512) and np.isfinite(first).all()
        assert np.array_equal(first, again), f"{math}: two runs of the same tokens differ"
        got[math] = first
    # a fresh engine of the same math: the same bits
    with _engine(path, cpu_math="exact") as eng:
        assert np.array_equal(eng.logits(ids), got["exact"])
    exact, int8 = got["exact"], got["int8"]
    # different arithmetic (8-bit activations of Q4_0 products), so not the same bits: else the flag
    # did nothing. Measured on this model (AVX2): max |diff| 0.073 against max |logit| 4.6, mean
    # 0.010 against std 1.03, top-1 the same on 97.5% of 40 positions: the bounds below leave about
    # 5x room.
    assert not np.array_equal(int8, exact), "--cpu-math exact gave int8's bits"
    scale = float(exact.std())
    diff = np.abs(int8 - exact)
    agree = float(np.mean(exact.argmax(-1) == int8.argmax(-1)))
    assert agree >= 0.8, f"top-1 agrees on {agree:.0%} of positions"
    assert (diff.max() <= 0.1 * np.abs(exact).max()
            and diff.mean() <= 0.05 * scale), (diff.max(), diff.mean(), scale)


def test_a_server_with_exact_math_answers_and_names_its_backend(tiny_model):
    import httpx

    path = str(tiny_model(**MOE))
    with ServerProcess([path, "--cpu-math", "int9", "--parallel", "1"]) as bad:
        code = bad.proc.wait(timeout=120)
        log = bad.log()
    assert code != 0 and "Traceback" not in log, log
    assert "strata-jax serve: error: cpu_math = 'int9': must be one of int8, exact" in log, log

    args = [path, "--cpu-math", "exact", "--parallel", "1", "--max-context", "128", "--no-warmup"]
    with ServerProcess(args) as srv:
        srv.wait_ready(timeout=300)
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                "temperature": 0}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text[:2000]
        answer = r.json()
        assert (answer["choices"][0]["finish_reason"] in ("length", "stop")
                and answer["usage"]["completion_tokens"] >= 1)
        props = httpx.get(srv.url + "/props", timeout=30).json()
    assert props["backend"] == "cpu-exact", props
