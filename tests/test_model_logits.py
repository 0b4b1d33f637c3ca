"""Our forward pass against Hugging Face transformers on the same GGUF file.

Tolerance: both sides dequantize the same blocks to the same float32 weights (transformers uses the
gguf package's dequantize, which our kernels match bit for bit) and compute in float32; they differ
only in summation order and in exp/rsqrt/cos implementations, which moves logits by ~1e-6 relative
(measured: max 3.5e-5 on logits of size ~5). We allow 1e-4 relative to the largest logit: 3x that
measured error, and 10^4 below what any real mistake does (a wrong rope layout, a missing bias, an
unnormalized top-k weight all move logits by O(0.1..1)); `test_tolerance_catches_a_real_mistake`
shows one. That is the exact cpu math (`--cpu-math exact`).

The int8 cpu math (the default) quantizes every product's activations to 8 bits a block, as
llama.cpp does: its logits differ from the exact path's by that quantization (docs/BENCHMARKS.md's
accuracy table: mean KL ~4e-3 nats on SmolLM2 over 2,048 positions of text, top-1 ~96%, the same as
llama.cpp's against the exact path). Here, on random tiny models (flat distributions, near ties):
the mean KL of its next-token distribution from transformers' at most 0.05 nats (measured: <= 0.001
dense, up to 0.018 for qwen3moe IQ4_XS, where a router's near tie can pick another expert), and the
same top-1 token wherever transformers' first token leads its second by more than 2% of the largest
logit; a real mistake (the wrong rope above) moves logits by O(0.1..1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logit_checks import assert_int8_close

from strata_jax import Engine, EngineConfig
from strata_jax.testing.hf import load_hf_model

ARCHS = ["llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe"]
QUANTS = ["F32", "Q8_0", "Q4_K", "IQ4_XS"]
# Rows of 256 values: a whole number of K-quant and IQ4_XS super-blocks.
SIZES = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 256, "expert_ffn": 256,
             "shared_ffn": 256, "experts": 4, "experts_used": 2}


def _hf_logits(path, ids):
    model = load_hf_model(path)
    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def _ours(path, ids, weights="dequantized", math="exact"):
    eng = Engine.from_gguf(path, EngineConfig(max_context=64, weights=weights, cpu_math=math))
    try:
        return eng.logits(ids)
    finally:
        eng.close()


def _ids(vocab, n=32, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_model, arch, quant):
    """The exact cpu math to float32 rounding; then, for the quantized types (float weights are
    always exact), the int8 math within its quantization."""
    opts = dict(SIZES, arch=arch, quant=quant)
    if not arch.endswith("moe"):
        opts["experts"] = 0
    path = tiny_model(**opts)
    ids = _ids(512)
    ref = _hf_logits(path, ids)
    # Weights as blocks through the kernels for the quantized types, dequantized at load for F32.
    ours = _ours(path, ids, weights="blocks" if quant != "F32" else "dequantized")
    assert ours.shape == ref.shape == (32, 512)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    if quant == "F32":
        return
    # packed
    assert_int8_close(ref, _ours(path, ids, weights="auto", math="int8"), ours, f"{arch} {quant}")


def test_blocks_and_dequantized_weights_agree(tiny_model):
    path = tiny_model(**SIZES, arch="qwen3moe", quant="Q4_K")
    ids = _ids(512, seed=1)
    a, b = _ours(path, ids, "blocks"), _ours(path, ids, "dequantized")       # the exact cpu math
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(a).max())


def test_tolerance_catches_a_real_mistake(tiny_model, monkeypatch):
    """The comparison above can fail: rotating the wrong pairs (llama's layout on a Qwen model) is
    caught."""
    from strata_jax.gguf import ModelSpec

    path = tiny_model(**dict(SIZES, experts=0), arch="qwen3", quant="Q8_0")
    ids = _ids(512)
    ref = _hf_logits(path, ids)
    real = ModelSpec.from_metadata.__func__

    def wrong_rope(cls, *a, **k):
        import dataclasses
        return dataclasses.replace(real(cls, *a, **k), rope_type="norm")

    monkeypatch.setattr(ModelSpec, "from_metadata", classmethod(wrong_rope))
    ours = _ours(path, ids)
    assert np.abs(ours - ref).max() > 1e-2 * np.abs(ref).max()
