"""The decoder forward pass shared by the supported families (llama, qwen2, qwen3, qwen2moe, qwen3moe).

They differ only where ModelSpec says so: rope layout, q/k/v biases (qwen2*), per-head q/k norms
(qwen3*), experts in place of the dense FFN (with a gated shared expert for qwen2moe).

One call runs one window: R rows (one per slot), each with L tokens at positions `pos` (-1: padding).
New keys and values are written into the slot's cache rows first, then every query attends to its
slot's cached positions up to `kv_len` (a static bucket, so a handful of programs cover all lengths).
Slot ids and positions are dynamic inputs: they never multiply compiled programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..gguf import ModelSpec
from .layers import attend, mlp, moe, rms_norm, rope
from .weights import embed_rows, linear


@dataclass(frozen=True)
class RunOptions:
    """How to run the math (static: part of a program's identity)."""
    dtype: str = "float32"          # activations: float32 on a CPU, bfloat16 on a GPU
    backend: str = "xla"            # pallas_kernels backend for weights kept in blocks


def new_kv_cache(spec: ModelSpec, n_slots: int, max_context: int, dtype) -> dict[str, jax.Array]:
    """Keys and values [layers, slots, max_context + 1, kv_heads, head_dim]; the extra position is where
    padding tokens write, and no query ever reads it."""
    shape = (spec.n_layers, n_slots, max_context + 1, spec.n_kv_heads, spec.head_dim)
    vshape = shape[:-1] + (spec.value_dim,)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(vshape, dtype)}


def forward(params: dict, spec: ModelSpec, opts: RunOptions, tokens: jax.Array, pos: jax.Array,
            slots: jax.Array, cache: dict[str, jax.Array], kv_len: int, all_logits: bool = False):
    """tokens, pos [R, L] int32; slots [R] int32 -> (logits float32 [R, V] of each row's last real token,
    or [R, L, V] with all_logits; the updated cache)."""
    dtype = jnp.dtype(opts.dtype)
    R, L = tokens.shape
    H, K, D, Dv = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.value_dim
    scratch = cache["k"].shape[2] - 1
    write_at = jnp.where(pos >= 0, pos, scratch)                                  # [R, L]
    k_pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (R, kv_len))
    x = embed_rows(params["embed"], tokens, dtype)                                 # [R, L, h]
    ck, cv = cache["k"], cache["v"]
    for i, lp in enumerate(params["layers"]):
        hx = rms_norm(x, lp["attn_norm"], spec.rms_eps)
        q = linear(hx, lp["wq"], opts.backend)
        k = linear(hx, lp["wk"], opts.backend)
        v = linear(hx, lp["wv"], opts.backend)
        if "bq" in lp:
            q, k, v = q + lp["bq"].astype(dtype), k + lp["bk"].astype(dtype), v + lp["bv"].astype(dtype)
        q, k, v = q.reshape(R, L, H, D), k.reshape(R, L, K, D), v.reshape(R, L, K, Dv)
        if "q_norm" in lp:
            q, k = rms_norm(q, lp["q_norm"], spec.rms_eps), rms_norm(k, lp["k_norm"], spec.rms_eps)
        q, k = rope(q, pos, spec), rope(k, pos, spec)
        ck = ck.at[i, slots[:, None], write_at].set(k.astype(ck.dtype))
        cv = cv.at[i, slots[:, None], write_at].set(v.astype(cv.dtype))
        keys = ck[i, slots, :kv_len].astype(dtype)                                 # [R, kv_len, K, D]
        vals = cv[i, slots, :kv_len].astype(dtype)
        o = attend(q, keys, vals, pos, k_pos)                                      # [R, L, H, Dv]
        x = x + linear(o.reshape(R, L, H * Dv), lp["wo"], opts.backend)
        hx = rms_norm(x, lp["ffn_norm"], spec.rms_eps)
        if "router" in lp:
            ffn = moe(hx.reshape(R * L, -1), lp, spec, opts.backend).reshape(R, L, -1)
        else:
            ffn = mlp(hx, lp["w_gate"], lp["w_up"], lp["w_down"], opts.backend)
        x = x + ffn
    x = rms_norm(x, params["norm"], spec.rms_eps)
    if not all_logits:
        last = jnp.maximum(jnp.sum(pos >= 0, axis=1) - 1, 0)                       # real tokens come first
        x = x[jnp.arange(R), last]                                                 # [R, h]
    logits = linear(x.astype(jnp.float32) if dtype == jnp.float32 else x, params["output"], opts.backend)
    return logits.astype(jnp.float32), {"k": ck, "v": cv}
