"""GLM-4.5 (glm4moe) GGUF -> Hugging Face transformers' Glm4MoeForCausalLM and its MTP layer: the
oracle.

transformers' GGUF loader has no glm4moe, so the model is built from a config derived from our
ModelSpec (itself read from the GGUF metadata as llama.cpp reads it) and its weights are the GGUF
tensors, dequantized by the gguf package (which our kernels match bit for bit), loaded by name. The
NextN block becomes transformers' own `MtpModel` (generation's MTP drafter: MtpLayer = enorm, hnorm,
eh_proj, a Glm4MoeDecoderLayer, and the shared-head norm as post_norm; embedding and head tied to
the main model's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata_jax.gguf import GGUFModel, ModelSpec

from .hf import load_state, use_own_nextn_head

# GGUF name after "blk.N." -> transformers' name after "layers.N." (q/k/v biases, q/k norms when
# present).
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_NEXTN = {"nextn.enorm.weight": "enorm.weight", "nextn.hnorm.weight": "hnorm.weight",
          "nextn.eh_proj.weight": "eh_proj.weight",
          "nextn.shared_head_norm.weight": "post_norm.weight"}


def glm4moe_config(spec: ModelSpec):
    """transformers' Glm4MoeConfig for the model `spec` describes (no expert groups: llama.cpp has
    none)."""
    from transformers import Glm4MoeConfig

    moe = set(spec.moe_layers)
    leading = next(i for i in range(spec.n_layers + 1) if i == spec.n_layers or i in moe)
    if moe != set(range(leading, spec.n_layers)):
        raise ValueError(f"glm4moe layers must be dense then MoE; MoE layers here: {sorted(moe)}")
    return Glm4MoeConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.ffn or 1,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length, rms_norm_eps=spec.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.rope_dims / spec.head_dim},
        attention_bias=spec.attn_bias, use_qk_norm=spec.qk_norm,
        tie_word_embeddings=spec.tied_output, moe_intermediate_size=spec.expert_ffn,
        num_experts_per_tok=spec.n_experts_used,
        n_shared_experts=spec.shared_ffn // spec.expert_ffn, n_routed_experts=spec.n_experts,
        routed_scaling_factor=spec.expert_weights_scale, n_group=1, topk_group=1,
        first_k_dense_replace=leading,
        norm_topk_prob=spec.expert_weights_norm, num_nextn_predict_layers=max(spec.n_nextn, 1))


def _layer_state(t: dict, i: int, prefix: str) -> dict[str, np.ndarray]:
    out = {prefix + hf: t[f"blk.{i}.{g}"] for g, hf in _LAYER.items() if f"blk.{i}.{g}" in t}
    # [E, f, h] twice -> gate_up_proj [E, 2f, h], gate first
    if f"blk.{i}.ffn_gate_exps.weight" in t:
        out[prefix + "mlp.experts.gate_up_proj"] = np.concatenate(
            [t[f"blk.{i}.ffn_gate_exps.weight"], t[f"blk.{i}.ffn_up_exps.weight"]], axis=1)
    return out


def load_glm4moe(path: str | Path, with_mtp: bool = False):
    """-> Glm4MoeForCausalLM (eval, float32), or (model, MtpModel) with `with_mtp`. Raises if any
    parameter is left unloaded (it would be random)."""
    import torch
    from transformers import Glm4MoeForCausalLM
    from transformers.modeling_layers import MtpModel

    gguf = GGUFModel.open(path)
    spec = gguf.spec
    t = {name: info.dequantize().astype(np.float32) for name, info in gguf.tensors.items()}

    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(glm4moe_config(spec)).float().eval()
    state = {"model.embed_tokens.weight": t["token_embd.weight"],
             "model.norm.weight": t["output_norm.weight"],
             "lm_head.weight": t.get("output.weight", t["token_embd.weight"])}
    for i in range(spec.n_layers):
        state |= _layer_state(t, i, f"model.layers.{i}.")
    load_state(model, state, path)
    if not with_mtp:
        return model
    if not spec.n_nextn:
        raise ValueError(f"{path} has no NextN (MTP) layer")
    mtp = MtpModel(model, 1).float().eval()
    i = spec.n_layers
    state = _layer_state(t, i, "layers.0.mtp_block.")
    state |= {"layers.0." + hf: t[f"blk.{i}.{g}"] for g, hf in _NEXTN.items()
                                if f"blk.{i}.{g}" in t}
    if f"blk.{i}.nextn.shared_head_norm.weight" not in t:
        state["layers.0.post_norm.weight"] = t["output_norm.weight"]
    load_state(mtp, state, path, shared=("embed_tokens.", "shared_head."))
    use_own_nextn_head(mtp, t, i, spec)
    return model, mtp
