"""gpt-oss GGUF -> transformers' GptOssForCausalLM: the oracle.

transformers' GGUF loader lists gpt_oss, but its expert names are not llama.cpp's (ffn_*_exps), so
the model is built from a config derived from our ModelSpec and loaded with the GGUF tensors
(dequantized by the gguf package), undoing what llama.cpp's converter (conversion/gpt_oss.py) did:
- gate_up_proj [E, h, 2f] is interleaved, gate at the even columns and up at the odd ones (and so
  its bias); the file has them split and transposed ([E, f, h]);
- down_proj [E, f, h] is the file's ffn_down_exps [E, h, f] transposed;
- attn_sinks.weight is transformers' self_attn.sinks.
Rope: plain (rope_type "default") unless the file has YaRN keys, then transformers' YaRN with
truncate True: the correction range floored and ceiled, as llama.cpp's ggml_rope_yarn_corr_dims
does (the real models' config says truncate False: families-spec.md 2.6; the GGUF reference is
llama.cpp's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata_jax.gguf import GGUFModel, ModelSpec

from .hf import load_state

_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "post_attention_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
          "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_output.bias": "self_attn.o_proj.bias",
          "attn_sinks.weight": "self_attn.sinks",
          "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
          "ffn_down_exps.bias": "mlp.experts.down_proj_bias"}


def gpt_oss_config(spec: ModelSpec):
    """transformers' GptOssConfig for the model `spec` describes."""
    from transformers import GptOssConfig

    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None and spec.rope_scaling.type == "yarn":
        extra = dict(spec.rope_scaling.extra)
        rope = {"rope_type": "yarn", "rope_theta": spec.rope_theta,
                "factor": spec.rope_scaling.factor,
                "original_max_position_embeddings": spec.rope_scaling.original_context,
                "beta_fast": float(extra.get("yarn_beta_fast", 32.0)),
                "beta_slow": float(extra.get("yarn_beta_slow", 1.0)), "truncate": True}
    return GptOssConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, intermediate_size=spec.expert_ffn,
        num_local_experts=spec.n_experts, num_experts_per_tok=spec.n_experts_used,
        sliding_window=spec.sliding_window, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=spec.context_length, rope_parameters=rope,
        layer_types=["sliding_attention" if spec.window(i) else "full_attention"
                     for i in range(spec.n_layers)],
        tie_word_embeddings=spec.tied_output, attention_bias=True)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [..., f] -> [..., 2f] with gate at the even positions, up at the odd."""
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), np.float32)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out


def load_gpt_oss(path: str | Path):
    """-> GptOssForCausalLM (eval, float32, eager attention: the sinks) on the file's weights.
    Raises if any parameter is left unloaded (it would be random)."""
    import torch
    from transformers import GptOssForCausalLM

    gguf = GGUFModel.open(path)
    spec = gguf.spec
    t = {name: info.dequantize().astype(np.float32) for name, info in gguf.tensors.items()}
    torch.manual_seed(0)
    config = gpt_oss_config(spec)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).float().eval()
    state = {"model.embed_tokens.weight": t["token_embd.weight"],
             "model.norm.weight": t["output_norm.weight"],
             "lm_head.weight": t.get("output.weight", t["token_embd.weight"])}
    for i in range(spec.n_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        state |= {p + hf: t[b + g] for g, hf in _LAYER.items()}
        state[p + "mlp.experts.gate_up_proj"] = _interleave(
            t[b + "ffn_gate_exps.weight"].transpose(0, 2, 1),
            t[b + "ffn_up_exps.weight"].transpose(0, 2, 1))
        state[p + "mlp.experts.gate_up_proj_bias"] = _interleave(t[b + "ffn_gate_exps.bias"],
                                                                 t[b + "ffn_up_exps.bias"])
        state[p + "mlp.experts.down_proj"] = t[b + "ffn_down_exps.weight"].transpose(0, 2, 1)
    load_state(model, state, path)
    return model
