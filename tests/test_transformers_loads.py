"""Hugging Face transformers (the oracle for logits) loads the synthetic models of every family it
knows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from strata_jax.gguf import GGUFModel

ARCHS = {  # our architecture -> transformers' model class
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_loads_each_family(tiny_model, arch):
    from strata_jax.testing.hf import load_hf_model

    options = {"arch": arch, "quant": "Q4_0", "attn_quant": "Q8_0", "tied": arch == "qwen3"}
    if arch.endswith("moe"):
        options |= {"experts": 4, "experts_used": 2, "expert_ffn": 64, "shared_ffn": 96}
    path = tiny_model(**options)
    ours = GGUFModel.open(path)
    hf = load_hf_model(path)  # raises if any parameter was left unloaded
    assert type(hf).__name__ == ARCHS[arch]
    assert sum(p.numel() for p in hf.parameters()) == sum(t.n_values for t in ours.tensors.values())
    state = hf.state_dict()
    np.testing.assert_array_equal(state["model.embed_tokens.weight"].numpy(),
                                  ours.tensors["token_embd.weight"].dequantize())
    np.testing.assert_array_equal(state["model.layers.1.self_attn.v_proj.weight"].numpy(),
                                  ours.tensors["blk.1.attn_v.weight"].dequantize())
    with torch.no_grad():
        logits = hf(torch.tensor([[1, 2, 3, 300, 5]])).logits
    assert logits.shape == (1, 5, ours.spec.vocab_size)
    assert torch.isfinite(logits).all() and 0.3 < logits.std() < 5  # random weights, sane scales


def test_transformers_builds_the_builtin_tokenizer(tiny_model):
    path = tiny_model(arch="qwen3moe")
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    md = GGUFModel.open(path).metadata
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tok) == len(tokens)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (text == "<|im_start|>user\nWhat is the capital of "
                    "France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tokens.index("<|im_start|>") and tokens.index("<|im_end|>") in ids
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(tok.encode(" capital of France",
                                                add_special_tokens=False)) == [
        "Ġcapital", "Ġof", "ĠFrance"]  # merges learned from the built-in text
