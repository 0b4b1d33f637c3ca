"""The hybrid Gated DeltaNet + MoE families (qwen3next, qwen35moe) run: issue 34's forward pass.

Oracles: transformers' Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM on the same weights
(strata_jax.testing.hf_hybrid undoes the converter's changes), and llama.cpp
(tests/test_llamacpp.py's child process) on the same file. Tolerance as in test_model_logits.py:
1e-4 of the largest logit (measured ~1e-5: float32 on both sides). The two forms of the delta rule
(deltanet.recurrent, a token at a time, and deltanet.chunked, 64 at a time) against each other with
a non-zero starting state, at the lengths where a chunk boundary could go wrong (llama.cpp's and
transformers' own pitfalls: families-spec.md 1.9).
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from logit_checks import mean_kl
from test_hybrid_read import (
    HYBRID,  # the same made files (tiny_model caches them by options)
)

from strata_jax import Engine, EngineConfig
from strata_jax.config import ConfigError
from strata_jax.gguf import GGUFModel
from strata_jax.model import (
    Group,
    RunOptions,
    deltanet,
    forward,
    load_params,
    new_kv_cache,
)
from strata_jax.testing.hf_hybrid import load_hybrid

ARCHS = ["qwen3next", "qwen35moe"]
TOL = 1e-4
INT8_KL = 0.1


@pytest.fixture(scope="module")
def hybrid(tiny_model):
    """(arch, quant) -> (path, transformers model), made once."""
    made = {}

    def get(arch: str, quant: str = "F32"):
        if (arch, quant) not in made:
            path = tiny_model(arch=arch, quant=quant, **HYBRID)
            made[arch, quant] = (path, load_hybrid(path))
        return made[arch, quant]

    return get


def _ids(n=70, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def _hf(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _ours(path, ids, weights="dequantized", math="exact", prefill=32):
    cfg = EngineConfig(max_context=128, weights=weights, warmup=False, cpu_math=math,
                       prefill=prefill)
    with Engine.from_gguf(path, cfg) as eng:
        return eng.logits(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(hybrid, arch):
    """70 tokens read as chunks of 32, 32 and 6 (the chunked form, then the recurrent one), each
    chunk from the state the one before left: transformers reads them in one call."""
    path, model = hybrid(arch)
    ids = _ids()
    ref = _hf(model, ids)
    ours = _ours(path, ids)
    assert ours.shape == ref.shape == (70, 512)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL * np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_blocks_on_the_cpu_kernels_match_transformers(hybrid, arch):
    """Q8_0 weights in blocks through the C++ kernels: the exact math within TOL of transformers on
    the dequantized weights; the int8 math (8-bit activations) not the exact logits, within INT8_KL
    (mean KL) of transformers'. These tiny random recurrent models feel 8-bit activations more than
    the attention families' (logit_checks.assert_int8_close's 0.05 and top-1 check do not hold for
    them): llama.cpp's own 8-bit activations on the same Q8_0 files measure as far (mean KL from
    transformers: qwen3next 0.071, qwen35moe 0.017; ours 0.065 and 0.025; the same 75% top-1 at
    qwen3next's clear positions), and ours sit closer to llama.cpp's than either to transformers'
    (test_int8_math_matches_llamacpps_8_bit_activations)."""
    path, model = hybrid(arch, "Q8_0")
    ids = _ids(40, seed=1)
    ref = _hf(model, ids)
    exact = _ours(path, ids, weights="blocks")
    np.testing.assert_allclose(exact, ref, rtol=0, atol=TOL * np.abs(ref).max())
    int8 = _ours(path, ids, weights="auto", math="int8")
    assert np.abs(int8 - exact).max() > 0
    assert mean_kl(ref, int8) <= INT8_KL


@pytest.mark.parametrize("arch", ARCHS)
def test_the_pallas_kernels_match_transformers(hybrid, arch):
    """The GPU code path (the Pallas kernels over Q8_0 blocks; the DeltaNet math is plain jnp, for
    any backend): run by Pallas' interpreter on a CPU; with a GPU and STRATA_TEST_BACKEND=pallas
    (scripts/device_check.sh), by Triton on the GPU (float32 products there may run in TF32: 3e-3 of
    the largest logit)."""
    on_gpu = (os.environ.get("STRATA_TEST_BACKEND", "").strip() == "pallas"
              and jax.default_backend() == "gpu")
    path, model = hybrid(arch, "Q8_0")
    ids = _ids(40, seed=1)
    ref = _hf(model, ids)
    cfg = EngineConfig(max_context=64, weights="blocks", warmup=False, prefill=32,
                       backend="pallas" if on_gpu else "interpret")
    with Engine.from_gguf(path, cfg) as eng:
        ours = eng.logits(ids)
    np.testing.assert_allclose(ours, ref, rtol=0,
                               atol=(3e-3 if on_gpu else TOL) * np.abs(ref).max())


def test_the_output_gate_matters(hybrid):
    """The check can fail: transformers with the attention layer's gate rows of q_proj zeroed (every
    gate sigmoid(0) = 1/2) moves its logits far past TOL of ours; put back, within TOL again."""
    path, model = hybrid("qwen3next")
    ids = _ids(24)
    ours = _ours(path, ids)
    attn = model.model.layers[3].self_attn
    q = attn.q_proj.weight.data
    heads, d = model.config.num_attention_heads, model.config.head_dim
    gate_rows = q.view(heads, 2, d, -1)[:, 1]
    kept = gate_rows.clone()
    try:
        # sigmoid(0) = 1/2 on every gate: not ours
        gate_rows.zero_()
        assert np.abs(ours - _hf(model, ids)).max() > 100 * TOL * np.abs(ours).max()
    finally:
        gate_rows.copy_(kept)
    np.testing.assert_allclose(ours, _hf(model, ids), rtol=0, atol=TOL * np.abs(ours).max())


def _one_token_a_window(path, ids) -> np.ndarray:
    """Logits of `ids` read a token a window (forward() on a [1, 1] group each, the state carried in
    the cache from window to window): the decode path's recurrent form only."""
    model = GGUFModel.open(path)
    spec, params = model.spec, load_params(model, "dequantized", "float32")
    step = jax.jit(lambda params, cache, t, p: forward(params, spec, RunOptions(),
                                                       (Group(t, p, jnp.zeros(1, jnp.int32)),),
                                                       cache, 64))
    cache, out = new_kv_cache(spec, 1, 64, jnp.float32), []
    for n, t in enumerate(ids):
        res = step(params, cache, jnp.array([[t]], jnp.int32), jnp.array([[n]], jnp.int32))
        cache = res.cache
        out.append(np.asarray(res.logits[0][0]))
    return np.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_in_chunks_and_a_token_at_a_time_agree(hybrid, arch):
    """The same 48 tokens read 32 at a time (the chunked form, then the recurrent one), 16 at a time
    (the recurrent form) by the engine, and a token a window: the same logits within TOL, the same
    argmax."""
    path, _ = hybrid(arch)
    ids = _ids(48, seed=2)
    by32 = _ours(path, ids, prefill=32)
    for other in (_ours(path, ids, prefill=16), _one_token_a_window(path, ids)):
        np.testing.assert_allclose(other, by32, rtol=0, atol=TOL * np.abs(by32).max())
        assert (other.argmax(-1) == by32.argmax(-1)).all()


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_chunked_delta_rule_equals_the_recurrent_one(T):
    """deltanet.chunked against deltanet.recurrent from a non-zero state, 2 rows, 3 heads: outputs
    and final states within 1e-5 relative; padding tokens (g = 0, beta = 0) leave the state as it
    was."""
    rng = np.random.default_rng(T)
    R, H, dk, dv = 2, 3, 8, 8
    q = (deltanet.l2_normalize(jnp.asarray(rng.normal(size=(R, T, H, dk)), jnp.float32), 1e-6)
         * dk ** -0.5)
    k = deltanet.l2_normalize(jnp.asarray(rng.normal(size=(R, T, H, dk)), jnp.float32), 1e-6)
    v = jnp.asarray(rng.normal(size=(R, T, H, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 0.5, size=(R, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, size=(R, T, H)), jnp.float32)
    S0 = jnp.asarray(rng.normal(size=(R, H, dk, dv)), jnp.float32)
    o_r, S_r = jax.jit(deltanet.recurrent)(q, k, v, g, beta, S0)
    o_c, S_c = jax.jit(deltanet.chunked)(q, k, v, g, beta, S0)
    scale = float(jnp.abs(o_r).max())
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(S_c), np.asarray(S_r), rtol=0,
                               atol=1e-5 * float(jnp.abs(S_r).max()))
    zero = jnp.zeros_like(g)
    _, S_pad = jax.jit(deltanet.chunked)(q, k, v, zero, zero, S0)             # every token padding
    np.testing.assert_allclose(np.asarray(S_pad), np.asarray(S0), rtol=0, atol=1e-6)


def test_eight_concurrent_greedy_requests_equal_each_alone(hybrid):
    """8 prompts of 3 to 70 tokens, alone and all at once (twice: the first round's windows are
    narrowed while their programs are built, the second's hold several rows): the same 12 greedy
    tokens each."""
    path, _ = hybrid("qwen3next", "Q8_0")
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 40, 17, 70, 3, 33, 64, 9)]

    def together(eng):
        handles = [eng.submit(p, max_tokens=12, ignore_eos=True) for p in prompts]
        return [[ev.token for ev in h if ev.kind == "token"] for h in handles]

    with Engine.from_gguf(path, EngineConfig(parallel=8, max_context=128, prefill=32)) as eng:
        alone = [eng.generate(p, max_tokens=12, ignore_eos=True).tokens for p in prompts]
        first = together(eng)
        assert eng.wait_for_programs()
        before = eng.stats()
        second = together(eng)
        after = eng.stats()
    assert first == second == alone
    assert all(len(t) == 12 for t in alone)
    windows = after["windows"] - before["windows"]
    # windows really held several rows
    assert after["window_rows"] - before["window_rows"] > windows
    assert after["multi_prompt_windows"] > before["multi_prompt_windows"]


