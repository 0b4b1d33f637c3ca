"""The pieces of a decoder layer, as pure functions. Shapes: R rows (sequences in a window), L tokens a
row, H query heads, K kv heads, D head dim, C cached positions, E experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..gguf import ModelSpec
from .weights import Weight, expert_linear_tiles, linear

import pallas_kernels as pk


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, pos: jax.Array, spec: ModelSpec) -> jax.Array:
    """Rotary embedding of x [R, L, heads, D] at positions pos [R, L].

    llama.cpp's two layouts: "norm" rotates adjacent pairs (llama; its converter permuted q/k for it),
    "neox" rotates the two halves of the rotated dims (Qwen)."""
    d = spec.rope_dims
    inv = 1.0 / (spec.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))          # [d/2]
    if spec.rope_scaling is not None and spec.rope_scaling.type == "linear":
        inv = inv / spec.rope_scaling.factor
    ang = pos.astype(jnp.float32)[..., None, None] * inv                                    # [R, L, 1, d/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xr, rest = x[..., :d].astype(jnp.float32), x[..., d:]
    if spec.rope_type == "neox":
        a, b = xr[..., : d // 2], xr[..., d // 2:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(xr.shape)
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1) if d < x.shape[-1] else out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """q [R, L, H, D] over k, v [R, C, K, D]; key c is visible to query l when k_pos[r, c] <= q_pos[r, l]
    (and k_pos >= 0). -> [R, L, H, D]."""
    R, L, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(R, L, K, H // K, D)
    s = jnp.einsum("rlkgd,rckd->rkglc", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(D))
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)          # [R, L, C]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)                 # rows with nothing visible (padding) give zeros
    o = jnp.einsum("rkglc,rckd->rlkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(R, L, H, D).astype(q.dtype)


def mlp(x: jax.Array, gate: Weight, up: Weight, down: Weight, backend: str) -> jax.Array:
    """SwiGLU: down(silu(gate x) * up x)."""
    return linear(jax.nn.silu(linear(x, gate, backend)) * linear(x, up, backend), down, backend)


def route(x: jax.Array, router: Weight, spec: ModelSpec, backend: str) -> tuple[jax.Array, jax.Array]:
    """Router: x [N, h] -> (weights [N, k] float32, expert ids [N, k] int32), as llama.cpp's build_moe_ffn."""
    logits = linear(x.astype(jnp.float32), router, backend)                                 # [N, E]
    probs = jax.nn.sigmoid(logits) if spec.expert_gating == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    w, ids = jax.lax.top_k(probs, spec.n_experts_used)
    if spec.expert_weights_norm:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * spec.expert_weights_scale, ids.astype(jnp.int32)


def moe(x: jax.Array, p: dict, spec: ModelSpec, backend: str) -> jax.Array:
    """Mixture of experts over x [N, h]: each token's top-k experts, weighted; plus the shared expert."""
    N, h = x.shape
    k = spec.n_experts_used
    w, ids = route(x, p["router"], spec, backend)
    rows = jnp.repeat(x, k, axis=0)                                                         # [N*k, h]
    g = pk.group_rows(ids.reshape(-1), spec.n_experts, pk.expert_tile(backend))
    xt = pk.scatter_rows(rows, g)
    gate = expert_linear_tiles(xt, g.tile_expert, p["exp_gate"], backend)
    up = expert_linear_tiles(xt, g.tile_expert, p["exp_up"], backend)
    y = expert_linear_tiles(jax.nn.silu(gate) * up, g.tile_expert, p["exp_down"], backend)
    y = pk.gather_rows(y, g).reshape(N, k, h).astype(jnp.float32)
    out = jnp.einsum("nkh,nk->nh", y, w)
    if "sh_gate" in p:
        shared = mlp(x, p["sh_gate"], p["sh_up"], p["sh_down"], backend).astype(jnp.float32)
        if "sh_router" in p:
            shared = shared * jax.nn.sigmoid(x.astype(jnp.float32) @ p["sh_router"].astype(jnp.float32))[:, None]
        out = out + shared
    return out.astype(x.dtype)
