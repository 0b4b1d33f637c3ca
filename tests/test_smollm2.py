"""The default model, SmolLM2-135M-Instruct (a real llama GGUF from PyPI), and its upcycled MoE
twin."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.fetch import smollm2_path
from strata_jax.gguf import GGUFModel
from strata_jax.makers.upcycle import upcycle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2():
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_moe(smollm2, tmp_path_factory):
    return upcycle(smollm2, tmp_path_factory.mktemp("upcycled") / "smollm2-8x2.gguf", experts=8,
                   top_k=2)


# The exact cpu math: these tests check the model itself (its answer, the twin's sameness to float
# rounding). On the int8 math (the default) "What is the capital of France?" starts "L'Étoile, ...":
# the exact logits put "The" over "L" by only 0.08, and llama.cpp's own 8-bit activations choose "L"
# too (by 0.06); a one-word question answers Paris on int8 (tests/test_server_smollm2.py), and
# int8's accuracy is measured against llama.cpp's over 2,048 positions (docs/BENCHMARKS.md).
# Quantization is discontinuous, so the twin and the dense model differ on int8 by int8's own noise,
# not by rounding.
@pytest.fixture(scope="session")
def smollm2_engine(smollm2):
    eng = Engine.from_gguf(smollm2, EngineConfig(parallel=2, max_context=256, cpu_math="exact"))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def smollm2_moe_engine(smollm2_moe):
    eng = Engine.from_gguf(smollm2_moe, EngineConfig(parallel=2, max_context=256, cpu_math="exact"))
    yield eng
    eng.close()


def test_capital_of_france(smollm2_engine):
    out = smollm2_engine.generate(QUESTION, max_tokens=24)
    assert "Paris" in out.text, out.text
    assert out.stats["prompt_tokens"] > 10 and out.stats["generated_tokens"] >= 3


def test_upcycled_twin_answers_the_same(smollm2_engine, smollm2_moe_engine):
    spec = smollm2_moe_engine.spec
    assert (spec.n_experts, spec.n_experts_used, spec.expert_weights_norm) == (8, 2, True)
    dense = smollm2_engine.generate(QUESTION, max_tokens=24)
    moe = smollm2_moe_engine.generate(QUESTION, max_tokens=24)
    assert "Paris" in moe.text
    assert moe.tokens == dense.tokens


def test_upcycled_logits_equal_dense(smollm2_engine, smollm2_moe_engine):
    """sum_k w_k * FFN(x) with sum_k w_k = 1 is FFN(x): the twins differ by float rounding only (the
    two renormalized weights sum to 1 within 1 ulp; measured 6e-5 on logits of size 30)."""
    ids = smollm2_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:32]
    a, b = smollm2_engine.logits(ids), smollm2_moe_engine.logits(ids)
    assert a.shape == b.shape == (len(ids), 49152)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_upcycle_keeps_expert_blocks(smollm2, smollm2_moe):
    dense, moe = GGUFModel.open(smollm2), GGUFModel.open(smollm2_moe)
    up = dense.tensors["blk.3.ffn_up.weight"]
    exps = moe.tensors["blk.3.ffn_up_exps.weight"]
    assert exps.qtype == up.qtype and exps.shape == (8, *up.shape)
    assert all(np.array_equal(exps.data[e], up.data) for e in range(8))
    assert moe.tensors["blk.3.ffn_gate_inp.weight"].shape == (8, dense.spec.hidden)


def test_cli_fetch_model_prints_the_path(smollm2):
    out = subprocess.run([sys.executable, "-m", "strata_jax", "fetch-model", "smollm2"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(smollm2)


def test_cli_upcycle_refuses_a_moe_model(smollm2_moe, tmp_path):
    out = subprocess.run([sys.executable, "-m", "strata_jax", "upcycle", str(smollm2_moe),
                          str(tmp_path / "x.gguf")],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 1 and "dense llama model" in out.stderr
