"""gpt-oss for make_model: its layers' tensors and metadata keys, with llama.cpp's names and shapes
(src/models/openai-moe.cpp; gguf-py's MODEL_TENSORS[MODEL_ARCH.GPT_OSS]; conversion/gpt_oss.py).

Every layer: attention with q/k/v/output biases and a sink logit a head (attn_sinks.weight), the
FFN norm (post_attention_norm), a biased router and biased experts (no shared expert). The layers
that use the sliding window are llama.cpp's default pattern (attention.sliding_window_pattern
unset: 2, the even layers). Rope is plain NEOX at rope.freq_base; with `yarn_factor` the file
also carries the YaRN keys the converter writes (rope.scaling.type yarn, factor,
original_context_length).
With the built-in tokenizer the file speaks harmony as a real one does: gpt-oss's own chat
template and its special tokens (<|start|>, <|channel|>, <|message|>, <|end|>, <|return|>, <|call|>,
<|constrain|>) as control tokens (makers/family_chat.py); the experts are MXFP4 unless
--expert-quant says otherwise.

Shapes here are numpy order ([rows, cols]): GGUF's {cols, rows} reversed.
"""

from __future__ import annotations

import math
from typing import Any

from gguf import GGUFValueType

GPT_OSS = "gpt-oss"
# The experts' quant type when --expert-quant is not given: the real models' type.
DEFAULT_EXPERT_QUANT = "MXFP4"
DEFAULT_SLIDING_WINDOW = 8


def gpt_oss_layer_tensors(b: str, o: Any, weight, f32, norm, attn_q, expert_q) -> list:
    """Block `b` (= "blk.N.") of a gpt-oss model. `weight`, `f32`, `norm`: make_model's planners."""
    h, hd, residual = o.hidden, o.head_dim, 1.0 / math.sqrt(2 * o.layers)
    q, kv = o.heads * hd, o.kv_heads * hd
    e, f = o.experts, o.expert_ffn
    return [norm(b + "attn_norm.weight", (h,)),
            weight(b + "attn_q.weight", (q, h), attn_q, 1 / math.sqrt(h)),
            weight(b + "attn_k.weight", (kv, h), attn_q, 1 / math.sqrt(h)),
            weight(b + "attn_v.weight", (kv, h), attn_q, 1 / math.sqrt(h)),
            f32(b + "attn_q.bias", (q,), 0.0, 0.1),
            f32(b + "attn_k.bias", (kv,), 0.0, 0.1),
            f32(b + "attn_v.bias", (kv,), 0.0, 0.1),
            weight(b + "attn_output.weight", (h, q), attn_q, residual / math.sqrt(q)),
            f32(b + "attn_output.bias", (h,), 0.0, 0.05),
            # sink logits of the scores' size: each head gives the sink a real share
            f32(b + "attn_sinks.weight", (o.heads,), 0.0, 1.0),
            norm(b + "post_attention_norm.weight", (h,)),
            f32(b + "ffn_gate_inp.weight", (e, h), 0.0, 1 / math.sqrt(h)),
            f32(b + "ffn_gate_inp.bias", (e,), 0.0, 0.1),
            weight(b + "ffn_gate_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
            weight(b + "ffn_up_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
            weight(b + "ffn_down_exps.weight", (e, h, f), expert_q, residual / math.sqrt(f)),
            f32(b + "ffn_gate_exps.bias", (e, f), 0.0, 0.1),
            f32(b + "ffn_up_exps.bias", (e, f), 0.0, 0.1),
            f32(b + "ffn_down_exps.bias", (e, h), 0.0, 0.05)]


def gpt_oss_keys(o: Any) -> dict[str, tuple[Any, tuple]]:
    """The family's own metadata keys (beside make_model's common ones), as convert_hf_to_gguf.py
    writes them."""
    u32, f32, s = ((GGUFValueType.UINT32, None), (GGUFValueType.FLOAT32, None),
                   (GGUFValueType.STRING, None))
    keys = {f"{GPT_OSS}.attention.sliding_window": (o.sliding_window, u32)}
    if o.yarn_factor:
        keys |= {f"{GPT_OSS}.rope.scaling.type": ("yarn", s),
                 f"{GPT_OSS}.rope.scaling.factor": (o.yarn_factor, f32),
                 f"{GPT_OSS}.rope.scaling.original_context_length": (o.yarn_original_context,
                                                                      u32)}
    return keys
