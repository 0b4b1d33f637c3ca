"""Sampling controls and logprobs on the device: logit_bias, presence / frequency penalties,
llama.cpp's repeat penalty, and the log-probabilities of the raw model distribution.

Order (vLLM's and llama.cpp's): the logit bias is added, then the repeat penalty divides the
positive and multiplies the negative logits of the tokens seen in the last `repeat_last_n` tokens of
prompt and output, then `frequency_penalty * count + presence_penalty * (count > 0)` is subtracted
for each token generated so far; temperature, top_k, top_p and min_p (sampler.py) come after.
Logprobs are those of the raw logits the model gave (vLLM's default `raw_logprobs`): what the model
thought, before any of these changes.

A window runs `sample_controlled` only when one of its rows has a control or asks for logprobs. Its
inputs have fixed shapes: each row's token history padded to the cache length ([R, H]) and its
logit_bias padded to MAX_LOGIT_BIAS entries ([R, B]), scattered over the vocabulary on the device;
so there is one program per row bucket (and greedy or sampled: see sample_controlled), never one per
request. A row without controls gets the identity (no bias, no token seen, penalties 0): the same
bits, so the same token as in a window without controls. Logprobs (log-softmax, top
20) are computed only when some row of the window asks for them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..request import MAX_LOGIT_BIAS
from .sampler import filter_logits, mark_non_finite, token_key

TOP_LOGPROBS = 20           # the most alternatives a token reports (OpenAI's limit)


@dataclass
class Controls:
    """Per-row control arrays of a window group (dynamic program inputs)."""
    history: np.ndarray       # [R, H] int32: prompt + output tokens so far, -1 after them
    n_prompt: np.ndarray      # [R] int32: where the output starts in history
    last_n: np.ndarray        # [R] int32: the repeat penalty's window (0: off)
    repeat: np.ndarray        # [R] float32: repeat_penalty
    presence: np.ndarray      # [R] float32
    frequency: np.ndarray     # [R] float32
    bias_ids: np.ndarray      # [R, B] int32: logit_bias tokens (the vocabulary size pads: dropped)
    bias: np.ndarray          # [R, B] float32
    logprobs: np.ndarray      # [R] bool: the row asks for logprobs

    def as_tuple(self):
        return (self.history, self.n_prompt, self.last_n, self.repeat, self.presence,
                self.frequency, self.bias_ids, self.bias, self.logprobs)


def wants_controls(params) -> bool:
    """Whether a request's row needs the controlled program (any control set, logprobs asked, or a
    grammar)."""
    return (bool(params.logit_bias) or params.presence_penalty != 0 or params.frequency_penalty != 0
            or (params.repeat_penalty != 1 and params.repeat_last_n != 0)
            or params.logprobs is not None or params.grammar is not None)


def controls_of(rows: list, n_rows: int, vocab: int, width: int) -> Controls | None:
    """rows: (params, tokens, n_prompt) per group row, or None for a padding row; width: the
    history's length (the cache length) -> the group's Controls, or None when no row needs them."""
    if not any(r is not None and wants_controls(r[0]) for r in rows):
        return None
    zeros = np.zeros(n_rows, np.float32)
    c = Controls(np.full((n_rows, width), -1, np.int32), np.zeros(n_rows, np.int32),
                 np.zeros(n_rows, np.int32),
                 np.ones(n_rows, np.float32), zeros.copy(), zeros.copy(),
                 np.full((n_rows, MAX_LOGIT_BIAS), vocab, np.int32),
                 np.zeros((n_rows, MAX_LOGIT_BIAS), np.float32), np.zeros(n_rows, bool))
    for i, row in enumerate(rows):
        if row is None or not wants_controls(row[0]):
            continue
        p, tokens, n_prompt = row
        c.history[i, :len(tokens)] = tokens
        c.n_prompt[i] = n_prompt
        if p.repeat_penalty != 1:
            c.last_n[i] = width if p.repeat_last_n < 0 else p.repeat_last_n
            c.repeat[i] = p.repeat_penalty
        c.presence[i], c.frequency[i] = p.presence_penalty, p.frequency_penalty
        if p.logit_bias:
            ids, values = _bias_arrays(p.logit_bias)
            c.bias_ids[i, :len(ids)], c.bias[i, :len(ids)] = ids, values
        c.logprobs[i] = p.logprobs is not None
    return c


@functools.lru_cache(maxsize=256)
def _bias_arrays(pairs: tuple) -> tuple[np.ndarray, np.ndarray]:
    """A request's logit_bias pairs as arrays, made once (a window would otherwise loop over up to
    1024)."""
    return np.array([t for t, _ in pairs], np.int32), np.array([b for _, b in pairs], np.float32)


def apply_controls(logits: jax.Array, history, n_prompt, last_n, repeat, presence, frequency,
                   bias_ids, bias) -> jax.Array:
    """logits [R, V] float32 -> the controlled logits [R, V]."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    # scattered into zeros, not into the logits: the adds fuse with the passes below (no copy of the
    # logits)
    lg = logits + jnp.zeros((R, V), jnp.float32).at[rows, bias_ids].add(bias, mode="drop")
    pos = jnp.arange(history.shape[1])[None]                                   # [1, H]
    length = jnp.sum(history >= 0, axis=1, keepdims=True)                      # [R, 1]
    recent = (history >= 0) & (pos >= length - last_n[:, None])
    seen = jnp.zeros((R, V), bool).at[rows, jnp.where(recent, history, V)].set(True, mode="drop")
    generated = (history >= 0) & (pos >= n_prompt[:, None])
    counts = jnp.zeros((R, V),
                       jnp.float32).at[rows, jnp.where(generated, history, V)].add(1.0, mode="drop")
    r = repeat[:, None]
    lg = jnp.where(seen, jnp.where(lg > 0, lg / r, lg * r), lg)
    return lg - (frequency[:, None] * counts + presence[:, None] * (counts > 0))


