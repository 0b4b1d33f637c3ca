"""GLM-4.5 (glm4moe): made models against transformers' Glm4MoeForCausalLM and MtpModel, and
llama.cpp.

transformers has no GGUF loader for glm4moe: strata_jax.testing.hf_glm4moe builds its model from the
metadata and loads the dequantized GGUF tensors by name. Tolerance as in test_model_logits.py: 1e-4
of the largest logit (measured ~1e-6: both sides compute in float32 on the same float32 weights); a
missing selection bias moves logits far beyond it (test_selection_bias_is_needed).
"""

from __future__ import annotations

import importlib.util
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from logit_checks import assert_int8_close

from strata_jax import Engine, EngineConfig
from strata_jax.gguf import GGUFModel
from strata_jax.makers.make_model import make_model
from strata_jax.model import (
    Group,
    RunOptions,
    forward,
    load_params,
    mtp_forward,
    new_kv_cache,
)
from strata_jax.testing.hf_glm4moe import load_glm4moe

# Rows of 256 values (whole K-quant blocks); one leading dense layer, one MoE layer, one NextN
# layer.
SIZES = {"arch": "glm4moe", "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 256,
             "expert_ffn": 256, "shared_ffn": 256, "experts": 4, "experts_used": 2, "nextn": 1}
VARIANTS = {
    "F32": {"quant": "F32"},
    # GLM-4.5 355B's q/k norms, and a NextN layer with its own embedding and head.
    "Q4_K-qknorm-ownhead": {"quant": "Q4_K", "qk_norm": True, "nextn_head": True},
}
TOL = 1e-4


@pytest.fixture(scope="module")
def glm(tiny_model):
    """variant -> (path, transformers model, transformers MtpModel), made once."""
    made = {}

    def get(variant: str):
        if variant not in made:
            path = tiny_model(**SIZES, **VARIANTS[variant])
            made[variant] = (path, *load_glm4moe(path, with_mtp=True))
        return made[variant]

    return get


