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
    attn_chunk: int = 256           # keys an attention step reads; kv lengths are multiples of it


def new_kv_cache(spec: ModelSpec, n_slots: int, max_context: int, dtype) -> dict[str, jax.Array]:
    """Keys and values [layers, slots, max_context + 1, kv_heads, head_dim]; the extra position is where
    padding tokens write, and no query ever reads it."""
    shape = (spec.n_layers, n_slots, max_context + 1, spec.n_kv_heads, spec.head_dim)
    vshape = shape[:-1] + (spec.value_dim,)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(vshape, dtype)}


@dataclass(frozen=True)
class Group:
    """Rows of a window that share a shape: R rows of L tokens. A window is a few groups (decode rows,
    a prefill chunk, draft-verify rows); each group gets its own matmuls, so a row's arithmetic (and so
    its bits) depends only on its group's shape, never on what else the window holds."""
    tokens: jax.Array        # [R, L] int32
    pos: jax.Array           # [R, L] int32, -1: padding (real tokens first)
    slots: jax.Array         # [R] int32
    all_logits: bool = False  # static: logits of every token, else of each row's last real token

    def tree_flatten(self):
        return (self.tokens, self.pos, self.slots), (self.all_logits,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


jax.tree_util.register_pytree_node_class(Group)


def forward(params: dict, spec: ModelSpec, opts: RunOptions, groups: tuple[Group, ...],
            cache: dict[str, jax.Array], kv_len: int):
    """One window -> (logits float32 per group: [R, V] or [R, L, V] with all_logits; the updated cache).

    The layers are unrolled: under lax.scan programs build 3x faster, but each step copies every layer's
    weights out of the stacked array (XLA:CPU does not fuse the slice into the dot): 8.6 against 10.4
    tok/s on SmolLM2."""
    dtype = jnp.dtype(opts.dtype)
    xs = [embed_rows(params["embed"], g.tokens, dtype) for g in groups]               # [R, L, h] each
    ck, cv = cache["k"], cache["v"]
    for i, lp in enumerate(params["layers"]):
        xs, ck, cv = _layer(lp, i, spec, opts, groups, xs, ck, cv, kv_len)
    out = []
    for x, g in zip(xs, groups):
        x = rms_norm(x, params["norm"], spec.rms_eps)
        if not g.all_logits:
            R = x.shape[0]
            last = jnp.maximum(jnp.sum(g.pos >= 0, axis=1) - 1, 0)
            x = x[jnp.arange(R), last]                                                 # [R, h]
        out.append(linear(x, params["output"], opts.backend).astype(jnp.float32))
    return out, {"k": ck, "v": cv}


def _layer(lp: dict, i, spec: ModelSpec, opts: RunOptions, groups, xs, ck, cv, kv_len: int):
    """Decoder layer i over every group of the window: attention (writing the new keys and values into
    the cache first) and the FFN or experts."""
    dtype = jnp.dtype(opts.dtype)
    H, K, D, Dv = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.value_dim
    scratch = ck.shape[2] - 1
    xs = list(xs)
    for n, g in enumerate(groups):
        x = xs[n]
        R, L = g.tokens.shape
        hx = rms_norm(x, lp["attn_norm"], spec.rms_eps)
        q = linear(hx, lp["wq"], opts.backend)
        k = linear(hx, lp["wk"], opts.backend)
        v = linear(hx, lp["wv"], opts.backend)
        if "bq" in lp:
            q, k, v = q + lp["bq"].astype(dtype), k + lp["bk"].astype(dtype), v + lp["bv"].astype(dtype)
        q, k, v = q.reshape(R, L, H, D), k.reshape(R, L, K, D), v.reshape(R, L, K, Dv)
        if "q_norm" in lp:
            q, k = rms_norm(q, lp["q_norm"], spec.rms_eps), rms_norm(k, lp["k_norm"], spec.rms_eps)
        q, k = rope(q, g.pos, spec), rope(k, g.pos, spec)
        write_at = jnp.where(g.pos >= 0, g.pos, scratch)                               # [R, L]
        ck = ck.at[i, g.slots[:, None], write_at].set(k.astype(ck.dtype))
        cv = cv.at[i, g.slots[:, None], write_at].set(v.astype(cv.dtype))
        keys = ck[i, g.slots, :kv_len].astype(dtype)                                   # [R, kv_len, K, D]
        vals = cv[i, g.slots, :kv_len].astype(dtype)
        o = attend(q, keys, vals, g.pos, min(opts.attn_chunk, kv_len))                 # [R, L, H, Dv]
        x = x + linear(o.reshape(R, L, H * Dv), lp["wo"], opts.backend)
        hx = rms_norm(x, lp["ffn_norm"], spec.rms_eps)
        if "router" in lp:
            ffn = moe(hx.reshape(R * L, -1), lp, spec, opts.backend).reshape(R, L, -1)
        else:
            ffn = mlp(hx, lp["w_gate"], lp["w_up"], lp["w_down"], opts.backend)
        xs[n] = x + ffn
    return xs, ck, cv