def first_max(x: jax.Array) -> jax.Array:
    """argmax over the last axis (its first maximum, as np.argmax), as two plain reductions:
    XLA:CPU's argmax over a vocabulary takes ~2.5x as long (measured: 5.3 against 2.0 ms at [8,
    151936])."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == m, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]),
                   axis=-1)


def allow_only(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [R, V], mask [R, ceil(V / 32)] int32 (bit t % 32 of word t // 32: token t allowed;
    constrain.py) -> the logits with every forbidden token at -inf. A row whose words are all -1
    keeps its logits' bits."""
    R, V = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1           # [R, W, 32]
    allowed = bits.reshape(R, -1)[:, :V].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def sample_controlled(logits: jax.Array, temperature, top_k, top_p, min_p, seed, step, history,
                      n_prompt, last_n, repeat, presence, frequency, bias_ids, bias, logprobs,
                      mask=None, *, sampled: bool):
    """logits [R, V] float32 -> (tokens [R] int32, their logprobs [R], the top TOP_LOGPROBS ids [R,
    K] int32 and logprobs [R, K]): tokens as sampler.sample picks them from the controlled logits,
    logprobs of the raw ones (zeros when no row asks). sampled (static): some row has a temperature;
    without, the program has no draw at all (a lax.cond around it, even untaken, cost XLA:CPU ~4 ms
    a window at [8, 151936]): two programs a row bucket, greedy and sampled, as the plain sampler's
    greedy_on_host and sample. mask: the grammars' allowed tokens [R, ceil(V / 32)] (allow_only), or
    None when no row of the window has a grammar (its own program then: None is part of the traced
    structure)."""
    lg = apply_controls(logits, history, n_prompt, last_n, repeat, presence, frequency,
                        bias_ids, bias)
    if mask is not None:
        lg = allow_only(lg, mask)
    greedy = first_max(lg).astype(jnp.int32)
    tokens = greedy
    if sampled:
        keys = jax.vmap(token_key)(seed, step)
        drawn = jax.vmap(jax.random.categorical)(keys, filter_logits(lg, temperature, top_k,
                                                                     top_p, min_p))
        tokens = jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)
    tokens = mark_non_finite(logits, tokens)
    k = min(TOP_LOGPROBS, logits.shape[-1])

    def with_logprobs():
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return (jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0],
                top_ids.astype(jnp.int32), top_lp)

    def without():
        R = logits.shape[0]
        return (jnp.zeros(R, jnp.float32), jnp.zeros((R, k), jnp.int32),
                jnp.zeros((R, k), jnp.float32))

    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(logprobs), with_logprobs, without)
    return tokens, chosen, top_ids, top_lp
