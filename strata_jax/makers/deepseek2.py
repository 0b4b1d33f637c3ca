"""The deepseek2 family (DeepSeek-V2/V3/R1) for make_model: its layers' tensors and metadata keys,
with llama.cpp's names and shapes (src/models/deepseek2.cpp; gguf-py's
MODEL_TENSORS[MODEL_ARCH.DEEPSEEK2]; conversion/deepseek.py's keys). Multi-head Latent Attention
(q through a low-rank q_lora, or a Lite-style attn_q with --q-lora 0; the kv latent and shared rope
key from attn_kv_a_mqa; attn_k_b / attn_v_b as the converter splits kv_b, or the legacy attn_kv_b);
the first --leading-dense layers a dense FFN, the rest (and the NextN (MTP) block that --nextn 1
stores after them, blk.N.nextn.*) a sigmoid router with group-limited top-k, a
random correction bias (exp_probs_b) and ungated shared experts.

Shapes here are numpy order ([rows, cols]): GGUF's {cols, rows} reversed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from gguf import GGUFValueType

# make_model's fields only deepseek2 reads (None elsewhere), and their tiny defaults (as
# families-spec.md 3.5's HF oracle)
DEEPSEEK_DEFAULTS = {"q_lora": 48, "kv_lora": 32, "nope_dim": 16, "v_head_dim": 16,
                     "expert_groups": 4, "expert_groups_used": 2, "yarn_factor": 0}


def deepseek2_resolved(o: Any, experts: int) -> Any:
    """o (make_model's ModelOptions) with deepseek2's defaults filled in and checked."""
    o = replace(o, **{k: v for k, v in DEEPSEEK_DEFAULTS.items() if getattr(o, k) is None})
    for flag in ("kv_lora", "nope_dim", "v_head_dim", "expert_groups", "expert_groups_used"):
        if getattr(o, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1 (got "
                             f"{getattr(o, flag)})")
    if o.q_lora < 0 or o.yarn_factor < 0:
        raise ValueError(f"--q-lora and --yarn-factor must be 0 or more (got {o.q_lora}, "
                         f"{o.yarn_factor})")
    if o.qk_norm:
        raise ValueError("--qk-norm is for --arch glm4moe (deepseek2 has no per-head q/k norms)")
    if o.nextn not in (0, 1):      # llama.cpp's deepseek2 MTP graph runs one block
        raise ValueError(f"--nextn must be 0 or 1 for deepseek2 (got {o.nextn})")
    if o.nextn_head and not o.nextn:
        raise ValueError("--nextn-head needs --nextn 1")
    if o.nextn and (not o.q_lora or o.legacy_kv_b):
        raise ValueError("--nextn 1: llama.cpp's deepseek2 MTP block needs q_lora (--q-lora > 0) "
                         "and attn_k_b / attn_v_b (not --legacy-kv-b)")
    g, used = o.expert_groups, o.expert_groups_used
    if experts % g or used > g or o.experts_used > used * (experts // g):
        raise ValueError(f"--expert-groups {g} must divide --experts {experts}, "
                         f"--expert-groups-used {used} be at most {g}, and --experts-used "
                         f"{o.experts_used} at most the kept groups' {used * (experts // g)} "
                         "experts")
    if o.shared_ffn % o.expert_ffn:
        raise ValueError("deepseek2's shared experts are expert_shared_count experts wide: "
                         f"--shared-ffn {o.shared_ffn} must be a multiple of --expert-ffn "
                         f"{o.expert_ffn}")
    rope = 8 if o.rope_dims is None else o.rope_dims
    if rope < 2 or rope % 2:
        raise ValueError(f"--rope-dims must be even and at least 2 (got {rope})")
    leading = 1 if o.leading_dense is None else o.leading_dense
    if not 0 <= leading < o.layers:
        raise ValueError(f"--leading-dense must be 0..{o.layers - 1} (got {leading})")
    scale = 2.5 if o.expert_weights_scale is None else o.expert_weights_scale
    # head_dim: the cache's key width (latent + rope), as attention.key_length says
    return replace(o, experts=experts, head_dim=o.kv_lora + rope, rope_dims=rope,
                   leading_dense=leading, expert_weights_scale=scale)


def deepseek2_layer_tensors(b: str, layer: int, o: Any, weight, f32, norm, quant, attn_q,
                            expert_q) -> list:
    """Block `b` (= "blk.N.") of a deepseek2 model. `weight`, `f32`, `norm`: make_model's
    planners."""
    h, H, r = o.hidden, o.heads, 1.0 / math.sqrt(2 * o.layers)
    qk = o.nope_dim + o.rope_dims
    plan = [norm(b + "attn_norm.weight", (h,))]
    if o.q_lora:
        plan += [weight(b + "attn_q_a.weight", (o.q_lora, h), attn_q, 1 / math.sqrt(h)),
                 norm(b + "attn_q_a_norm.weight", (o.q_lora,)),
                 weight(b + "attn_q_b.weight", (H * qk, o.q_lora), attn_q, 1 / math.sqrt(o.q_lora))]
    else:
        plan.append(weight(b + "attn_q.weight", (H * qk, h), attn_q, 1 / math.sqrt(h)))
    plan += [weight(b + "attn_kv_a_mqa.weight", (o.kv_lora + o.rope_dims, h), attn_q,
                    1 / math.sqrt(h)),
             norm(b + "attn_kv_a_norm.weight", (o.kv_lora,))]
    if o.legacy_kv_b:
        plan.append(weight(b + "attn_kv_b.weight", (H * (o.nope_dim + o.v_head_dim), o.kv_lora),
                           attn_q, 1 / math.sqrt(o.kv_lora)))
    else:  # the converter's split: k_b transposed per head, v_b as it was
        plan += [weight(b + "attn_k_b.weight", (H, o.kv_lora, o.nope_dim), attn_q,
                        1 / math.sqrt(o.kv_lora)),
                 weight(b + "attn_v_b.weight", (H, o.v_head_dim, o.kv_lora), attn_q,
                        1 / math.sqrt(o.kv_lora))]
    plan += [weight(b + "attn_output.weight", (h, H * o.v_head_dim), attn_q,
                    r / math.sqrt(H * o.v_head_dim)),
             norm(b + "ffn_norm.weight", (h,))]
    if layer < o.leading_dense:
        return plan + [weight(b + "ffn_gate.weight", (o.ffn, h), quant, 1 / math.sqrt(h)),
                       weight(b + "ffn_up.weight", (o.ffn, h), quant, 1 / math.sqrt(h)),
                       weight(b + "ffn_down.weight", (h, o.ffn), quant, r / math.sqrt(o.ffn))]
    e, f, s = o.experts, o.expert_ffn, o.shared_ffn
    return plan + [
        f32(b + "ffn_gate_inp.weight", (e, h), 0.0, 1 / math.sqrt(h)),
        # the correction bias: large against the sigmoid scores' gaps, so it changes choices
        f32(b + "exp_probs_b.bias", (e,), 0.0, 0.1),
        weight(b + "ffn_gate_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
        weight(b + "ffn_up_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
        weight(b + "ffn_down_exps.weight", (e, h, f), expert_q, r / math.sqrt(f)),
        weight(b + "ffn_gate_shexp.weight", (s, h), quant, 1 / math.sqrt(h)),
        weight(b + "ffn_up_shexp.weight", (s, h), quant, 1 / math.sqrt(h)),
        weight(b + "ffn_down_shexp.weight", (h, s), quant, r / math.sqrt(s))]


def deepseek2_keys(o: Any) -> dict[str, tuple[Any, tuple]]:
    """The family's keys, as conversion/deepseek.py writes them (over make_model's common ones:
    the MQA view of MLA, one kv head of kv_lora + rope)."""
    u32, f32 = (GGUFValueType.UINT32, None), (GGUFValueType.FLOAT32, None)
    a, rope = o.arch, o.rope_dims
    keys = {f"{a}.attention.head_count_kv": (1, u32),
            f"{a}.attention.kv_lora_rank": (o.kv_lora, u32),
            f"{a}.attention.key_length": (o.kv_lora + rope, u32),
            f"{a}.attention.value_length": (o.kv_lora, u32),
            f"{a}.attention.key_length_mla": (o.nope_dim + rope, u32),
            f"{a}.attention.value_length_mla": (o.v_head_dim, u32),
            f"{a}.leading_dense_block_count": (o.leading_dense, u32),
            f"{a}.expert_shared_count": (o.shared_ffn // o.expert_ffn, u32),
            f"{a}.expert_weights_scale": (o.expert_weights_scale, f32),
            f"{a}.expert_weights_norm": (True, (GGUFValueType.BOOL, None)),
            f"{a}.expert_gating_func": (2, u32),  # sigmoid
            f"{a}.expert_group_count": (o.expert_groups, u32),
            f"{a}.expert_group_used_count": (o.expert_groups_used, u32)}
    if o.legacy_kv_b:  # an older converter's file: no *_mla keys, the per-head sizes as MHA's
        keys |= {f"{a}.attention.head_count_kv": (o.heads, u32),
                 f"{a}.attention.key_length": (o.nope_dim + rope, u32),
                 f"{a}.attention.value_length": (o.v_head_dim, u32)}
        del keys[f"{a}.attention.key_length_mla"], keys[f"{a}.attention.value_length_mla"]
    if o.nextn:
        keys[f"{a}.nextn_predict_layers"] = (o.nextn, u32)
    if o.q_lora:  # the converter leaves it out for Lite
        keys[f"{a}.attention.q_lora_rank"] = (o.q_lora, u32)
    if o.yarn_factor:
        keys |= {f"{a}.rope.scaling.type": ("yarn", (GGUFValueType.STRING, None)),
                 f"{a}.rope.scaling.factor": (float(o.yarn_factor), f32),
                 f"{a}.rope.scaling.original_context_length": (int(o.context // o.yarn_factor),
                                                               u32),
                 # mscale_all_dim 1.0 (V3's), stored x0.1 as the converter does
                 f"{a}.rope.scaling.yarn_log_multiplier": (0.1, f32)}
    return keys
