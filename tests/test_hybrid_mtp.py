"""The hybrid families' drafters (issue 34 item 5): their own NextN (MTP) block, and an attention
draft model (n-gram drafts: tests/test_hybrid_model.py).

Its block is gated full attention with KV of its own (after the attention layers' in the cache:
spec.kv_layer(n_layers)) and the family's MoE with its gated shared expert; no recurrent state, so
the drafter is glm4moe's (model/mtp.py, engine/spec/mtp.py). Oracle: transformers' generic MtpModel
(modeling_layers: enorm, hnorm, eh_proj, the family's decoder layer as full attention, the
shared-head norm) with the file's NextN block loaded (strata_jax.testing.hf_hybrid); transformers'
own Qwen3-Next checkpoints drop `mtp.*`, the block is the one llama.cpp's qwen3next graph_mtp builds
(read: its gated Q, q/k norms, MoE and shared expert).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_hybrid_read import HYBRID

from strata_jax import Engine, EngineConfig
from strata_jax.gguf import GGUFModel
from strata_jax.model import (
    Group,
    RunOptions,
    forward,
    load_params,
    mtp_forward,
    new_kv_cache,
)
from strata_jax.testing.hf_hybrid import load_hybrid

ARCHS = ["qwen3next", "qwen35moe"]
TOL = 1e-4
MTP = {"spec": 4, "drafter": "mtp", "spec_min_p": 0.0}


@pytest.fixture(scope="module")
def with_mtp(tiny_model):
    """arch -> the made F32 file with a NextN block (its own head for qwen35moe: both ways are
    read)."""
    return lambda arch: tiny_model(arch=arch, quant="F32", nextn=1, nextn_head=arch == "qwen35moe",
                                   **HYBRID)


@partial(jax.jit, static_argnums=(1, 2, 6))
def _main(params, spec, opts, tokens, pos, slots, kv_len, cache):
    res = forward(params, spec, opts, (Group(tokens, pos, slots, all_logits=True),), cache, kv_len,
                  with_hidden=True)
    return res.hiddens[0], res.cache


_mtp = jax.jit(mtp_forward, static_argnums=(1, 2, 8))


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_matches_transformers(with_mtp, arch):
    """mtp_forward against transformers' MtpModel on the same NextN block: over a prompt in two
    calls (the second reads the first's KV from the block's own cache layer), then one chained draft
    step on its own hidden_out, in a batch of 2 rows (the other padding). The main model's hidden
    states are checked first."""
    path = with_mtp(arch)
    model, mtp = load_hybrid(path, with_mtp=True)
    spec = GGUFModel.open(path).spec
    # after the one attention layer
    assert spec.n_nextn == 1 and spec.kv_layer(spec.n_layers) == 1 == spec.n_kv_layers - 1
    params = load_params(GGUFModel.open(path), "dequantized", "float32")
    opts = RunOptions(attn_chunk=32)
    T, kv = 12, 32
    ids = np.random.default_rng(0).integers(3, 500, T).astype(np.int32)
    slots = jnp.array([1, 0], jnp.int32)
    cache = new_kv_cache(spec, 2, kv, jnp.float32)

    def rows(x, pad):
        return jnp.asarray(np.stack([x, np.full_like(x, pad)]))

    pos = np.arange(T, dtype=np.int32)
    hid, cache = _main(params, spec, opts, rows(ids, 0), rows(pos, -1), slots, kv, cache)
    hid = hid[:1]
    with torch.no_grad():
        # after the final norm
        h_ref = model.model(torch.tensor(ids[None].astype(np.int64))).last_hidden_state
        np.testing.assert_allclose(np.asarray(hid), h_ref.numpy(), rtol=0,
                                   atol=TOL * h_ref.abs().max().item())
        out_ref = mtp.forward_layer(0, h_ref[:, :T - 1], torch.arange(T - 1)[None], None,
                                    input_ids=torch.tensor(ids[None, 1:].astype(np.int64)))
        # [T-1, V]
        logits_ref = mtp._project_to_logits(out_ref)[0].numpy()

    def step(h, toks, at, cache):
        h2 = jnp.concatenate([h, jnp.zeros_like(h)])
        return _mtp(params, spec, opts, h2, rows(toks, 0), rows(at, -1), slots, cache, kv)

    l1, _, cache = step(hid[:, :T - 2], ids[1:T - 1], pos[:T - 2], cache)
    l2, o2, cache = step(hid[:, T - 2:T - 1], ids[T - 1:], pos[T - 2:T - 1], cache)
    ours = np.concatenate([np.asarray(l1[0]), np.asarray(l2[0])])
    assert ours.shape == logits_ref.shape == (T - 1, spec.vocab_size)
    np.testing.assert_allclose(ours, logits_ref, rtol=0, atol=TOL * np.abs(logits_ref).max())
    np.testing.assert_allclose(np.asarray(o2[0, 0]), out_ref[0, -1].numpy(), rtol=0, atol=TOL * 10)

    # a chained draft, on the block's own hidden_out
    draft = int(ours[-1].argmax())
    l3, _, cache = step(o2[:1], np.array([draft], np.int32), np.array([T - 1], np.int32), cache)
    with torch.no_grad():
        seq = torch.cat([h_ref[:, :T - 1], out_ref[:, -1:]], dim=1)
        toks = torch.tensor(np.append(ids[1:], draft)[None].astype(np.int64))
        ref3 = mtp._project_to_logits(mtp.forward_layer(0, seq, torch.arange(T)[None], None,
                                                        input_ids=toks))[0, -1]
    np.testing.assert_allclose(np.asarray(l3[0, 0]), ref3.numpy(), rtol=0,
                               atol=TOL * np.abs(ref3.numpy()).max())

    # The check can fail: the block's output gate rows zeroed on transformers' side move its logits
    # far off.
    with torch.no_grad():
        q = mtp.layers[0].mtp_block.self_attn.q_proj.weight
        q.view(spec.n_heads, 2, spec.head_dim, -1)[:, 1] = 0
        off = mtp._project_to_logits(mtp.forward_layer(0, h_ref[:, :T - 1],
                                                       torch.arange(T - 1)[None], None,
                                                       input_ids=torch.tensor(
                                                           ids[None, 1:].astype(np.int64))))
    assert np.abs(off[0].numpy() - ours).max() > 100 * TOL * np.abs(ours).max()


@pytest.fixture(scope="module")
def few_tokens(with_mtp, tmp_path_factory):
    """qwen3next with a NextN block, 4 rows of its output head (which the block shares) scaled by
    40: the main model's greedy tokens and the block's drafts are nearly always among those 4, so
    drafts are accepted in part (a random model's drafts never would be)."""
    from strata_jax.testing.edit_gguf import rewrite_gguf

    path = with_mtp("qwen3next")
    head = GGUFModel.open(path).tensors["output.weight"].dequantize().copy()
    head[[11, 12, 13, 14]] *= 40.0
    return rewrite_gguf(path, tmp_path_factory.mktemp("few_mtp") / "few.gguf",
                        tensor_values={"output.weight": head})


@pytest.mark.parametrize("tiers", [False, True],
                         ids=["all-experts-on-device", "expert-cache-a-quarter"])
def test_mtp_spec_greedy_equals_plain_and_accepts_drafts(few_tokens, tiers):
    """--spec 4 --drafter mtp, each prompt alone and four at once: the plain greedy tokens (all
    experts on the device), drafts accepted in part (so verify windows keep the state after the
    accepted tokens only), the NextN block run over every prompt position; with --expert-cache 2 (a
    quarter of the 8 experts) as well."""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (8, 20, 33, 5)]
    base = {"parallel": 4, "max_context": 256, "prefill": 16, "warmup": False}
    with Engine.from_gguf(few_tokens, EngineConfig(**base)) as eng:
        plain = [eng.generate(p, max_tokens=40, ignore_eos=True).tokens for p in prompts]
    cfg = EngineConfig(**base, **MTP, **({"expert_cache": "2"} if tiers else {}))
    with Engine.from_gguf(few_tokens, cfg) as eng:
        assert (eng.runner.stepper is not None) == tiers
        alone = [eng.generate(p, max_tokens=40, ignore_eos=True) for p in prompts]
        handles = [eng.submit(p, max_tokens=40, ignore_eos=True) for p in prompts]
        together = [[ev.token for ev in h if ev.kind == "token"] for h in handles]
        st = eng.stats()["spec"]
    assert [a.tokens for a in alone] == plain and together == plain
    assert st["drafter"] == "mtp" and st["mtp_synced_positions"] >= 2 * sum(len(p) for p in prompts)
    accepted = sum(a.stats["draft_n_accepted"] for a in alone)
    # some accepted, some rejected
    assert 0 < accepted < sum(a.stats["draft_n"] for a in alone)


