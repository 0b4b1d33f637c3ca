"""Sampling controls and logprobs on the device: logit_bias, presence / frequency penalties, llama.cpp's repeat
penalty, and the log-probabilities of the raw model distribution.

Order (vLLM's and llama.cpp's): the logit bias is added, then the repeat penalty divides the positive and
multiplies the negative logits of the tokens seen in the last `repeat_last_n` tokens of prompt and output,
then `frequency_penalty * count + presence_penalty * (count > 0)` is subtracted for each token generated so
far; temperature, top_k, top_p and min_p (sampler.py) come after. Logprobs are those of the raw logits the
model gave (vLLM's default `raw_logprobs`): what the model thought, before any of these changes.

A window runs `sample_controlled` only when one of its rows has a control or asks for logprobs; the arrays
are dense over the vocabulary ([R, V]), so the program's shapes depend on the row bucket alone (one program
per row bucket, never one per request), and a row without controls gets the identity (bias 0, penalty 0,
repeat 1: the same bits, so the same token as in a window without controls).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .sampler import filter_logits, mark_non_finite, token_key

TOP_LOGPROBS = 20           # the most alternatives a token reports (OpenAI's limit); always computed here


@dataclass
class Controls:
    """Per-row control arrays of a window group (dynamic program inputs)."""
    bias: np.ndarray          # [R, V] float32: logit_bias
    seen: np.ndarray          # [R, V] bool: in the last repeat_last_n tokens (prompt and output)
    penalty: np.ndarray       # [R, V] float32: frequency * count + presence * (count > 0), over the output
    repeat: np.ndarray        # [R] float32: repeat_penalty (1: off)

    def as_tuple(self):
        return (self.bias, self.seen, self.penalty, self.repeat)


def wants_controls(params) -> bool:
    """Whether a request's row needs the controlled program (any control set, or logprobs asked)."""
    return bool(params.logit_bias) or params.presence_penalty != 0 or params.frequency_penalty != 0 \
        or (params.repeat_penalty != 1 and params.repeat_last_n != 0) or params.logprobs is not None


def controls_of(rows: list, n_rows: int, vocab: int) -> Controls | None:
    """rows: (params, tokens, n_prompt) per group row, or None for a padding row -> the group's Controls, or
    None when no row needs them (the window then runs the plain sampler)."""
    if not any(r is not None and wants_controls(r[0]) for r in rows):
        return None
    c = Controls(np.zeros((n_rows, vocab), np.float32), np.zeros((n_rows, vocab), bool),
                 np.zeros((n_rows, vocab), np.float32), np.ones(n_rows, np.float32))
    for i, row in enumerate(rows):
        if row is None:
            continue
        p, tokens, n_prompt = row
        for tok, b in p.logit_bias:
            c.bias[i, tok] += b
        if p.repeat_penalty != 1 and p.repeat_last_n != 0:
            last = tokens if p.repeat_last_n < 0 else tokens[-p.repeat_last_n:]
            c.seen[i, np.asarray(last, np.int64)] = True
            c.repeat[i] = p.repeat_penalty
        if p.presence_penalty != 0 or p.frequency_penalty != 0:
            counts = np.bincount(np.asarray(tokens[n_prompt:], np.int64), minlength=vocab)[:vocab]
            c.penalty[i] = p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return c


def apply_controls(logits: jax.Array, bias, seen, penalty, repeat) -> jax.Array:
    """logits [R, V] float32 -> the controlled logits [R, V]."""
    lg = logits + bias
    r = repeat[:, None]
    lg = jnp.where(seen, jnp.where(lg > 0, lg / r, lg * r), lg)
    return lg - penalty


def sample_controlled(logits: jax.Array, temperature, top_k, top_p, min_p, seed, step, bias, seen, penalty, repeat):
    """logits [R, V] float32 -> (tokens [R] int32, their logprobs [R], the top TOP_LOGPROBS ids [R, K] int32 and
    logprobs [R, K]): tokens as sampler.sample picks them from the controlled logits, logprobs of the raw ones."""
    lg = apply_controls(logits, bias, seen, penalty, repeat)
    greedy = jnp.argmax(lg, axis=-1).astype(jnp.int32)

    def draw():
        keys = jax.vmap(token_key)(seed, step)
        return jax.vmap(jax.random.categorical)(keys, filter_logits(lg, temperature, top_k, top_p, min_p)).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
    tokens = mark_non_finite(logits, jnp.where(temperature > 0, drawn, greedy))
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, min(TOP_LOGPROBS, logits.shape[-1]))
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp
