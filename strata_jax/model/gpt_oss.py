"""gpt-oss's own pieces (llama.cpp's openai-moe.cpp; transformers' gpt_oss/modeling_gpt_oss.py).

gpt-oss runs on transformer.forward with these differences, each where the shared code reads it:
- attention sinks: a learned logit a head (attn_sinks) that joins the softmax's denominator only,
  not scaled by 1/sqrt(D): p = e^(s - m) / (sum e^(s - m) + e^(sink - m)), m over the scores and the
  sink (sink_softmax_end here; the cpu kernel does the same in pallas_kernels/cpu/attention.cc);
- sliding-window layers (the even ones by default): keys with q_pos - k_pos >= window masked. Their
  KV is bounded to the window, as llama.cpp's iSWA cache: a ring a slot of window + T entries (T the
  most tokens a slot reads in one window), position p at entry p % ring (transformer.py's
  ring_shapes, _ring_attention). The ring is a slot's state, as a hybrid family's DeltaNet state:
  the prefix cache resumes a request only at the slot's live state or a state checkpoint
  (engine/families.keeps_state, engine/schedule/state_checkpoints.py), and the ledger counts it at
  its entries (kv_cache.kv_bytes);
- biases on q, k, v and attn_output; the router's bias on its logits, the top-k of the logits then a
  softmax over those k (SOFTMAX_WEIGHT, layers.route);
- the experts' biases (params.ExpertBiases) and the clamped SwiGLU, swiglu_oai below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants (llama-graph.cpp; transformers' swiglu_alpha/limit)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def swiglu_oai(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gpt-oss's clamped SwiGLU of the biased gate and up (ggml-cpu/ops.cpp swiglu_oai): the gate is
    clamped above only, the up both ways, and up gets +1."""
    g = jnp.minimum(gate, SWIGLU_LIMIT)
    u = jnp.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
    return g * jax.nn.sigmoid(SWIGLU_ALPHA * g) * (u + 1.0)


def sink_softmax_end(m: jax.Array, s: jax.Array, acc: jax.Array, sinks: jax.Array):
    """The online softmax's end state (running max m and sum s [..., H-like], acc [..., Dv]) with
    each head's sink logit `sinks` (broadcast to m) joined to the denominator -> (s, acc) to divide.
    A row with no key (m = -inf: padding) keeps acc 0."""
    sinks = sinks.astype(jnp.float32)
    m_new = jnp.maximum(m, sinks)
    keep = jnp.where(jnp.isfinite(m), jnp.exp(m - m_new), 0.0)
    return s * keep + jnp.exp(sinks - m_new), acc * keep[..., None]