def test_a_slot_reused_by_a_new_request_starts_from_a_zero_state(hybrid):
    """One slot, three requests: the second and third (the first's prompt again) read from position
    0 of a slot whose state the one before left: the same tokens as the first (no prefix reuse: the
    state would be the end of the earlier conversation's)."""
    path, _ = hybrid("qwen35moe", "Q8_0")
    p = _ids(20, seed=7)
    with Engine.from_gguf(path, EngineConfig(parallel=1, max_context=64, prefill=16)) as eng:
        first = eng.generate(p, max_tokens=8, ignore_eos=True).tokens
        eng.generate(_ids(30, seed=8), max_tokens=8, ignore_eos=True)
        again = eng.generate(p, max_tokens=8, ignore_eos=True)
    assert again.tokens == first


@pytest.mark.parametrize("setting", [{"kv_resident": 256}, {"devices": 2}])
def test_settings_the_family_cannot_run_with_are_refused_by_name(hybrid, setting):
    path, _ = hybrid("qwen3next")
    name = next(iter(setting)).replace("_", "-")
    with pytest.raises(ConfigError, match=f"--{name}.*qwen3next"):
        Engine.from_gguf(path, EngineConfig(max_context=512, warmup=False, **setting))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_llamacpp(hybrid, arch):
    # not imported here: llamacpp_logits runs it in a child
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from test_llamacpp import llamacpp_greedy, llamacpp_logits

    path, _ = hybrid(arch)
    ids = _ids(40, seed=3)
    ref = llamacpp_logits(path, ids)
    ours = _ours(path, ids)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL * np.abs(ref).max())
    prompt = ids[:8]
    with Engine.from_gguf(path,
                          EngineConfig(max_context=64, weights="dequantized", warmup=False)) as eng:
        tokens = eng.generate(prompt, max_tokens=32, ignore_eos=True).tokens
    assert tokens == llamacpp_greedy(path, prompt, 32)


