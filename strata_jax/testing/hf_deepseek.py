"""deepseek2 GGUF -> transformers' DeepseekV3ForCausalLM: the oracle.

transformers' GGUF loader has no deepseek2, so the model is built from a config derived from our
ModelSpec and loaded with the GGUF tensors (dequantized by the gguf package), undoing what
llama.cpp's converter did (conversion/deepseek.py; ../shared/reference/families-spec.md 3):
- kv_b_proj [H * (nope + v), kv_lora] was split per head into attn_k_b (its nope rows, each head's
  block transposed: [H, kv_lora, nope]) and attn_v_b ([H, v, kv_lora]): put back together (a legacy
  file's attn_kv_b is kv_b_proj as it is);
- the rope dims are interleaved pairs in both (no q/k permutation: transformers' rope_interleave);
- the experts' gate and up are transformers' gate_up_proj [E, 2f, h], gate first; exp_probs_b is
  the router's e_score_correction_bias; norms are plain (x w).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata_jax.gguf import GGUFModel, ModelSpec

from .hf import load_state, use_own_nextn_head

_COMMON = {"attn_norm.weight": "input_layernorm.weight",
           "ffn_norm.weight": "post_attention_layernorm.weight",
           "attn_q.weight": "self_attn.q_proj.weight",
           "attn_q_a.weight": "self_attn.q_a_proj.weight",
           "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
           "attn_q_b.weight": "self_attn.q_b_proj.weight",
           "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
           "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
           "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
           "attn_output.weight": "self_attn.o_proj.weight",
           "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
           "ffn_down.weight": "mlp.down_proj.weight",
           "ffn_gate_inp.weight": "mlp.gate.weight",
           "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
           "ffn_down_exps.weight": "mlp.experts.down_proj",
           "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
           "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
           "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}


def deepseek_config(spec: ModelSpec):
    """transformers' DeepseekV3Config for the model `spec` describes."""
    from transformers import DeepseekV3Config

    m = spec.mla
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    rs = spec.rope_scaling
    if rs is not None and rs.type == "yarn":
        extra = dict(rs.extra)
        mscale_all = m.yarn_log_mul
        rope = {"rope_type": "yarn", "rope_theta": spec.rope_theta, "factor": rs.factor,
                "original_max_position_embeddings": rs.original_context or spec.context_length,
                "beta_fast": extra.get("yarn_beta_fast", 32.0),
                "beta_slow": extra.get("yarn_beta_slow", 1.0)}
        if mscale_all:     # llama.cpp's deepseek2 takes mscale = mscale_all_dim
            rope |= {"mscale": mscale_all, "mscale_all_dim": mscale_all}
    return DeepseekV3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.ffn or 1,
        moe_intermediate_size=spec.expert_ffn, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_heads,
        n_shared_experts=spec.shared_ffn // spec.expert_ffn, n_routed_experts=spec.n_experts,
        routed_scaling_factor=spec.expert_weights_scale, kv_lora_rank=m.kv_lora,
        q_lora_rank=m.q_lora or None, qk_rope_head_dim=m.rope, v_head_dim=m.v_head,
        qk_nope_head_dim=m.nope, n_group=spec.expert_groups, topk_group=spec.expert_groups_used,
        num_experts_per_tok=spec.n_experts_used, first_k_dense_replace=min(spec.moe_layers),
        norm_topk_prob=spec.expert_weights_norm, max_position_embeddings=spec.context_length,
        rms_norm_eps=spec.rms_eps, rope_parameters=rope, rope_interleave=True,
        tie_word_embeddings=spec.tied_output)


def _layer_state(t: dict, i: int, spec: ModelSpec, prefix: str = "") -> dict[str, np.ndarray]:
    b, m = f"blk.{i}.", spec.mla
    out = {hf: t[b + g] for g, hf in _COMMON.items() if b + g in t}
    if b + "attn_k_b.weight" in t:
        k_b = np.swapaxes(t[b + "attn_k_b.weight"], 1, 2)                       # [H, nope, kv_lora]
        kv_b = np.concatenate([k_b, t[b + "attn_v_b.weight"]], axis=1)
        out["self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, m.kv_lora)
    if b + "ffn_gate_exps.weight" in t:
        out["mlp.experts.gate_up_proj"] = np.concatenate([t[b + "ffn_gate_exps.weight"],
                                                          t[b + "ffn_up_exps.weight"]], 1)
    prefix = prefix or f"model.layers.{i}."
    return {prefix + k: v for k, v in out.items()}


def load_deepseek(path: str | Path, with_mtp: bool = False):
    """-> DeepseekV3ForCausalLM (eval, float32) on the file's weights, or (model, MtpModel) with
    `with_mtp`: transformers' generic MTP drafter (modeling_layers.MtpLayer: enorm, hnorm, eh_proj,
    a DeepseekV3DecoderLayer with the MoE, the shared-head norm as post_norm; the main model's
    embedding and head), the file's NextN block loaded into it. Raises if any parameter is left
    unloaded (it would be random)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    gguf = GGUFModel.open(path)
    spec = gguf.spec
    if spec.mla is None:
        raise ValueError(f"{path}: a {spec.architecture} model, not deepseek2")
    t = {name: info.dequantize().astype(np.float32) for name, info in gguf.tensors.items()}
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(deepseek_config(spec)).float().eval()
    state = {"model.embed_tokens.weight": t["token_embd.weight"],
             "model.norm.weight": t["output_norm.weight"],
             "lm_head.weight": t.get("output.weight", t["token_embd.weight"])}
    for i in range(spec.n_layers):
        state |= _layer_state(t, i, spec)
    load_state(model, state, path)
    if not with_mtp:
        return model
    return model, _mtp_model(model, t, spec, path)


def _mtp_model(model, t: dict, spec: ModelSpec, path):
    """transformers' MtpModel on `model` with blk.{n_layers}'s NextN block. Its decoder layer is
    made with layer index 0, which DeepseekV3DecoderLayer makes dense below first_k_dense_replace:
    the MTP config says 0 dense layers, so it has the MoE the block has."""
    from transformers.modeling_layers import MtpModel

    if not spec.n_nextn:
        raise ValueError("the file has no NextN (MTP) layer")
    i, b = spec.n_layers, f"blk.{spec.n_layers}.nextn."
    dense = model.config.first_k_dense_replace
    model.config.first_k_dense_replace = 0
    try:
        mtp = MtpModel(model, 1).float().eval()
    finally:
        model.config.first_k_dense_replace = dense
    state = _layer_state(t, i, spec, "layers.0.mtp_block.")
    state |= {"layers.0.enorm.weight": t[b + "enorm.weight"],
              "layers.0.hnorm.weight": t[b + "hnorm.weight"],
              "layers.0.eh_proj.weight": t[b + "eh_proj.weight"],
              "layers.0.post_norm.weight": t.get(b + "shared_head_norm.weight",
                                                 t["output_norm.weight"])}
    load_state(mtp, state, path, shared=("embed_tokens.", "shared_head."))
    use_own_nextn_head(mtp, t, i, spec)
    return mtp