def _ids(n=32, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


def _ours(path, ids, weights="dequantized", math="exact"):
    with Engine.from_gguf(path, EngineConfig(max_context=64, weights=weights, warmup=False,
                                             cpu_math=math)) as eng:
        return eng.logits(ids)


def _hf(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_spec_reads_glm4moe_as_llamacpp_does(tiny_model):
    spec = GGUFModel.open(tiny_model(**SIZES, **VARIANTS["F32"])).spec
    assert spec.n_layers == 2 and spec.n_nextn == 1          # block_count 3 = 2 main + 1 NextN
    assert spec.moe_layers == (1,) and spec.dense_layers == (0,)
    assert spec.expert_gating == "sigmoid" and spec.expert_bias and spec.expert_weights_norm
    # expert_shared_count 1 x expert_ffn
    assert spec.expert_weights_scale == 2.5 and spec.shared_ffn == 256
    assert spec.rope_dims == 32 and spec.head_dim == 64 and spec.rope_type == "neox"
    assert spec.attn_bias and not spec.qk_norm
    assert spec.ffn_norm_tensor == "post_attention_norm.weight"
    # the NextN layer's KV after the main ones
    assert new_kv_cache(spec, 2, 16, jnp.float32)["k"].shape[0] == 3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(glm, variant):
    path, model, _ = glm(variant)
    ids = _ids()
    ref = _hf(model, ids)
    ours = _ours(path, ids, weights="dequantized" if variant == "F32" else "blocks")
    assert ours.shape == ref.shape == (32, 512)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL * np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # the int8 cpu math (the default) within its quantization
    if variant != "F32":
        # packed
        assert_int8_close(ref, _ours(path, ids, weights="auto", math="int8"), ours, variant)


def test_selection_bias_is_needed(glm):
    """Without exp_probs_b (choosing by the plain sigmoid scores) transformers' logits move far past
    TOL."""
    path, model, _ = glm("F32")
    ids = _ids()
    ours = _ours(path, ids)
    gate = model.model.layers[1].mlp.gate
    saved = gate.e_score_correction_bias.clone()
    try:
        gate.e_score_correction_bias.zero_()
        assert np.abs(ours - _hf(model, ids)).max() > 100 * TOL * np.abs(ours).max()
    finally:
        gate.e_score_correction_bias.copy_(saved)


def test_logits_match_llamacpp(glm):
    # not imported here: llamacpp_logits runs it in a child
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from test_llamacpp import llamacpp_logits

    path, _, _ = glm("F32")
    ids = _ids()
    # llama.cpp skips the NextN block in its forward pass, as we do
    ref = llamacpp_logits(path, ids)
    ours = _ours(path, ids)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL * np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@partial(jax.jit, static_argnums=(1, 2, 6))
def _main(params, spec, opts, tokens, pos, slots, kv_len, cache):
    res = forward(params, spec, opts, (Group(tokens, pos, slots, all_logits=True),), cache, kv_len,
                  with_hidden=True)
    return res.hiddens[0], res.cache


_mtp = jax.jit(mtp_forward, static_argnums=(1, 2, 8))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_matches_transformers(glm, variant):
    """mtp_forward against transformers' MtpModel layer (Glm4MoeDecoderLayer, enorm/hnorm/eh_proj,
    shared head), fed the same GGUF weights: over a prompt in two calls (the second reads the
    first's KV from the cache), then one chained draft step on its own hidden_out, in a batch of 2
    rows (the other padded)."""
    path, model, mtp = glm(variant)
    gguf = GGUFModel.open(path)
    spec = gguf.spec
    params = load_params(gguf, "dequantized", "float32")
    opts = RunOptions(attn_chunk=32)
    T, kv = 12, 32
    ids = np.asarray(_ids(T), np.int32)
    slots = jnp.array([1, 0], jnp.int32)
    cache = new_kv_cache(spec, 2, kv, jnp.float32)

    def rows(x, pad):  # row 0: x; row 1: padding (another slot, pos -1)
        return jnp.asarray(np.stack([x, np.full_like(x, pad)]))

    pos = np.arange(T, dtype=np.int32)
    hid, cache = _main(params, spec, opts, rows(ids, 0), rows(pos, -1), slots, kv, cache)
    hid = hid[:1]                                                                    # [1, T, h]
    with torch.no_grad():
        # after the final norm
        h_ref = model.model(torch.tensor(ids[None].astype(np.int64))).last_hidden_state
        np.testing.assert_allclose(np.asarray(hid), h_ref.numpy(), rtol=0,
                                   atol=1e-4 * h_ref.abs().max().item())
        out_ref = mtp.forward_layer(0, h_ref[:, :T - 1], torch.arange(T - 1)[None], None,
                                    input_ids=torch.tensor(ids[None, 1:].astype(np.int64)))
        logits_ref = mtp._project_to_logits(out_ref)[0].numpy()                       # [T-1, V]

    def step(h, toks, at, cache):  # our MTP layer over positions `at`, row 1 padding
        h2 = jnp.concatenate([h, jnp.zeros_like(h)])
        return _mtp(params, spec, opts, h2, rows(toks, 0), rows(at, -1), slots, cache, kv)

    # positions 0..T-3
    l1, _, cache = step(hid[:, :T - 2], ids[1:T - 1], pos[:T - 2], cache)
    # T-2, from the cache
    l2, o2, cache = step(hid[:, T - 2:T - 1], ids[T - 1:], pos[T - 2:T - 1], cache)
    ours = np.concatenate([np.asarray(l1[0]), np.asarray(l2[0])])
    assert ours.shape == logits_ref.shape == (T - 1, 512)
    np.testing.assert_allclose(ours, logits_ref, rtol=0, atol=TOL * np.abs(logits_ref).max())
    np.testing.assert_allclose(np.asarray(o2[0, 0]), out_ref[0, -1].numpy(), rtol=0, atol=1e-4)

    # A chained draft: the token just drafted at position T-1, on the layer's own hidden_out.
    draft = int(ours[-1].argmax())
    l3, _, cache = step(o2[:1], np.array([draft], np.int32), np.array([T - 1], np.int32), cache)
    with torch.no_grad():
        seq = torch.cat([h_ref[:, :T - 1], out_ref[:, -1:]], dim=1)
        toks = torch.tensor(np.append(ids[1:], draft)[None].astype(np.int64))
        ref3 = mtp._project_to_logits(mtp.forward_layer(0, seq, torch.arange(T)[None], None,
                                                        input_ids=toks))
    ref3 = ref3[0, -1].numpy()
    np.testing.assert_allclose(np.asarray(l3[0, 0]), ref3, rtol=0, atol=TOL * np.abs(ref3).max())


def test_mtp_uses_its_own_head_when_the_file_has_one(glm, tiny_model):
    """The NextN block's embed_tokens / shared_head_head are loaded when present, else the main
    model's."""
    own = load_params(GGUFModel.open(glm("Q4_K-qknorm-ownhead")[0]), "dequantized", "float32")
    shared = load_params(GGUFModel.open(glm("F32")[0]), "dequantized", "float32")
    assert own["mtp"]["embed"] is not own["embed"] and own["mtp"]["head"] is not own["output"]
    assert not np.array_equal(np.asarray(own["mtp"]["embed"]), np.asarray(own["embed"]))
    assert shared["mtp"]["embed"] is shared["embed"] and shared["mtp"]["head"] is shared["output"]
    assert ("mtp" not in load_params(GGUFModel.open(tiny_model(**dict(SIZES, nextn=0))),
                                     "dequantized", "float32"))


@pytest.mark.parametrize("options, message", [
    ({"arch": "qwen3moe", "nextn": 1}, "--nextn is for --arch glm4moe"),
    ({"arch": "glm4moe", "leading_dense": 2, "layers": 2}, "--leading-dense must be 0..1"),
    ({"arch": "glm4moe", "shared_ffn": 48, "expert_ffn": 32},
     "must be a multiple of --expert-ffn 32"),
    ({"arch": "glm4moe", "nextn_head": True}, "--nextn-head needs --nextn 1"),
    ({"arch": "glm4moe", "rope_dims": 3}, "--rope-dims must be even"),
])
def test_bad_glm_options_say_what_is_wrong(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "x.gguf", **options)


def test_mtp_forward_without_a_nextn_layer_says_so(tiny_model):
    gguf = GGUFModel.open(tiny_model(**dict(SIZES, nextn=0)))
    params = load_params(gguf, "dequantized", "float32")
    z = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="no NextN \\(MTP\\) layer"):
        mtp_forward(params, gguf.spec, RunOptions(), jnp.zeros((1, 1, 256)), z, z,
                    jnp.zeros((1,), jnp.int32), {}, 32)
