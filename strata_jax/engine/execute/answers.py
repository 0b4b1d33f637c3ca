"""A window's logits to each group's answer (ModelRunner.run), one rule a kind of group:

    verify          the speculative accept rule (accept.py) -> (tokens [R, L], n_accepted [R])
    all_logits      the logits themselves [R, L, V] (research, checks)
    controlled      a row with sampling controls, logprobs or a grammar (controls.py): the grammars'
                    masks are filled on the host while the device runs the model -> tokens [R], and
                    (logprob [R], top ids [R, K], top logprobs [R, K])
    greedy          argmax on the host (one small copy, no program)
    sampled         sampler.py's program -> tokens [R]

Each jitted rule is one small program a row bucket, kept out of the window programs (a CPU builds
each window program ~0.7 s faster without it).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np

from ..grammar.constrain import fill_masks
from .accept import verify
from .controls import controls_of, sample_controlled
from .layouts import GroupInput
from .sampler import greedy_on_host, sample, sample_and_next


class GroupAnswers:
    def __init__(self, cache_len: int, cpu_pick: bool = False):
        """cpu_pick: greedy rows picked by the cpu backend's kernel (sampler.greedy_tokens)."""
        self.cache_len = cache_len
        # one small program per row count (a handful: row buckets)
        self._sample = jax.jit(partial(sample, cpu_pick=cpu_pick))
        self._sample_ahead = jax.jit(partial(sample_and_next, cpu_pick=cpu_pick))
        # the speculative accept rule, one per verify group shape
        self._verify = jax.jit(verify)
        self._controlled = jax.jit(sample_controlled, static_argnames=("sampled",))

    def tokens_on_device(self, logits: jax.Array,
                         g: GroupInput) -> tuple[jax.Array, jax.Array | None]:
        """A plain group's answer (no drafts, no controls) left on the device: sampler.py's
        program, greedy rows included, and the next window's tokens [R, 1] from the same program
        where g is one token a row (the next window run ahead reads them: run_ahead.py), else
        None."""
        if g.tokens.shape != (logits.shape[0], 1):
            return self._sample(logits, *g.sampling.as_tuple()), None
        return self._sample_ahead(logits, *g.sampling.as_tuple(), g.pos[:, 0] >= 0)

    def answer(self, logits: jax.Array, g: GroupInput,
               tokens: jax.Array | None = None) -> tuple[Any, tuple | None]:
        """-> (the group's answer, its logprobs or None); tokens: that answer already computed on
        the device (tokens_on_device)."""
        rows = g.sampling
        if tokens is not None:
            return np.asarray(tokens), None
        if g.drafts is not None:
            return (tuple(np.asarray(a) for a in self._verify(logits, g.drafts, g.n_draft,
                                                              *rows.as_tuple())), None)
        if g.all_logits:
            return np.asarray(logits), None
        if rows.controlled is not None:
            c = controls_of(rows.controlled, logits.shape[0], logits.shape[-1], self.cache_len)
            sampled = bool(np.any(rows.temperature > 0))
            # the model program is dispatched: the grammars' masks are filled while the device runs
            # it
            mask = None if rows.constraints is None else fill_masks(rows.constraints,
                                                                   logits.shape[0],
                                                                   logits.shape[-1])
            tokens, *lp = (np.asarray(a)
                           for a in self._controlled(logits, *rows.as_tuple(), *c.as_tuple(), mask,
                                                                   sampled=sampled))
            return tokens, tuple(lp)
        if not np.any(rows.temperature > 0):
            return greedy_on_host(np.asarray(logits)), None
        return np.asarray(self._sample(logits, *rows.as_tuple())), None
