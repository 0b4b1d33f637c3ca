"""The hybrid Gated DeltaNet + MoE families (qwen3next, qwen35moe) for make_model: their layers'
tensors and metadata keys, with llama.cpp's names and shapes (src/models/qwen3next.cpp /
qwen35moe.cpp; gguf-py's MODEL_TENSORS). Layer i is full (gated) attention when (i + 1) %
full_attention_interval == 0, else a Gated DeltaNet ("recurrent") layer; the NextN (MTP) block after
the main layers is gated attention; every layer's FFN is routed experts plus a sigmoid-gated shared
expert.

Shapes here are numpy order ([rows, cols]): GGUF's {cols, rows} reversed.
"""

from __future__ import annotations

import math
from typing import Any

from gguf import GGUFValueType

HYBRID_ARCHS = ("qwen3next", "qwen35moe")


def is_recurrent(layer: int, interval: int, n_layers: int) -> bool:
    """llama.cpp's default layer pattern: every `interval`-th layer is full attention, and so is the
    NextN (MTP) block after the `n_layers` main ones."""
    return layer < n_layers and (layer + 1) % interval != 0


def hybrid_layer_tensors(b: str, layer: int, o: Any, weight, f32, norm, quant, attn_q,
                         expert_q) -> list:
    """Block `b` (= "blk.N.") of a hybrid model: its mixing tensors (gated attention or Gated
    DeltaNet), then the MoE FFN with its gated shared expert. `weight`, `f32`, `norm`: make_model's
    planners."""
    h, hd, residual = o.hidden, o.head_dim, 1.0 / math.sqrt(2 * o.layers)
    plan = [norm(b + "attn_norm.weight", (h,))]
    if is_recurrent(layer, o.full_attention_interval, o.layers):
        hk, hv, dk = o.ssm_k_heads, o.ssm_v_heads, o.ssm_head_dim
        qkv, inner = 2 * hk * dk + hv * dk, hv * dk
        plan += [weight(b + "attn_qkv.weight", (qkv, h), attn_q, 1 / math.sqrt(h)),
                 weight(b + "attn_gate.weight", (inner, h), attn_q, 1 / math.sqrt(h)),
                 f32(b + "ssm_conv1d.weight", (qkv, o.ssm_conv), 0.0, 1 / math.sqrt(o.ssm_conv)),
                 f32(b + "ssm_dt.bias", (hv,), 0.0, 0.5),
                 # -exp(A_log): the converter's sign
                 f32(b + "ssm_a", (hv,), -1.0, 0.2),
                 norm(b + "ssm_norm.weight", (dk,)),
                 weight(b + "ssm_out.weight", (h, inner), attn_q, residual / math.sqrt(inner))]
        # beta and alpha in one matrix, per k-head groups
        if o.arch == "qwen3next":
            plan.append(weight(b + "ssm_ba.weight", (2 * hv, h), attn_q, 1 / math.sqrt(h)))
        else:
            plan += [weight(b + "ssm_beta.weight", (hv, h), attn_q, 1 / math.sqrt(h)),
                     weight(b + "ssm_alpha.weight", (hv, h), attn_q, 1 / math.sqrt(h))]
    else:
        q, kv = o.heads * hd, o.kv_heads * hd
        # each head: [q | gate]
        plan += [weight(b + "attn_q.weight", (2 * q, h), attn_q, 1 / math.sqrt(h)),
                 weight(b + "attn_k.weight", (kv, h), attn_q, 1 / math.sqrt(h)),
                 weight(b + "attn_v.weight", (kv, h), attn_q, 1 / math.sqrt(h)),
                 norm(b + "attn_q_norm.weight", (hd,)), norm(b + "attn_k_norm.weight", (hd,)),
                 weight(b + "attn_output.weight", (h, q), attn_q, residual / math.sqrt(q))]
    e, f, s = o.experts, o.expert_ffn, o.shared_ffn
    plan += [norm(b + "post_attention_norm.weight", (h,)),
             f32(b + "ffn_gate_inp.weight", (e, h), 0.0, 1 / math.sqrt(h)),
             weight(b + "ffn_gate_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
             weight(b + "ffn_up_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
             weight(b + "ffn_down_exps.weight", (e, h, f), expert_q, residual / math.sqrt(f)),
             f32(b + "ffn_gate_inp_shexp.weight", (h,), 0.0, 1 / math.sqrt(h)),
             weight(b + "ffn_gate_shexp.weight", (s, h), quant, 1 / math.sqrt(h)),
             weight(b + "ffn_up_shexp.weight", (s, h), quant, 1 / math.sqrt(h)),
             weight(b + "ffn_down_shexp.weight", (h, s), quant, residual / math.sqrt(s))]
    return plan


def hybrid_keys(o: Any) -> dict[str, tuple[Any, tuple]]:
    """The family's own metadata keys (beside make_model's common ones), as convert_hf_to_gguf.py
    writes them."""
    u32 = (GGUFValueType.UINT32, None)
    a = o.arch
    keys = {f"{a}.ssm.conv_kernel": (o.ssm_conv, u32),
            f"{a}.ssm.state_size": (o.ssm_head_dim, u32),
            f"{a}.ssm.group_count": (o.ssm_k_heads, u32),
            f"{a}.ssm.time_step_rank": (o.ssm_v_heads, u32),
            f"{a}.ssm.inner_size": (o.ssm_v_heads * o.ssm_head_dim, u32),
            f"{a}.full_attention_interval": (o.full_attention_interval, u32),
            f"{a}.expert_shared_feed_forward_length": (o.shared_ffn, u32)}
    # multimodal rope sections (text positions use the first rope_dims / 2 pairs)
    if a == "qwen35moe":
        half = o.rope_dims // 2
        first = math.ceil(half * 11 / 32)
        sections = [first, first, half - 2 * first, 0] if half >= 2 * first else [half, 0, 0, 0]
        keys[f"{a}.rope.dimension_sections"] = (sections,
                                                (GGUFValueType.ARRAY, GGUFValueType.INT32))
    return keys