def test_an_attention_draft_model_on_a_hybrid_target_gives_the_greedy_text(few_tokens, tiny_model,
                                                                           tmp_path):
    """--spec 4 with draft:PATH.gguf (a tiny qwen3 of the same vocabulary, its head pushed to the
    same 4 tokens, so its drafts are accepted in part) on the hybrid target: the plain greedy
    tokens, alone and together."""
    from strata_jax.testing.edit_gguf import rewrite_gguf

    plain_draft = tiny_model(arch="qwen3", layers=2, hidden=64, quant="F32")
    head = GGUFModel.open(plain_draft).tensors["output.weight"].dequantize().copy()
    head[[11, 12, 13, 14]] *= 40.0
    draft = rewrite_gguf(plain_draft, tmp_path / "draft.gguf",
                         tensor_values={"output.weight": head})
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (9, 26, 4)]
    base = {"parallel": 3, "max_context": 256, "prefill": 16, "warmup": False}
    with Engine.from_gguf(few_tokens, EngineConfig(**base)) as eng:
        plain = [eng.generate(p, max_tokens=32, ignore_eos=True).tokens for p in prompts]
    cfg = EngineConfig(**base, spec=4, drafter=f"draft:{draft}", spec_min_p=0.0)
    with Engine.from_gguf(few_tokens, cfg) as eng:
        alone = [eng.generate(p, max_tokens=32, ignore_eos=True) for p in prompts]
        handles = [eng.submit(p, max_tokens=32, ignore_eos=True) for p in prompts]
        together = [[ev.token for ev in h if ev.kind == "token"] for h in handles]
    assert [a.tokens for a in alone] == plain and together == plain
    accepted = sum(a.stats["draft_n_accepted"] for a in alone)
    assert 0 < accepted < sum(a.stats["draft_n"] for a in alone)
