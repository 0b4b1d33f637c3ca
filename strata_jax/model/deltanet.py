"""The Gated DeltaNet layer of the hybrid families (qwen3next, qwen35moe), as pure functions.

A DeltaNet layer mixes tokens through a fixed-size state a slot instead of a KV cache: a causal
depthwise conv over q, k and v (its state: the last conv_kernel - 1 inputs) and, per v-head, a d_k x
d_v matrix S updated by the gated delta rule (llama.cpp src/models/qwen3next.cpp and
delta-net-base.cpp; transformers' modeling_qwen3_next.py):

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

Two forms compute it: `recurrent` (a token at a time: decode) and `chunked` (64 tokens at a time
with a triangular solve inside each chunk: prompt reading), the same function of the inputs to
float32 rounding (tests/test_deltanet.py checks one against the other).

Windows hold padding (pos -1, after a row's real tokens): a padding token has g = 0 and beta = 0, so
it leaves S as it was, and the conv state is taken after the row's last real token. A row whose
first token is at position 0 starts from a zero state: a slot's state is reset by the sequence that
begins in it, as its KV is overwritten, with nothing for the engine to clear.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..gguf import ModelSpec
from .layers import norm_linear_many, rms_norm
from .weights import linear

CHUNK = 64               # the chunked form's chunk (llama.cpp's and transformers')
# rows of this many tokens or more use the chunked form (static: L is a program's shape)
CHUNKED_FROM = 32


def l2_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis (llama.cpp's ggml_l2_norm; transformers'
    l2norm)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, state: jax.Array, w: jax.Array, n_real: jax.Array,
                steps: bool = False) -> tuple[jax.Array, ...]:
    """The depthwise causal conv, then SiLU: x [R, L, C] after state [R, K-1, C] (the K-1 inputs
    before x's first), w [K, C] (tap K-1 is the current token) -> (silu(conv) [R, L, C], the new
    state: the K-1 inputs before position n_real [R] of each row, its real tokens' end), and with
    `steps` the state after each token [R, L, K-1, C] third."""
    K, L = w.shape[0], x.shape[1]
    xs = jnp.concatenate([state.astype(x.dtype), x], axis=1)                  # [R, K-1+L, C]
    out = xs[:, 0:L] * w[0]
    for j in range(1, K):
        out = out + xs[:, j:j + L] * w[j]
    new = jax.vmap(lambda row, n: lax.dynamic_slice_in_dim(row, n, K - 1, axis=0))(xs, n_real)
    if steps:
        return jax.nn.silu(out), new, jnp.stack([xs[:, t + 1:t + K] for t in range(L)], axis=1)
    return jax.nn.silu(out), new


def recurrent(q, k, v, g, beta, S, steps: bool = False):
    """The gated delta rule a token at a time. q, k [R, L, H, dk] (q already scaled), v [R, L, H,
    dv], g, beta [R, L, H], S [R, H, dk, dv] float32 -> (o [R, L, H, dv], S after the L tokens), and
    with `steps` S after each token [R, L, H, dk, dv] third. The products are element-wise sums over
    dk, in a fixed order whatever the window's size (transformers' form)."""
    def step(S, t):
        qt, kt, vt, gt, bt = t
        S = S * jnp.exp(gt)[..., None, None]
        # S^T k [R, H, dv]
        mem = jnp.sum(S * kt[..., None], axis=-2)
        S = S + kt[..., None] * ((vt - mem) * bt[..., None])[..., None, :]
        o = jnp.sum(S * qt[..., None], axis=-2)
        return S, ((o, S) if steps else o)

    seq = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    S, out = lax.scan(step, S, seq)
    if steps:
        return jnp.moveaxis(out[0], 0, 1), S, jnp.moveaxis(out[1], 0, 1)
    return jnp.moveaxis(out, 0, 1), S


def chunked(q, k, v, g, beta, S, chunk: int = CHUNK):
    """The gated delta rule `chunk` tokens at a time (recurrent's arguments and result). Within a
    chunk, with G the cumulative sum of g: A = strictly lower (beta_i k_i . k_j e^(G_i - G_j)), T =
    (I + A)^-1 (a triangular solve), W = T (beta K e^G), U = T (beta V); then per chunk, in order:
    v' = U - W S;  o = (Q e^G) S + tril(Q K^T e^(G_i - G_j)) v';  S <- e^(G_last) S + (K e^(G_last -
    G))^T v'. The decays are masked before exp (exp of the upper triangle's positive sums
    overflows)."""
    R, L, H, _ = q.shape
    pad = -L % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    N = (L + pad) // chunk

    def blocks(a):                                    # [R, L, H, ...] -> [R, H, N, chunk, ...]
        a = jnp.moveaxis(a, 2, 1)
        return a.reshape(R, H, N, chunk, *a.shape[3:])

    q, k, v, g, beta = (blocks(a) for a in (q, k, v, g, beta))
    G = jnp.cumsum(g, axis=-1)                                                  # [R, H, N, chunk]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = G[..., :, None] - G[..., None, :]
    # e^(G_i - G_j), i >= j
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
    kb, vb = k * beta[..., None], v * beta[..., None]
    A = jnp.einsum("...id,...jd->...ij", kb, k) * decay
    A = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), A, 0.0)
    T = _unit_lower_inverse(A)
    # [R, H, N, chunk, dv]
    U = jnp.einsum("...ij,...jd->...id", T, vb)
    # [R, H, N, chunk, dk]
    W = jnp.einsum("...ij,...jd->...id", T, kb * jnp.exp(G)[..., None])
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay
    qg = q * jnp.exp(G)[..., None]
    kd = k * jnp.exp(G[..., -1:] - G)[..., None]
    last = jnp.exp(G[..., -1])[..., None, None]                                  # [R, H, N, 1, 1]

    def step(S, n):
        Un, Wn, In, Qn, Kn, Dn = n
        vn = Un - jnp.einsum("rhcd,rhde->rhce", Wn, S)
        o = jnp.einsum("rhcd,rhde->rhce", Qn, S) + jnp.einsum("rhij,rhje->rhie", In, vn)
        S = S * Dn + jnp.einsum("rhcd,rhce->rhde", Kn, vn)
        return S, o

    seq = tuple(jnp.moveaxis(a, 2, 0) for a in (U, W, intra, qg, kd, last))
    # o [N, R, H, chunk, dv]
    S, o = lax.scan(step, S, seq)
    o = jnp.moveaxis(o, 0, 2).reshape(R, H, N * chunk, -1)[:, :, :L]
    return jnp.moveaxis(o, 1, 2), S


def _unit_lower_inverse(A: jax.Array) -> jax.Array:
    """(I + A)^-1 for A strictly lower triangular [..., C, C], by forward substitution a row at a
    time (row i = e_i - A[i, :i] T[:i]): plain XLA operations. XLA:CPU's triangular_solve is a
    runtime call that, beside the C++ kernels' own threads, hung a 256-token prompt chunk now and
    then (the engine waited on the window's result with every thread idle)."""
    C = A.shape[-1]
    eye = jnp.eye(C, dtype=A.dtype)

    def row(i, T):
        return T.at[..., i, :].set(eye[i] - jnp.einsum("...j,...jk->...k", A[..., i, :], T))

    return lax.fori_loop(0, C, row, jnp.zeros_like(A))


def delta_rule(q, k, v, g, beta, S):
    """recurrent for short rows (decode, draft verification), chunked for prompt chunks."""
    return (chunked if q.shape[1] >= CHUNKED_FROM else recurrent)(q, k, v, g, beta, S)


def _heads(x: jax.Array, spec: ModelSpec) -> jax.Array:
    """q or k [R, L, Hk, dk] -> [R, L, Hv, dk]: each v-head's q/k head. qwen3next keeps
    transformers' grouped order (v-head h reads k-head h // (Hv / Hk)); qwen35moe's converter tiled
    the v-heads (h reads h % Hk)."""
    d = spec.deltanet
    r = d.v_heads // d.k_heads
    if r == 1:
        return x
    return (jnp.tile(x, (1, 1, r, 1)) if spec.architecture == "qwen35moe"
            else jnp.repeat(x, r, axis=2))


def _beta_alpha(lp, spec: ModelSpec, ys: list) -> tuple[jax.Array, jax.Array]:
    """The beta and alpha projections [R, L, Hv]: qwen3next's one ssm_ba matrix holds them grouped
    per k-head ([beta x r, alpha x r] a group), qwen35moe has two matrices."""
    if lp.ssm_ba is None:
        return ys[0], ys[1]
    d = spec.deltanet
    r = d.v_heads // d.k_heads
    ba = ys[0].reshape(*ys[0].shape[:2], d.k_heads, 2 * r)
    return ba[..., :r].reshape(*ba.shape[:2], -1), ba[..., r:].reshape(*ba.shape[:2], -1)


def mix(lp, spec: ModelSpec, backend: str, x: jax.Array, pos: jax.Array, conv_state: jax.Array,
        S: jax.Array, steps: bool = False) -> tuple[jax.Array, ...]:
    """A DeltaNet layer's token mixing for one group: x [R, L, h] at positions pos [R, L] (-1:
    padding), the rows' conv states [R, K-1, C] and delta-rule states S [R, Hv, dk, dv] -> (x +
    mixing, new conv state, new S), and with `steps` (a verify window: the recurrent form) both
    states after each token ([R, L, K-1, C], [R, L, Hv, dk, dv]) after them. lp:
    params.DeltaNetWeights."""
    d = spec.deltanet
    R, L, _ = x.shape
    ba = [lp.ssm_ba] if lp.ssm_ba is not None else [lp.ssm_beta, lp.ssm_alpha]
    _, (qkv, z, *ys) = norm_linear_many(x, lp.attn_norm, spec.rms_eps, [lp.qkv, lp.z, *ba], backend)
    b, a = _beta_alpha(lp, spec, ys)
    real = pos >= 0
    # a sequence starts: zero state
    fresh = (pos[:, 0] == 0)[:, None, None]
    conv_state = jnp.where(fresh, 0.0, conv_state)
    S = jnp.where(fresh[..., None], 0.0, S)
    c, conv_state, *conv_steps = causal_conv(qkv.astype(jnp.float32), conv_state, lp.conv,
                                             jnp.sum(real, axis=1), steps)
    nk = d.k_heads * d.head_dim
    q = c[..., :nk].reshape(R, L, d.k_heads, d.head_dim)
    k = c[..., nk:2 * nk].reshape(R, L, d.k_heads, d.head_dim)
    v = c[..., 2 * nk:].reshape(R, L, d.v_heads, d.v_head_dim)
    q = _heads(l2_normalize(q, spec.rms_eps), spec) * (d.head_dim ** -0.5)
    k = _heads(l2_normalize(k, spec.rms_eps), spec)
    beta = jnp.where(real[..., None], jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
    g = jnp.where(real[..., None],
                  lp.ssm_a * jax.nn.softplus(a.astype(jnp.float32) + lp.dt_bias), 0.0)
    o, S, *S_steps = (recurrent(q, k, v, g, beta, S, True) if steps
                      else delta_rule(q, k, v, g, beta, S))
    o = rms_norm(o, lp.ssm_norm, spec.rms_eps) * jax.nn.silu(z.astype(jnp.float32).reshape(o.shape))
    return (x + linear(o.reshape(R, L, -1).astype(x.dtype), lp.ssm_out, backend), conv_state, S,
            *conv_steps, *S_steps)
