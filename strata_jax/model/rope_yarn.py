"""YaRN rope scaling as llama.cpp computes it (ggml-cpu/ops.cpp rope_yarn, ggml.c
ggml_rope_yarn_corr_dims, llama-context.cpp's attn_factor), for the families that read it here.

For pair i of the rotated dims (frequency theta_i = base^(-2i/d)): the interpolated frequency
theta_i / factor and the original one are mixed by a ramp that is 1 (keep the original) below the
correction range's start and 0 (interpolate) past its end; llama.cpp floors the start and ceils the
end (transformers' truncate=False does not: a small difference, families-spec.md 2.6). cos and sin
are scaled by 1 + 0.1 ln(factor) (llama.cpp's attn_factor cancels its own copy of that factor and
rope_yarn applies it once, without a yarn_log_multiplier key).

Only gpt-oss reads it today (YARN_ARCHS); other families' YaRN keys are read by the spec and not
applied, as before.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

YARN_ARCHS = frozenset({"gpt-oss"})


def _corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(inv: jnp.ndarray, spec) -> tuple[jnp.ndarray, float]:
    """The plain inverse frequencies inv [d/2] -> (YaRN's, the cos/sin scale), for spec's
    rope.scaling (type yarn): factor, original_context_length (else the training context),
    yarn_beta_fast (32) and yarn_beta_slow (1)."""
    sc = spec.rope_scaling
    extra = dict(sc.extra)
    d = spec.rope_dims
    n_ctx = int(sc.original_context or spec.context_length)
    beta_fast = float(extra.get("yarn_beta_fast", 32.0))
    beta_slow = float(extra.get("yarn_beta_slow", 1.0))
    low = max(0.0, math.floor(_corr_dim(d, n_ctx, beta_fast, spec.rope_theta)))
    high = min(d - 1.0, math.ceil(_corr_dim(d, n_ctx, beta_slow, spec.rope_theta)))
    i = jnp.arange(d // 2, dtype=jnp.float32)
    ramp = 1.0 - jnp.clip((i - low) / max(0.001, high - low), 0.0, 1.0)    # 1: keep the original
    ext_factor = float(extra.get("yarn_ext_factor", 1.0))
    mix = ramp * ext_factor
    scale = 1.0 / sc.factor
    mscale = 1.0 + 0.1 * math.log(sc.factor) if ext_factor != 0.0 else 1.0
    return inv * (scale * (1.0 - mix) + mix), mscale
