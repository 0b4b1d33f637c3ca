"""YaRN rope scaling as llama.cpp computes it (ggml-cpu/ops.cpp rope_yarn, ggml.c
ggml_rope_yarn_corr_dims, llama-context.cpp's attn_factor), for the families that read it here.

For pair i of the rotated dims (frequency theta_i = base^(-2i/d)): the interpolated frequency
theta_i / factor and the original one are mixed by a ramp that is 1 (keep the original) below the
correction range's start and 0 (interpolate) past its end; llama.cpp floors the start and ceils the
end (transformers' truncate=False does not: a small difference, families-spec.md 2.6). cos and sin
are scaled by 1 + 0.1 ln(factor) (llama.cpp's attn_factor cancels its own copy of that factor and
rope_yarn applies it once, without a yarn_log_multiplier key).

gpt-oss reads it through layers.rope (YARN_ARCHS), deepseek2 through model/mla.py (with its own
magnitude and kq scale); other families' YaRN keys are read by the spec and not applied, as before.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

YARN_ARCHS = frozenset({"gpt-oss"})


def correction_dims(spec) -> tuple[float, float]:
    """The pairs (low, high) between which YaRN's ramp runs, as ggml_rope_yarn_corr_dims computes
    them (the start floored, the end ceiled) from rope.scaling's original_context_length (else the
    training context), yarn_beta_fast (32) and yarn_beta_slow (1)."""
    sc = spec.rope_scaling
    extra = dict(sc.extra)
    d, base = spec.rope_dims, spec.rope_theta
    n_ctx = int(sc.original_context or spec.context_length)

    def corr_dim(n_rot: float) -> float:                     # ggml_rope_yarn_corr_dim
        return d * math.log(n_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(float(extra.get("yarn_beta_fast", 32.0)))))
    high = min(d - 1.0, math.ceil(corr_dim(float(extra.get("yarn_beta_slow", 1.0)))))
    return low, high


def yarn_frequencies(inv: jnp.ndarray, spec) -> tuple[jnp.ndarray, float]:
    """The plain inverse frequencies inv [d/2] -> (YaRN's, the cos/sin scale 1 + 0.1 ln(factor)),
    for spec's rope.scaling (type yarn): each pair's frequency mixed between the interpolated one
    (/ factor) and the original by the ramp over correction_dims (x yarn_ext_factor, default 1)."""
    sc = spec.rope_scaling
    low, high = correction_dims(spec)
    i = jnp.arange(inv.shape[0], dtype=jnp.float32)
    ramp = 1.0 - jnp.clip((i - low) / max(0.001, high - low), 0.0, 1.0)    # 1: keep the original
    ext_factor = float(dict(sc.extra).get("yarn_ext_factor", 1.0))
    mix = ramp * ext_factor
    mscale = 1.0 + 0.1 * math.log(sc.factor) if ext_factor != 0.0 else 1.0
    return inv * ((1.0 / sc.factor) * (1.0 - mix) + mix), mscale
