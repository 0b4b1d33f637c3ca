"""The forward pass of the hybrid families (qwen3next, qwen35moe): Gated DeltaNet layers
(deltanet.py) with a gated full-attention layer every few (transformer.py's attention, its output
gated), every layer's FFN a MoE with a gated shared expert (transformer.ffn_half, layers.moe).

The window is transformer.forward's (groups of rows, the cache donated and given back, ForwardOut),
with the slots' DeltaNet state in the cache beside the attention layers' keys and values
(transformer.state_shapes): a group reads its slots' states, runs its tokens through them and writes
them back. Rows without a real token (padding rows, slot 0 by the scheduler's convention) write the
scratch slot instead, so a padding row never overwrites a real row's state in the same scatter.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..gguf import ModelSpec
from . import deltanet
from .transformer import (
    ForwardOut,
    Group,
    RunOptions,
    attention,
    embed_stage,
    ffn_half,
    head_stage,
)


def forward(params: dict, spec: ModelSpec, opts: RunOptions, groups: tuple[Group, ...], cache: dict,
            kv_len: int, with_hidden: bool = False, host=None, counts=None) -> ForwardOut:
    """transformer.forward for a hybrid model, its arguments and result (host, --kv-resident:
    refused by the engine for these families). Attention layer i reads and writes KV layer
    spec.kv_layer(i), DeltaNet layer i state layer spec.kv_layer(i); the expert profile counts by
    the model's layer i."""
    if host is not None:
        raise ValueError("the hybrid families keep every position on the device (--kv-resident is "
                         "refused)")
    xs = embed_stage(params, opts, tuple(g.tokens for g in groups))
    for i, lp in enumerate(params["layers"]):
        mix = deltanet_mix if spec.kind(i) == "deltanet" else attention
        xs, cache = mix(lp, spec.kv_layer(i), spec, opts, groups, xs, cache, kv_len)
        xs, counts = ffn_half(lp, i, spec, opts, groups, xs, counts)
    logits, hiddens = head_stage(params, spec, opts, groups, xs, with_hidden=True)
    return ForwardOut(logits, cache, hiddens if with_hidden else None, counts)


def deltanet_mix(lp, j: int, spec: ModelSpec, opts: RunOptions, groups, xs, cache, kv_len: int = 0):
    """DeltaNet layer j's (its index among the DeltaNet layers) token mixing for every group -> (xs,
    cache); attention's signature (kv_len unused). Every group's state is read before any is written
    (the groups' rows are distinct slots: none reads another's new state)."""
    scratch = cache["conv"].shape[1] - 1
    new = [deltanet.mix(lp, spec, opts.backend, x, g.pos, cache["conv"][j, g.slots],
                        cache["ssm"][j, g.slots],
                        _keeps_steps(g, cache)) for g, x in zip(groups, xs)]
    for g, (_, conv, S, *steps) in zip(groups, new):
        at = jnp.where(g.pos[:, 0] >= 0, g.slots, scratch)
        cache = (cache | {"conv": cache["conv"].at[j, at].set(conv),
                          "ssm": cache["ssm"].at[j, at].set(S)})
        if steps:
            cache = cache | {"conv_steps": cache["conv_steps"].at[j, at].set(steps[0]),
                             "ssm_steps": cache["ssm_steps"].at[j, at].set(steps[1])}
    return [x for x, *_ in new], cache


def _keeps_steps(g: Group, cache: dict) -> bool:
    """A verify group (every logit, 1 + --spec tokens a row: the steps arrays' length), whose rows'
    states after each token are kept for the engine to choose from once it knows how many drafts it
    accepts."""
    return ("ssm_steps" in cache and g.all_logits
            and g.tokens.shape[1] == cache["ssm_steps"].shape[2])
