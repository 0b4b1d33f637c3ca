"""The layer-stepped window's own stages (engine/execute/stepped.py runs them, for the expert
tiers).

When the experts do not all sit on the device, a window runs as a chain of small programs: embed,
then per layer "attention + router" (the router's choices go to the host, which brings the experts
into the device arena) and "experts from the arena", then "head". Each is forward()'s arithmetic
(transformer.py's attention, layers.py's route / expert_rows / combine_experts), in the same order,
so the logits are the same bits; embed_stage and head_stage are forward()'s own start and end.
"""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels as pk

from ..gguf import ModelSpec
from .hybrid import deltanet_mix
from .layers import (
    combine_experts,
    expert_rows,
    expert_rows_sources,
    norm_linear_many,
    route,
)
from .params import DeltaNetWeights, ExpertBiases, ExpertSide, LayerWeights
from .transformer import RunOptions, attention, decoder_layer


def attn_router_stage(lp: LayerWeights, i, spec: ModelSpec, opts: RunOptions, groups, xs, cache,
                      kv_len: int, host=None):
    """Attention of layer i (its index in the cache: spec.kv_layer; a hybrid family's DeltaNet layer
    mixes its tokens through its state instead), then the FFN norm and the router, per group -> (x
    [R, L, h], hx [R*L, h], router weights [R*L, k] float32, expert ids [R*L, k] int32) per group,
    and the cache."""
    outs = []
    if isinstance(lp, DeltaNetWeights):
        xs, cache = deltanet_mix(lp, i, spec, opts, groups, xs, cache)
    else:
        xs, cache = attention(lp, i, spec, opts, groups, xs, cache, kv_len, host)
    for g, x in zip(groups, xs):
        R, L = g.tokens.shape
        hx = norm_linear_many(x, lp.ffn_norm, spec.rms_eps, [], opts.backend)[0].reshape(R * L, -1)
        w, ids = route(hx, lp.router.weight, spec, opts.backend, lp.router.bias,
                       lp.router.logit_bias)
        outs.append((x, hx, w, ids))
    return outs, cache


def experts_stage(side: ExpertSide, arena: dict, table, spec: ModelSpec, opts: RunOptions,
                  parts, y_acc):
    """The experts of one layer from the device arena (and its shared expert and gpt-oss's expert
    biases, `side`, from the device's weights): per group (x, hx, w, ids) and the expert outputs
    found so far y_acc [N, k, h] -> (x + experts, y_acc). table [E] int32: each expert's arena slot,
    -1 when absent; rows whose expert is absent keep y_acc's value (the host runs a layer in several
    passes when it needs more experts than the arena has slots)."""
    xs, ys = [], []
    for (x, hx, w, ids), acc in zip(parts, y_acc):
        slot = table[ids]                                                             # [N, k]
        here = slot >= 0
        y = expert_rows(hx, ids, jnp.where(here, slot, 0), arena, spec.n_experts, opts.backend,
                        side.biases)
        y = jnp.where(here[..., None], y, acc)
        ffn = combine_experts(hx, y, w, side.shared, opts.backend).reshape(x.shape)
        xs.append(x + ffn)
        ys.append(y)
    return xs, ys


def tiered_experts_stage(side: ExpertSide, arena: dict, host: dict, table, spec: ModelSpec,
                         opts: RunOptions, groups, parts) -> list:
    """experts_stage with the host tier's blocks beside the arena (--host-experts on a CPU, one
    program): each routed expert read from the arena slot that holds it, else from host (every
    expert's blocks, the GGUF file's pages), in one kernel call -> x + experts per group. The same
    kernel rows as from either alone, so the same bits; padding rows (pos -1) read no expert."""
    n_slots = arena["exp_gate"].data.shape[0]
    xs = []
    for g, (x, hx, w, ids) in zip(groups, parts):
        slot = table[ids]                                                             # [N, k]
        where = jnp.where(slot >= 0, slot, n_slots + ids)
        where = jnp.where((g.pos.reshape(-1) >= 0)[:, None], where, -1)
        y = expert_rows_sources(hx, ids, where, [arena, host], opts.backend, side.biases)
        xs.append(x + combine_experts(hx, y, w, side.shared, opts.backend).reshape(x.shape))
    return xs


def host_experts_stage(tree: dict, absent, spec: ModelSpec, parts, backend: str = "cpu",
                       biases: ExpertBiases | None = None) -> list:
    """The experts of one layer that the device cache lacks, on the host device (experts/hybrid.py,
    "remote"): per group (hx [N, h], ids [N, k]) and absent [E] int32 (the expert itself where the
    device cache lacks it, -1 where it holds it) -> float32 [N, k, h] from the host tier's blocks
    with the cpu kernel; rows of held experts are zeros and read no weights (the kernel skips id
    -1). The device's experts_stage computes those and keeps these rows (its y_acc): expert_rows
    either way, so on CPUs the same bits. backend: the engine's RunOptions.host_backend, "cpu" or
    "cpu-exact" (--cpu-math). biases: gpt-oss's expert biases, a copy on the host device."""
    if not pk.is_cpu(backend):
        raise ValueError(f"host experts run the C++ CPU kernels: backend {backend!r} is not cpu or "
                         "cpu-exact")
    return [expert_rows(hx, ids, absent[ids], tree, spec.n_experts, backend, biases)
            for hx, ids in parts]


def dense_stage(lp: LayerWeights, i, spec: ModelSpec, opts: RunOptions, groups, xs, cache,
                kv_len: int):
    """A dense layer (attention and FFN) among MoE ones (e.g. GLM-4.5's leading layers): forward()'s
    own layer code, so the same bits."""
    return decoder_layer(lp, i, spec, opts, groups, xs, cache, kv_len)
