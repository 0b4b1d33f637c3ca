"""qwen3next / qwen35moe GGUF -> transformers' Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM: the
oracle.

transformers' GGUF loader has neither family, so the model is built from a config derived from our
ModelSpec and loaded with the GGUF tensors (dequantized by the gguf package), undoing what
llama.cpp's converter did (conversion/qwen.py; ../shared/reference/families-spec.md 1.3):
- every norm but the DeltaNet output norm got +1 (transformers' RMSNorm is zero-centred, x (1 + w)):
  -1 here;
- ssm_a = -exp(A_log): A_log = log(-ssm_a); the conv weight [C, K] is transformers' [C, 1, K];
- qwen3next: attn_qkv and attn_gate are transformers' in_proj_qkvz split, its per-k-head groups
  [q, k, v x r, z x r] regrouped here; ssm_ba keeps transformers' grouping;
- qwen35moe: the converter tiled the v-heads (file head j * Hk + kh is transformers' kh * r + j) in
  qkv's v part, z, beta, alpha, A, dt_bias, the conv's v channels and ssm_out's columns: put back in
  grouped order.
The experts' gate and up are transformers' gate_up_proj [E, 2f, h], gate first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata_jax.gguf import GGUFModel, ModelSpec

from .hf import load_state, use_own_nextn_head

_ATTENTION = {"attn_q.weight": "self_attn.q_proj.weight",
              "attn_k.weight": "self_attn.k_proj.weight",
              "attn_v.weight": "self_attn.v_proj.weight",
              "attn_output.weight": "self_attn.o_proj.weight",
              "attn_q_norm.weight": "self_attn.q_norm.weight",
              "attn_k_norm.weight": "self_attn.k_norm.weight"}
_FFN = {"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_down_exps.weight": "mlp.experts.down_proj",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight"}
_ZERO_CENTRED = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                 "attn_k_norm.weight")


def hybrid_config(spec: ModelSpec):
    """transformers' config for the model `spec` describes."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    d = spec.deltanet
    if d.v_head_dim != d.head_dim:
        raise ValueError(f"transformers' DeltaNet has one head size for q/k and v: {d.head_dim} "
                         f"and {d.v_head_dim}")
    cls = Qwen3NextConfig if spec.architecture == "qwen3next" else Qwen3_5MoeTextConfig
    return cls(vocab_size=spec.vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
               num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
               head_dim=spec.head_dim, max_position_embeddings=spec.context_length,
               rms_norm_eps=spec.rms_eps,
               rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                                "partial_rotary_factor": spec.rope_dims / spec.head_dim},
               layer_types=["linear_attention" if k == "deltanet" else "full_attention"
                            for k in spec.layer_kinds],
               linear_conv_kernel_dim=d.conv_kernel, linear_key_head_dim=d.head_dim,
               linear_value_head_dim=d.v_head_dim, linear_num_key_heads=d.k_heads,
               linear_num_value_heads=d.v_heads, num_experts=spec.n_experts,
               num_experts_per_tok=spec.n_experts_used, moe_intermediate_size=spec.expert_ffn,
               shared_expert_intermediate_size=spec.shared_ffn, norm_topk_prob=True,
               tie_word_embeddings=spec.tied_output)