def test_int8_math_matches_llamacpps_8_bit_activations(hybrid):
    """On a Q8_0 file the int8 math and llama.cpp (which also multiplies Q8_0 weights by 8-bit
    activations) agree to a mean KL of 0.03 (measured 0.011), closer than either is to transformers
    (0.065, 0.071)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from test_llamacpp import llamacpp_logits

    path, _ = hybrid("qwen3next", "Q8_0")
    ids = _ids(40, seed=1)
    assert (mean_kl(llamacpp_logits(path, ids), _ours(path, ids, weights="auto", math="int8"))
            <= 0.03)


@pytest.mark.parametrize("math", ["exact", "int8"])
def test_expert_tiers_at_a_quarter_of_the_experts_give_the_all_on_device_logits(hybrid, math):
    """--expert-cache 2 (of 8 experts a layer): the one-program window reading misses from the host
    tier's blocks (host experts on), and the layer-stepped chain (host experts off: misses copied
    into the arena), give the logits of every expert on the device, bit for bit, and its greedy
    tokens."""
    path, _ = hybrid("qwen3next", "Q8_0")
    ids = _ids(40, seed=4)
    runs = {}
    for name, kw in (("device", {}), ("tiers", {"expert_cache": 2}),
                     ("stepped", {"expert_cache": 2, "host_experts": "off"})):
        cfg = EngineConfig(max_context=64, warmup=False, cpu_math=math, prefill=16, **kw)
        with Engine.from_gguf(path, cfg) as eng:
            assert eng.runner.expert_mode == ("device" if name == "device" else "arena")
            runs[name] = (eng.logits(ids),
                          eng.generate(ids[:10], max_tokens=8, ignore_eos=True).tokens)
    for name in ("tiers", "stepped"):
        np.testing.assert_array_equal(runs[name][0], runs["device"][0])
        assert runs[name][1] == runs["device"][1]


def test_a_second_turn_resumes_from_a_checkpoint_with_a_cold_runs_answer(hybrid):
    """Turn 1, then turn 2 = turn 1's tokens and answer and more (resumed at the slot's live state),
    then a prompt that leaves turn 1's after its prompt (resumed at the checkpoint kept at its end):
    each reads only its new tokens (reused_tokens) and gives the tokens of a cold engine (no prefix
    cache)."""
    path, _ = hybrid("qwen35moe", "Q8_0")
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(3, 500, 50)]
    new = [int(t) for t in rng.integers(3, 500, 7)]
    cfg = EngineConfig(parallel=2, max_context=256, prefill=16, warmup=False)
    with Engine.from_gguf(path, cfg) as eng:
        answer = eng.generate(first, max_tokens=8, ignore_eos=True).tokens
        turn2 = eng.generate(first + answer + new, max_tokens=8, ignore_eos=True)
        other = eng.generate(first + new, max_tokens=8, ignore_eos=True)
        states = eng.stats()["prefix_cache"]["state_checkpoints"]
    with Engine.from_gguf(path, EngineConfig(parallel=2, max_context=256, prefill=16, warmup=False,
                                             prefix_cache=False)) as cold:
        assert (cold.generate(first + answer + new, max_tokens=8, ignore_eos=True).tokens
                == turn2.tokens)
        assert cold.generate(first + new, max_tokens=8, ignore_eos=True).tokens == other.tokens
    # all it had read (the live state)
    assert turn2.stats["reused_tokens"] == len(first) + len(answer) - 1
    # the checkpoint at turn 1's end
    assert other.stats["reused_tokens"] == len(first)
    assert states["live_reused"] >= 1 and states["restored"] >= 1 and states["taken"] >= 3


@pytest.fixture(scope="module")
def few_tokens(hybrid, tmp_path_factory):
    """qwen3next F32 with 4 rows of its output head scaled by 40: its greedy tokens are nearly
    always those 4, in an order its state decides, so n-gram drafts are accepted in part (a random
    model's output never repeats itself)."""
    from strata_jax.testing.edit_gguf import rewrite_gguf

    path, _ = hybrid("qwen3next")
    head = GGUFModel.open(path).tensors["output.weight"].dequantize().copy()
    head[[11, 12, 13, 14]] *= 40.0
    return rewrite_gguf(path, tmp_path_factory.mktemp("few") / "few.gguf",
                        tensor_values={"output.weight": head})


def test_spec_greedy_equals_plain_and_accepts_drafts(few_tokens):
    """--spec 4 with n-gram drafts, each prompt alone and all at once: the plain greedy tokens,
    drafts accepted in part, so that each verify window's state is taken back to its accepted tokens
    (KVCache.keep_steps; without it the tokens differ: checked when this was written)."""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (8, 20, 33, 5)]
    runs = {}
    for spec in (0, 4):
        cfg = EngineConfig(parallel=4, max_context=256, prefill=16, spec=spec, spec_min_p=0.0,
                           warmup=False)
        with Engine.from_gguf(few_tokens, cfg) as eng:
            alone = [eng.generate(p, max_tokens=48, ignore_eos=True) for p in prompts]
            handles = [eng.submit(p, max_tokens=48, ignore_eos=True) for p in prompts]
            together = [[ev.token for ev in h if ev.kind == "token"] for h in handles]
            runs[spec] = ([a.tokens for a in alone], together, [a.stats for a in alone])
    assert runs[4][0] == runs[0][0] and runs[4][1] == runs[0][0]
    accepted = sum(s["draft_n_accepted"] for s in runs[4][2])
    # some accepted, some rejected
    assert 0 < accepted < sum(s["draft_n"] for s in runs[4][2])


def test_a_hybrid_draft_model_and_mtp_without_a_nextn_block_are_refused_by_name(hybrid):
    """(The MTP drafter on a file with a NextN block: tests/test_hybrid_mtp.py.)"""
    path, _ = hybrid("qwen3next")
    with pytest.raises(ConfigError, match="qwen3next draft model is not supported"):
        Engine.from_gguf(path, EngineConfig(max_context=64, warmup=False, spec=2,
                                            drafter=f"draft:{path}"))
    with pytest.raises(ConfigError, match="qwen3next model has no next-token-prediction"):
        Engine.from_gguf(path, EngineConfig(max_context=64, warmup=False, spec=2, drafter="mtp"))
