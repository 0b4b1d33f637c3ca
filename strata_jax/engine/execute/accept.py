"""The speculative accept rule, as pure functions on the device.

A verify row holds the row's last token and its N drafts, d_1..d_N, at consecutive positions; the
window gives the target model's logits at each of the N+1 positions (position j predicts the token
after d_j).

Greedy rows: keep the longest prefix of drafts equal to the model's argmax at each position, then
one more token, the model's own argmax after that prefix. So a greedy request gives exactly its
tokens without speculation (as long as the logits are the same bits: see tests/test_spec.py).

Sampled rows (Leviathan et al. 2023; gpt-fast's `speculative_decode` spells out the same rule): with
p_j the target's distribution at position j (after temperature, top_k, top_p, min_p) and q_j the
drafter's, accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw the
next token from norm(max(p_j - q_j, 0)) and stop; when every draft is accepted, draw one more from
p_N. The tokens then follow p exactly, whatever the drafter proposed. Our drafters propose
deterministically (their argmax, or a prompt lookup), so q_j is one-hot at d_j: accept with
probability p_j(d_j), and on rejection draw from p_j with d_j removed.

Random numbers: position j of a row whose request has generated `step` tokens uses the key of its
(step + j)-th token (sampler.token_key): the uniform for the accept test from fold_in(key, 1), the
draw itself from the key, as the plain sampler draws. So a seeded request repeats, and a row without
drafts draws exactly what the plain sampler draws.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .sampler import filter_logits, mark_non_finite, token_key


def accept_row(p: jax.Array, q: jax.Array, drafts: jax.Array, n_draft, keys: jax.Array):
    """One row of the rule with any drafter distribution.

    p [N+1, V]: the target's probabilities at each position; q [N, V]: the drafter's; drafts [N]
    int32 (only the first n_draft are real); keys [N+1]: one random key a position.
    -> (n_accepted: int32, token: int32, the one drawn after the accepted drafts)."""
    N = drafts.shape[0]
    j = jnp.arange(N)
    px, qx = p[j, drafts], q[j, drafts]                                            # [N]
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys[:N])
    # u < p/q, i.e. accepted with probability min(1, p/q)
    ok = (u * qx < px) & (j < n_draft)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
    at = jnp.minimum(n_acc, N - 1)
    residual = jnp.maximum(p[at] - q[at], 0.0)
    rejected = n_acc < n_draft
    # p == q leaves no residual mass, but then nothing can be rejected: the fallback is never drawn
    # from
    dist = jnp.where(rejected & (jnp.sum(residual) > 0), residual, p[n_acc])
    token = jax.random.categorical(keys[n_acc], jnp.log(dist)).astype(jnp.int32)
    return n_acc, token


def verify(logits: jax.Array, drafts: jax.Array, n_draft: jax.Array, temperature, top_k, top_p,
           min_p, seed, step):
    """A verify group's logits [R, N+1, V], drafts [R, N] int32, n_draft [R] int32 and the rows'
    sampling parameters -> (tokens [R, N+1] int32, n_accepted [R] int32): a row emits
    tokens[:n_accepted + 1]."""
    R, L, V = logits.shape
    N = L - 1
    j = jnp.arange(N)
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)                         # [R, L]
    ok = (drafts == target[:, :N]) & (j[None] < n_draft[:, None])
    n_greedy = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    def draw():
        rep = lambda a: jnp.repeat(a, L)                                           # [R] -> [R*L]
        lg = filter_logits(logits.reshape(R * L, V), rep(temperature), rep(top_k), rep(top_p),
                           rep(min_p))
        p = jax.nn.softmax(lg, axis=-1).reshape(R, L, V)
        q = jax.nn.one_hot(drafts, V, dtype=p.dtype)                               # [R, N, V]
        keys = jax.vmap(lambda s, n: jax.vmap(lambda i: token_key(s, n + i))(jnp.arange(L)))(
            seed, step)
        n_acc, tok = jax.vmap(accept_row)(p, q, drafts, n_draft, keys)
        padded = jnp.concatenate([drafts, jnp.zeros((R, 1), jnp.int32)], axis=1)    # [R, L]
        return jnp.where(jnp.arange(L)[None] == n_acc[:, None], tok[:, None], padded), n_acc

    sampled, n_sampled = jax.lax.cond(jnp.any(temperature > 0), draw, lambda: (target, n_greedy))
    hot = temperature > 0
    tokens = mark_non_finite(logits, jnp.where(hot[:, None], sampled, target))
    return tokens, jnp.where(hot, n_sampled, n_greedy)
