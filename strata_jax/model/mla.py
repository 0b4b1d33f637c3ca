"""Multi-head Latent Attention (the deepseek2 family: DeepSeek-V2/V3/R1; llama.cpp
src/models/deepseek2.cpp, transformers' DeepseekV3Attention).

A token's keys and values are decompressed per head from a latent c (kv_lora values, RMS-normed)
and a rope key k_pe (rope values) shared by every head: k_h = [W_kb,h c ; k_pe], v_h = W_vb,h c. The
cache keeps only [c ; k_pe] (ONE kv head of kv_lora + rope values; no values: they are a view of the
keys' first kv_lora, ModelSpec.cached_value_dim), and attention runs in the absorbed form: each
head's query q~_h = [W_kb,h^T q_nope,h ; q_pe,h] against [c ; k_pe] (q~.k = q_nope.k_nope +
q_pe.k_pe exactly), the softmax-weighted latents o_lat,h mapped out by o_h = W_vb,h o_lat,h. So it
is multi-query attention over 576 values a key for V3 (the other families' kernels), then one small
product a head. `unabsorbed` is the textbook form over the same cache, for the tests.

The kq scale is mscale^2 / sqrt(nope + rope) with YaRN's mscale (not 1/sqrt(kv_lora + rope)); rope
rotates adjacent pairs (llama.cpp's NORM type; transformers' rope_interleave) of q_pe and k_pe only,
with YaRN's frequencies (yarn_rope: llama.cpp's ggml_rope_yarn_corr_dims arithmetic).

The cpu backend's C++ kernel reads the cache in place: given the key cache as its value cache too,
it attends over [c ; k_pe] as values (kv_lora + rope wide) and the first kv_lora of its output are
o_lat (the rope part of the values, 1/9 more work for V3, is dropped): no copy, no kernel change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import jax
import jax.numpy as jnp

import pallas_kernels as pk

from ..gguf import ModelSpec
from ..gguf.mla import MlaSpec
from .layers import attend, norm_linear_many
from .params import LayerWeights, Mlp, Router
from .rope_yarn import yarn_frequencies
from .weights import Weight, linear

# GGUF tensor name (after "blk.N.") -> our short name, beside load.py's _LAYER_TENSORS.
MLA_TENSORS = {"attn_q_a.weight": "wq_a", "attn_q_a_norm.weight": "q_a_norm",
               "attn_q_b.weight": "wq_b", "attn_kv_a_mqa.weight": "wkv_a",
               "attn_kv_a_norm.weight": "kv_a_norm", "attn_k_b.weight": "wk_b",
               "attn_v_b.weight": "wv_b", "attn_kv_b.weight": "wkv_b"}
# Per-head 3-D matrices, not products' 2-D weights: kept dequantized, in the file's numpy layout
# (wk_b [H, kv_lora, nope], wv_b [H, v, kv_lora]; the legacy wkv_b [H * (nope + v), kv_lora]).
MLA_PER_HEAD = frozenset({"wk_b", "wv_b", "wkv_b"})
MLA_NORMS = frozenset({"q_a_norm", "kv_a_norm"})


def _pytree(cls):
    return jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in fields(cls)],
                                            meta_fields=[])


@_pytree
@dataclass(frozen=True)
class MlaWeights:
    """A deepseek2 decoder layer. Attention: attn_norm; q from wq_a, its norm q_a_norm and wq_b
    (or one wq where the file has no q_lora: Lite); wkv_a (latent and rope key), kv_a_norm;
    wk_b [H, kv_lora, nope] and wv_b [H, v, kv_lora]; wo. The FFN as LayerWeights' (mlp, or
    router, experts and ungated shared experts), which transformer.ffn_half and layers.moe read."""
    attn_norm: jax.Array
    wkv_a: Weight
    kv_a_norm: jax.Array
    wk_b: jax.Array
    wv_b: jax.Array
    wo: Weight
    ffn_norm: jax.Array
    wq: Weight | None = None
    wq_a: Weight | None = None
    q_a_norm: jax.Array | None = None
    wq_b: Weight | None = None
    mlp: Mlp | None = None
    router: Router | None = None
    experts: dict[str, Weight] | None = None
    shared: Mlp | None = None
    # what layers.moe and the expert stages read of every family's layer: deepseek2's experts
    # have no biases (gpt-oss's do)
    expert_biases: None = None

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def with_experts(self, experts: dict[str, Weight] | None) -> MlaWeights:
        return replace(self, experts=experts)

    @classmethod
    def from_named(cls, t: dict, mla: MlaSpec) -> MlaWeights:
        """From load.py's short names; a legacy file's wkv_b split per head here, as llama.cpp's
        converter splits it (conversion/deepseek.py)."""
        wk_b, wv_b = t.get("wk_b"), t.get("wv_b")
        if "wkv_b" in t:
            kv = t["wkv_b"].reshape(-1, mla.nope + mla.v_head, mla.kv_lora)
            wk_b, wv_b = jnp.swapaxes(kv[:, :mla.nope], 1, 2), kv[:, mla.nope:]
        common = LayerWeights.from_named(t | {n: None for n in ("wq", "wk", "wv", "wo")})
        return cls(t["attn_norm"], t["wkv_a"], t["kv_a_norm"], wk_b, wv_b, t["wo"],
                   t["ffn_norm"], wq=t.get("wq"), wq_a=t.get("wq_a"), q_a_norm=t.get("q_a_norm"),
                   wq_b=t.get("wq_b"), mlp=common.mlp, router=common.router,
                   experts=common.experts, shared=common.shared)


# ---- YaRN (llama.cpp's arithmetic: llama-context.cpp's attn_factor, ggml's rope_yarn) ----------

def _get_mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def yarn_magnitude(spec: ModelSpec) -> float | None:
    """The rope's cos/sin magnitude under YaRN, else None (no YaRN). For deepseek2 llama.cpp takes
    mscale = mscale_all_dim, so it is 1 with a yarn_log_multiplier, and (1 + 0.1 ln factor) without
    one. The frequencies are rope_yarn's, as gpt-oss's."""
    rs = spec.rope_scaling
    if rs is None or rs.type != "yarn" or rs.factor <= 1.0:
        return None
    return 1.0 if spec.mla.yarn_log_mul else _get_mscale(rs.factor, 1.0)


def kq_scale(spec: ModelSpec) -> float:
    """mscale^2 / sqrt(nope + rope): deepseek2.cpp's kq_scale (mscale = the rope magnitude x (1 +
    0.1 mscale_all_dim ln factor) under YaRN, else 1)."""
    magnitude = yarn_magnitude(spec)
    mscale = 1.0
    if magnitude is not None:
        log_factor = math.log(spec.rope_scaling.factor)
        mscale = magnitude * (1.0 + 0.1 * spec.mla.yarn_log_mul * log_factor)
    return mscale * mscale / math.sqrt(spec.mla.qk_head)


def yarn_rope(x: jax.Array, pos: jax.Array, spec: ModelSpec) -> jax.Array:
    """Rope of x [R, L, heads, rope] at positions pos [R, L]: adjacent pairs (llama.cpp's NORM),
    pair i's angle pos * base^(-2i/d), under YaRN mixed between interpolated (x freq_scale) and
    extrapolated by ggml's ramp over the correction dims, cos and sin scaled by its magnitude."""
    d = x.shape[-1]
    i = jnp.arange(d // 2, dtype=jnp.float32)
    inv = spec.rope_theta ** (-2.0 * i / d)
    magnitude = yarn_magnitude(spec)
    if magnitude is not None:
        inv = yarn_frequencies(inv, spec)[0]
    else:
        magnitude = 1.0
    ang = pos.astype(jnp.float32)[..., None, None] * inv                    # [R, L, 1, d/2]
    cos, sin = jnp.cos(ang) * magnitude, jnp.sin(ang) * magnitude
    xf = x.astype(jnp.float32)
    a, b = xf[..., 0::2], xf[..., 1::2]
    return jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)


# ---- the attention half of a layer --------------------------------------------------------------

def project(lp: MlaWeights, spec: ModelSpec, backend: str, x: jax.Array, pos: jax.Array):
    """x [R, L, h] -> (q_nope [R, L, H, nope], q_pe [R, L, H, rope] roped, the cache entry
    [c ; k_pe] [R, L, 1, kv_lora + rope]), float32 apart from q_nope (x's dtype)."""
    m, H, eps = spec.mla, spec.n_heads, spec.rms_eps
    R, L = x.shape[:2]
    if lp.wq is not None:
        _, (q, kv) = norm_linear_many(x, lp.attn_norm, eps, [lp.wq, lp.wkv_a], backend)
    else:
        _, (qa, kv) = norm_linear_many(x, lp.attn_norm, eps, [lp.wq_a, lp.wkv_a], backend)
        q = norm_linear_many(qa, lp.q_a_norm, eps, [lp.wq_b], backend)[1][0]
    q = q.reshape(R, L, H, m.qk_head)
    # the latent's norm through norm_linear_many: the cpu backend's fixed-order norm a row, so a
    # token's bits do not depend on the window (as transformer.py's q/k norms)
    c = norm_linear_many(kv[..., :m.kv_lora], lp.kv_a_norm, eps, [], backend)[0]
    k_pe = yarn_rope(kv[..., None, m.kv_lora:], pos, spec)                       # [R, L, 1, rope]
    entry = jnp.concatenate([c.astype(jnp.float32)[:, :, None], k_pe], axis=-1)
    return q[..., :m.nope], yarn_rope(q[..., m.nope:], pos, spec), entry


def absorbed_query(lp: MlaWeights, spec: ModelSpec, q_nope, q_pe) -> jax.Array:
    """q~ = [W_kb^T q_nope ; q_pe] [R, L, H, kv_lora + rope] float32, scaled so that the kernels'
    1/sqrt(kv_lora + rope) makes it kq_scale."""
    q_lat = jnp.einsum("rlhn,hcn->rlhc", q_nope, lp.wk_b.astype(q_nope.dtype),
                       preferred_element_type=jnp.float32)
    q = jnp.concatenate([q_lat, q_pe.astype(jnp.float32)], axis=-1)
    return q * (kq_scale(spec) * math.sqrt(spec.head_dim))


def attention(lp: MlaWeights, i, spec: ModelSpec, opts, groups, xs, cache, kv_len: int,
              host=None):
    """transformer.attention for an MLA layer (its hook): every group's latent entries written
    first (cache "k" only), then each query over its slot's entries -> (x + attention per group,
    cache)."""
    from .transformer import _read, _stored, _write, _write_at

    if host is not None:
        raise ValueError("deepseek2 keeps every position on the device (--kv-resident is refused)")
    dtype = jnp.dtype(opts.dtype)
    qs = []
    for g, x in zip(groups, xs):
        q_nope, q_pe, entry = project(lp, spec, opts.backend, x, g.pos)
        qs.append(absorbed_query(lp, spec, q_nope, q_pe).astype(dtype))
        cache = _write(cache, i, g.slots, _write_at(cache, g), _stored(cache, "k", entry))
    kv_lora = spec.mla.kv_lora
    if pk.is_cpu(opts.backend):
        lats = _latents_in_place(i, groups, qs, cache)
    else:
        slots = jnp.concatenate([g.slots for g in groups])
        keys = _read(cache, "k", i, slots, kv_len, dtype)             # [rows, kv_len, 1, K + r]
        lats, at = [], 0
        for g, q in zip(groups, qs):
            k = keys[at:at + g.tokens.shape[0]]
            lats.append(attend(q, k, k[..., :kv_lora], g.pos, min(opts.attn_chunk, kv_len)))
            at += g.tokens.shape[0]
    return [x + out_projection(lp, spec, opts.backend, lat[..., :kv_lora].astype(x.dtype))
            for x, lat in zip(xs, lats)], cache


def _latents_in_place(i, groups, qs, cache) -> list:
    """The cpu kernel over the cache in place, the key cache given as the values too: -> per group
    [R, L, H, kv_lora + rope] float32 (the first kv_lora are o_lat). All groups in one call, a
    token a row (as transformer._attend_in_place, for the same reason)."""
    kc, ks = cache["k"], cache.get("k_scale")
    if len(groups) == 1:
        g = groups[0]
        return [pk.cpu.attention(qs[0], kc, kc, i, g.slots, g.pos, ks, ks)]
    H, D = qs[0].shape[2:]
    q = jnp.concatenate([q.reshape(-1, 1, H, D) for q in qs])
    slots = jnp.concatenate([jnp.repeat(g.slots, g.tokens.shape[1]) for g in groups])
    pos = jnp.concatenate([g.pos.reshape(-1, 1) for g in groups])
    flat = pk.cpu.attention(q, kc, kc, i, slots, pos, ks, ks)
    out, at = [], 0
    for g in groups:
        n = g.tokens.shape[0] * g.tokens.shape[1]
        out.append(flat[at:at + n].reshape(*g.tokens.shape, H, -1))
        at += n
    return out


def out_projection(lp: MlaWeights, spec: ModelSpec, backend: str, lat: jax.Array) -> jax.Array:
    """o_lat [R, L, H, kv_lora] -> W_o [W_vb,h o_lat,h]_h [R, L, h]."""
    R, L, H = lat.shape[:3]
    o = jnp.einsum("rlhc,hdc->rlhd", lat, lp.wv_b.astype(lat.dtype),
                   preferred_element_type=jnp.float32).astype(lat.dtype)
    return linear(o.reshape(R, L, H * spec.mla.v_head), lp.wo, backend)


def unabsorbed(lp: MlaWeights, spec: ModelSpec, q_nope, q_pe, entries, q_pos, chunk: int):
    """The textbook form over the same cache entries: every head's keys [W_kb,h c ; k_pe] and values
    W_vb,h c decompressed, multi-head attention with kq_scale -> o [R, L, H, v] float32. entries
    [R, C, 1, kv_lora + rope] (key c at position c), q_* from project()."""
    m = spec.mla
    c, k_pe = entries[:, :, 0, :m.kv_lora], entries[:, :, :, m.kv_lora:]
    H = q_nope.shape[2]
    k_nope = jnp.einsum("rcl,hln->rchn", c, lp.wk_b.astype(jnp.float32))      # [R, C, H, nope]
    keys = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (*k_pe.shape[:2], H, m.rope))], -1)
    vals = jnp.einsum("rcl,hdl->rchd", c, lp.wv_b.astype(jnp.float32))          # [R, C, H, v]
    q = jnp.concatenate([q_nope.astype(jnp.float32), q_pe], axis=-1)
    q = q * (kq_scale(spec) * math.sqrt(m.qk_head))          # attend divides by sqrt(nope + rope)
    return attend(q, keys, vals, q_pos, chunk)
