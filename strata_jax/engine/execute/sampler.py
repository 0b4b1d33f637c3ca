"""Sampling on the device: each row has its own temperature, top_k, top_p, min_p and seed.

A row's random key is fold_in(key(seed), n) for its n-th generated token, so the same seed gives the
same text whatever else shares the window. Temperature 0 is greedy (argmax). Logits with a NaN or an
inf give token -1 (see `mark_non_finite`). Order as vLLM's: logits are divided by the temperature,
then top_k, top_p and min_p cut the candidates, then one is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk


@dataclass
class SamplingRows:
    """Per-row sampling parameters of a window group, as arrays (dynamic program inputs)."""
    temperature: np.ndarray   # [R] float32, 0 = greedy
    top_k: np.ndarray         # [R] int32, 0 = off
    top_p: np.ndarray         # [R] float32, 1 = off
    min_p: np.ndarray         # [R] float32, 0 = off
    seed: np.ndarray          # [R] uint32
    step: np.ndarray          # [R] int32: tokens the row generated so far
    # per row (params, tokens so far, prompt length), or None for padding: set only when some row
    # has a sampling control or asks for logprobs (controls.py builds that window's control arrays
    # from it)
    controlled: list | None = None
    # per row its grammar's matcher (constrain.Constraint) or None: set only when some row has one
    constraints: list | None = None

    @classmethod
    def greedy(cls, rows: int) -> SamplingRows:
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
                   np.zeros(rows, np.float32), np.zeros(rows, np.uint32), np.zeros(rows, np.int32))

    def as_tuple(self):
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.step)


def filter_logits(logits: jax.Array, temperature, top_k, top_p, min_p) -> jax.Array:
    """logits [N, V] float32 -> the logits a row draws from [N, V]: divided by the temperature, with
    top_k, top_p and min_p's cut candidates at -inf (the speculative accept rule uses them too)."""
    V = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    lg = logits / t
    order = jnp.sort(lg, axis=-1)[:, ::-1]                                        # descending
    kth = jnp.take_along_axis(order, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
    lg = jnp.where((top_k[:, None] > 0) & (lg < kth), -jnp.inf, lg)
    order = jnp.where((top_k[:, None] > 0) & (order < kth), -jnp.inf, order)
    probs = jax.nn.softmax(order, axis=-1)
    # mass ahead of each
    before = jnp.cumsum(probs, axis=-1) - probs
    # the most probable candidate always stays: a top_p that float32 rounds to 0 (5e-324) kept none,
    # and a draw from all -inf gave token 0 (a token a grammar may forbid)
    keep = (before < top_p[:, None]) | (jnp.arange(V) == 0)[None]
    cut = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1, keepdims=True)
    lg = jnp.where(lg < cut, -jnp.inf, lg)
    top = order[:, :1]
    return jnp.where((min_p[:, None]
                      > 0) & (lg < top + jnp.log(jnp.maximum(min_p[:, None], 1e-30))), -jnp.inf, lg)


def token_key(seed, n):
    """The random key of a row's n-th generated token."""
    return jax.random.fold_in(jax.random.key(seed), n)


def first_argmax(logits: jax.Array, chunk: int = 128) -> jax.Array:
    """jnp.argmax(logits, axis=-1) for logits [R, V] (the first index of the largest; of the first
    NaN where a row holds one, as argmax ranks NaN), as int32 [R], in small steps: each chunk's
    max, the first chunk holding the largest, then the argmax inside it. XLA:CPU's argmax over a
    vocabulary (a reduce of value and index pairs) is not vectorized: 0.24 ms for SmolLM2's 49,152
    logits against 0.045 ms here, paid each decode window run ahead (issue 33)."""
    R, V = logits.shape
    n = -(-V // chunk)
    b = jnp.pad(logits, ((0, 0), (0, n * chunk - V)),
                constant_values=-jnp.inf).reshape(R, n, chunk)
    # a chunk's rank: NaN where it holds one (jnp.max does not say so on XLA:CPU)
    best = jnp.where(jnp.any(jnp.isnan(b), axis=-1), jnp.nan, jnp.max(b, axis=-1))
    c = jnp.argmax(best, axis=-1)
    inside = jnp.take_along_axis(b, c[:, None, None], axis=1)[:, 0]
    return (c * chunk + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def greedy_tokens(logits: jax.Array, cpu_pick: bool = False) -> jax.Array:
    """Each row's argmax, or -1 where its logits hold a NaN or an inf (mark_non_finite). cpu_pick:
    on the cpu backend's kernels, in one call (pallas_kernels/cpu/pick.cc)."""
    if cpu_pick:
        return pk.cpu.greedy_pick(logits)
    return mark_non_finite(logits, first_argmax(logits))


def sample(logits: jax.Array, temperature, top_k, top_p, min_p, seed, step,
           cpu_pick: bool = False) -> jax.Array:
    """logits [R, V] float32 -> token ids [R] int32 (cpu_pick: greedy_tokens')."""
    greedy = greedy_tokens(logits, cpu_pick)

    def draw():
        lg = filter_logits(logits, temperature, top_k, top_p, min_p)
        keys = jax.vmap(token_key)(seed, step)
        return mark_non_finite(logits,
                               jax.vmap(jax.random.categorical)(keys, lg).astype(jnp.int32))

    drawn = jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
    return jnp.where(temperature > 0, drawn, greedy)


def next_window_tokens(tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """The sampler's answer [R] as the next window's tokens [R, 1]: padding rows (valid [R] false)
    0, as the scheduler's are; the -1 of a NaN row (sampler.mark_non_finite) 0 too, so it never
    indexes the embeddings (that row ends on the host, and the window is dropped). Traced inside
    the sampler's program (sample_and_next), for run_ahead.py: as programs of their own, this and
    the answer's reshape were three dispatches between two windows."""
    return jnp.where(valid, jnp.maximum(tokens, 0), 0).astype(jnp.int32)[:, None]


def sample_and_next(logits: jax.Array, temperature, top_k, top_p, min_p, seed, step, valid,
                    cpu_pick: bool = False) -> tuple[jax.Array, jax.Array]:
    """sample()'s tokens [R] and, in the same program, the next decode window's tokens [R, 1]
    (next_window_tokens; valid [R]: the rows that are not padding): the window run
    ahead waits for them, so they are one program after the window, not three."""
    tokens = sample(logits, temperature, top_k, top_p, min_p, seed, step, cpu_pick)
    return tokens, next_window_tokens(tokens, valid)


def mark_non_finite(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """tokens where the logits they came from ([..., V]) hold a NaN or an inf are -1, which the
    engine turns into an error for that request (argmax over NaNs would give token 0 forever).
    Every logit is checked: XLA:CPU's max over a long row does not always carry a NaN (one NaN
    among 49,152 logits gave a finite max, or -inf)."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(finite, tokens, -1)


def greedy_on_host(logits: np.ndarray) -> np.ndarray:
    """sample()'s answer for rows that are all greedy, from logits [R, V] already on the host (on a
    CPU, a view: no transfer), without a program call (~0.25 ms a decode step): the argmax, or -1
    where a row's logits hold a NaN or an inf (sampler.mark_non_finite)."""
    tokens = np.argmax(logits, axis=-1).astype(np.int32)
    return np.where(np.isfinite(np.max(logits, axis=-1)), tokens, np.int32(-1))