def _deltanet_state(t: dict, b: str, spec: ModelSpec) -> dict[str, np.ndarray]:
    """One DeltaNet layer's tensors (GGUF names after "blk.N.") -> transformers' linear_attn.*
    ones."""
    d = spec.deltanet
    hk, hv, dk, dv = d.k_heads, d.v_heads, d.head_dim, d.v_head_dim
    r, nk = hv // hk, hk * dk
    qkv, z = t[b + "attn_qkv.weight"], t[b + "attn_gate.weight"]
    conv = t[b + "ssm_conv1d.weight"]                                            # [C, K]
    a_log, dt = np.log(-t[b + "ssm_a"]), t[b + "ssm_dt.bias"]
    out = t[b + "ssm_out.weight"]                                                # [h, hv * dv]
    # tiled v-heads -> grouped
    if spec.architecture == "qwen35moe":
        grouped = np.array([(h % r) * hk + h // r for h in range(hv)])
        per_dim = lambda m, n: m.reshape(hv, n, *m.shape[1:])[grouped].reshape(m.shape)
        qkv = np.concatenate([qkv[:2 * nk], per_dim(qkv[2 * nk:], dv)])
        conv = np.concatenate([conv[:2 * nk], per_dim(conv[2 * nk:], dv)])
        z, out = per_dim(z, dv), per_dim(out.T, dv).T
        beta, alpha = t[b + "ssm_beta.weight"][grouped], t[b + "ssm_alpha.weight"][grouped]
        a_log, dt = a_log[grouped], dt[grouped]
        s = {"in_proj_qkv.weight": qkv, "in_proj_z.weight": z, "in_proj_b.weight": beta,
             "in_proj_a.weight": alpha}
    else:
        q, k, v = qkv[:nk], qkv[nk:2 * nk], qkv[2 * nk:]
        groups = [np.concatenate([q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk],
                                  v[g * r * dv:(g + 1) * r * dv],
                                  z[g * r * dv:(g + 1) * r * dv]]) for g in range(hk)]
        s = {"in_proj_qkvz.weight": np.concatenate(groups),
             "in_proj_ba.weight": t[b + "ssm_ba.weight"]}
    s |= {"conv1d.weight": conv[:, None, :], "A_log": a_log, "dt_bias": dt,
          "norm.weight": t[b + "ssm_norm.weight"], "out_proj.weight": out}
    return {"linear_attn." + k: v for k, v in s.items()}


def _layer_state(t: dict, i: int, spec: ModelSpec, prefix: str) -> dict[str, np.ndarray]:
    b = f"blk.{i}."
    out = {hf: t[b + g] - (1.0 if g in _ZERO_CENTRED else 0.0)
           for g, hf in (_ATTENTION | _FFN).items() if b + g in t}
    if spec.kind(i) == "deltanet":
        out |= _deltanet_state(t, b, spec)
    out["mlp.experts.gate_up_proj"] = np.concatenate([t[b + "ffn_gate_exps.weight"],
                                                      t[b + "ffn_up_exps.weight"]], 1)
    out["mlp.shared_expert_gate.weight"] = t[b + "ffn_gate_inp_shexp.weight"][None, :]
    return {prefix + k: v for k, v in out.items()}


def load_hybrid(path: str | Path, with_mtp: bool = False):
    """-> Qwen3NextForCausalLM or Qwen3_5MoeForCausalLM (eval, float32) on the file's weights, or
    (model, MtpModel) with `with_mtp`: transformers' generic MTP drafter (modeling_layers.MtpLayer:
    enorm, hnorm, eh_proj, the family's decoder layer as full attention, the shared-head norm as
    post_norm; the main model's embedding and head), the file's NextN block loaded into it. Raises
    if any parameter is left unloaded (it would be random)."""
    import torch
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    gguf = GGUFModel.open(path)
    spec = gguf.spec
    t = {name: info.dequantize().astype(np.float32) for name, info in gguf.tensors.items()}
    torch.manual_seed(0)
    cls = Qwen3NextForCausalLM if spec.architecture == "qwen3next" else Qwen3_5MoeForCausalLM
    config = hybrid_config(spec)
    # read by get_mtp_config()
    config.num_mtp_layers, config.mtp_layer_types = 1, ["full_attention"]
    model = cls(config).float().eval()
    state = {"model.embed_tokens.weight": t["token_embd.weight"],
             "model.norm.weight": t["output_norm.weight"] - 1.0,
             "lm_head.weight": t.get("output.weight", t["token_embd.weight"])}
    for i in range(spec.n_layers):
        state |= _layer_state(t, i, spec, f"model.layers.{i}.")
    load_state(model, state, path)
    if not with_mtp:
        return model
    return model, _mtp_model(model, t, spec, path)


def _mtp_model(model, t: dict, spec: ModelSpec, path):
    """transformers' MtpModel on `model` with blk.{n_layers}'s NextN block (every norm zero-centred:
    -1)."""
    from transformers.modeling_layers import MtpModel

    if not spec.n_nextn:
        raise ValueError("the file has no NextN (MTP) layer")
    i, b = spec.n_layers, f"blk.{spec.n_layers}.nextn."
    mtp = MtpModel(model, 1).float().eval()
    state = _layer_state(t, i, spec, "layers.0.mtp_block.")
    norm = t.get(b + "shared_head_norm.weight", t["output_norm.weight"])
    state |= {"layers.0.enorm.weight": t[b + "enorm.weight"] - 1.0,
              "layers.0.hnorm.weight": t[b + "hnorm.weight"] - 1.0,
              "layers.0.eh_proj.weight": t[b + "eh_proj.weight"],
              "layers.0.post_norm.weight": norm - 1.0}
    load_state(mtp, state, path, shared=("embed_tokens.", "shared_head."))
    use_own_nextn_head(mtp, t, i, spec)
    return mtp
