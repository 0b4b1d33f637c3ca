"""A model whose experts are MXFP4 (as gpt-oss stores its experts), made by `strata-jax make-model
--expert-quant MXFP4`: a tiny qwen3moe with F32 attention, router and embeddings, so that the
experts' type is the only quantized part.

- the exact cpu math and the xla backend read the MXFP4 blocks to the same float32 weights
  (tests/test_mxfp4.py: bit for bit) and agree on the logits to float32 rounding (1e-4 of the
  largest logit, test_model_logits.py's tolerance) and on the greedy tokens;
- transformers (which dequantizes with gguf.quants) is the oracle for both, with the same tolerance;
- the int8 math (the default, what the server runs) is within its quantization of transformers
  (logit_checks.assert_int8_close).
tests/test_llamacpp.py runs llama.cpp on the same file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logit_checks import assert_int8_close

from strata_jax import Engine, EngineConfig
from strata_jax.testing.hf import load_hf_model

MXFP4_MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2,
             "expert_ffn": 128, "experts": 4, "experts_used": 2, "quant": "F32",
             "expert_quant": "MXFP4"}


def _ids(n=32, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


@pytest.fixture(scope="module")
def runs(tiny_model):
    """{(backend, math): (logits of _ids(), 8 greedy tokens after them)}, and transformers'
    logits."""
    path = tiny_model(**MXFP4_MOE)
    ids, out = _ids(), {}
    for backend, math, weights in (("cpu", "exact", "blocks"), ("cpu", "int8", "auto"),
                                   ("xla", "exact", "blocks")):
        with Engine.from_gguf(path, EngineConfig(max_context=64, backend=backend, cpu_math=math,
                                                 weights=weights, warmup=False)) as eng:
            experts = eng.runner.params["layers"][0].experts
            # GGUF blocks read by the kernels; the int8 math's default packs them (packed.h)
            want = "MXFP4+packed" if weights == "auto" else "MXFP4"
            assert {experts[k].qtype for k in ("exp_gate", "exp_up", "exp_down")} == {want}
            out[backend, math] = (eng.logits(ids),
                                  eng.generate(ids, max_tokens=8, ignore_eos=True).tokens)
    with torch.no_grad():
        hf = load_hf_model(path)(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()
    return out, hf


def test_cpu_and_xla_read_mxfp4_experts_alike(runs):
    out, _ = runs
    (cpu, cpu_tokens), (xla, xla_tokens) = out["cpu", "exact"], out["xla", "exact"]
    assert cpu.shape == (32, 512)
    np.testing.assert_allclose(cpu, xla, rtol=0, atol=1e-4 * np.abs(xla).max())
    assert (cpu.argmax(-1) == xla.argmax(-1)).all()
    assert cpu_tokens == xla_tokens and len(cpu_tokens) == 8


def test_mxfp4_experts_match_transformers(runs):
    out, hf = runs
    for key in (("cpu", "exact"), ("xla", "exact")):
        ours = out[key][0]
        np.testing.assert_allclose(ours, hf, rtol=0, atol=1e-4 * np.abs(hf).max(), err_msg=key)
        assert (ours.argmax(-1) == hf.argmax(-1)).all(), key


def test_the_int8_math_on_mxfp4_experts(runs):
    out, hf = runs
    assert_int8_close(hf, out["cpu", "int8"][0], out["cpu", "exact"][0], "qwen3moe MXFP4 experts")
    # (its greedy tokens may leave the exact ones at a near tie of this random model: not compared)
    assert len(out["cpu", "int8"][1]) == 8
