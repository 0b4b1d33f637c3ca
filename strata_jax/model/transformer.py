"""The decoder forward pass shared by the supported families (llama, qwen2, qwen3, qwen2moe,
qwen3moe, glm4moe).

They differ only where ModelSpec says so: rope layout and partial rope (glm4moe rotates half of each
head), q/k/v biases (qwen2*, glm4moe), per-head q/k norms (qwen3*, optional in glm4moe), experts in
place of the dense FFN (with a gated shared expert for qwen2moe, an ungated one for glm4moe, whose
sigmoid router adds a per-expert bias when choosing). GLM-4.5's NextN (MTP) layer is in mtp.py.
gpt-oss adds attention sinks, sliding-window layers, an output bias and biased, clamped experts
(gpt_oss.py says where each is read).

One call runs one window: R rows (one per slot), each with L tokens at positions `pos` (-1:
padding). New keys and values are written into the slot's cache rows first, then every query attends
to its slot's cached positions up to `kv_len` (a static bucket, so a handful of programs cover all
lengths). Slot ids and positions are dynamic inputs: they never multiply compiled programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

import pallas_kernels as pk

from ..gguf import ModelSpec
from .kv_offload import HostKV, host_source
from .layers import (
    attend,
    moe,
    norm_linear_many,
    rope,
    route,
    swiglu_down,
)
from .params import LayerWeights
from .weights import embed_rows, linear


@dataclass(frozen=True)
class RunOptions:
    """How to run the math (static: part of a program's identity)."""
    dtype: str = "float32"          # activations: float32 on a CPU, bfloat16 on a GPU
    backend: str = "xla"            # pallas_kernels backend for weights kept in blocks
    attn_chunk: int = 256           # keys an attention step reads; kv lengths are multiples of it
    # --split experts: the mesh axis the routed experts are sharded over host experts beside the
    # device (model/stages.py): cpu | cpu-exact, by --cpu-math
    expert_axis: str | None = None
    host_backend: str = "cpu"


def new_kv_cache(spec: ModelSpec, n_slots: int, max_context: int, dtype,
                 steps: int = 0, ring: int = 0) -> dict[str, jax.Array]:
    """Keys and values [layers, slots, max_context + 1, kv_heads, head_dim]; the extra position is
    where padding tokens write, and no query ever reads it. int8: with a float32 scale per token and
    head ([layers, slots, max_context + 1, kv_heads]). layers = spec.n_kv_layers: the attention
    layers (all of them but a hybrid family's DeltaNet ones), then the NextN (MTP) layers' (mtp.py
    writes layer n_layers). The hybrid families' DeltaNet state beside them: state_shapes (`steps`:
    its verify windows' tokens). gpt-oss's sliding-window layers keep theirs in rings beside them:
    ring_shapes (`ring`: its entries a slot)."""
    shape = (spec.n_kv_layers, n_slots, max_context + 1, spec.n_kv_heads, spec.head_dim)
    vshape = shape[:-1] + (spec.cached_value_dim,)     # MLA: none (a view of the keys: mla.py)
    cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(vshape, dtype)}
    if jnp.dtype(dtype) == jnp.int8:
        cache |= {"k_scale": jnp.zeros(shape[:-1], jnp.float32),
                  "v_scale": jnp.zeros(shape[:-1], jnp.float32)}
    cache |= {name: jnp.zeros(s, dt)
              for name, (s, dt) in ring_shapes(spec, n_slots, max_context, dtype, ring).items()}
    return (cache | {name: jnp.zeros(s, jnp.float32)
                     for name, s in state_shapes(spec, n_slots, steps).items()})


# The cache's arrays with a positions axis (axis 2); a slot's state (one a slot, no positions: a
# hybrid family's DeltaNet state, gpt-oss's rings); the rest ("conv_steps", "ssm_steps":
# state_shapes) live only through a verify window.
POSITIONAL = ("k", "v", "k_scale", "v_scale")
RINGS = ("k_swa", "v_swa", "k_swa_scale", "v_swa_scale")
STATE = ("conv", "ssm") + RINGS


def ring_size(spec: ModelSpec, most_tokens: int, positions: int) -> int:
    """The entries a slot's ring holds for gpt-oss's sliding-window layers: the window, and the most
    tokens one slot reads in one window (`most_tokens`: a prompt chunk, a verify row's 1 + --spec),
    so that every key a query of that window sees is still there (position p lives at entry p %
    ring; _ring_attention); at most `positions`, a slot's (then no position wraps: never more than
    the full-length KV). 0 for every other family."""
    return min(spec.sliding_window + most_tokens, positions) if spec.ring_layers else 0


def ring_shapes(spec: ModelSpec, n_slots: int, max_context: int, dtype,
                ring: int = 0) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """gpt-oss's sliding-window layers' keys and values: "k_swa", "v_swa" [ring layers, slots, ring
    + 1, kv_heads, head_dim] in the KV dtype (int8: with float32 scales "k_swa_scale",
    "v_swa_scale" [..., kv_heads]), position p at entry p % ring, the last entry the one padding
    tokens write. A slot's state, not positions: it exists only at the tokens the slot has read (the
    prefix cache resumes there or at a checkpoint, as a hybrid family's). ring 0: the window and
    max_context (always enough). {} for every other family."""
    n = len(spec.ring_layers)
    if not n:
        return {}
    ring = ring or spec.sliding_window + max_context
    shape = (n, n_slots, ring + 1, spec.n_kv_heads, spec.head_dim)
    dt = jnp.dtype(dtype)
    out = {"k_swa": (shape, dt), "v_swa": (shape[:-1] + (spec.value_dim,), dt)}
    if dt == jnp.int8:
        out |= {"k_swa_scale": (shape[:-1], jnp.dtype(jnp.float32)),
                "v_swa_scale": (shape[:-1], jnp.dtype(jnp.float32))}
    return out


def state_shapes(spec: ModelSpec, n_slots: int, steps: int = 0) -> dict[str, tuple[int, ...]]:
    """The hybrid families' per-slot DeltaNet state (deltanet.py), float32: "conv" [layers, slots +
    1, K-1, C] and "ssm" [layers, slots + 1, Hv, dk, dv] over the DeltaNet layers; slot n_slots is a
    scratch one that window rows without a real token write (model/hybrid.py). With steps
    (speculative decoding: 1 + --spec, a verify window's tokens a row), "conv_steps" and "ssm_steps"
    [layers, slots + 1, steps, ...] hold the state after each token of a slot's last verify window,
    so the engine keeps the one after its accepted tokens (KVCache.keep_steps). {} for every other
    family."""
    d, n = spec.deltanet, len(spec.deltanet_layers)
    if d is None or not n:
        return {}
    conv, ssm = (d.conv_kernel - 1, d.qkv_dim), (d.v_heads, d.head_dim, d.v_head_dim)
    out = {"conv": (n, n_slots + 1, *conv), "ssm": (n, n_slots + 1, *ssm)}
    if steps:
        out |= {"conv_steps": (n, n_slots + 1, steps, *conv),
                "ssm_steps": (n, n_slots + 1, steps, *ssm)}
    return out


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (int8 [..., D], float32 scale [...]): symmetric, one scale a token and head."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


@dataclass(frozen=True)
class Group:
    """Rows of a window that share a shape: R rows of L tokens. A window is a few groups (decode
    rows, a prefill chunk, draft-verify rows); each group gets its own matmuls, so a row's
    arithmetic (and so its bits) depends only on its group's shape, never on what else the window
    holds."""
    tokens: jax.Array        # [R, L] int32
    pos: jax.Array           # [R, L] int32, -1: padding (real tokens first)
    slots: jax.Array         # [R] int32
    all_logits: bool = False  # static: logits of every token, else of each row's last real token
    # [E] int32, or None: logits of these of the R * L tokens only (a packed window: the cpu
    # backend's tokens one a row, decode rows and prompt chunks together;
    # engine/schedule/scheduler.py)
    picks: jax.Array | None = None

    def tree_flatten(self):
        return (self.tokens, self.pos, self.slots, self.picks), (self.all_logits,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        tokens, pos, slots, picks = children
        return cls(tokens, pos, slots, aux[0], picks)


jax.tree_util.register_pytree_node_class(Group)


@dataclass(frozen=True)
class ForwardOut:
    """What forward() gives back (a pytree: a jitted window program returns it as it is).

    logits: float32 per group, [R, V] (or [R, L, V] with all_logits, [E, V] with picks).
    cache: the KV cache with the window's keys and values written.
    hiddens: with_hidden only, per group [R, L, h] in opts.dtype: every token's last hidden state
        AFTER the final norm (output_norm), the input of the MTP layer (mtp.py), as vLLM, SGLang and
        transformers feed it; padding tokens' rows are garbage. Else None.
    counts: with counts given, the expert profile (int32 [n_layers, E]) with the window's routing
    added.
    """
    logits: list
    cache: dict
    hiddens: list | None = None
    counts: jax.Array | None = None


jax.tree_util.register_dataclass(ForwardOut, data_fields=["logits", "cache", "hiddens", "counts"],
                                 meta_fields=[])


def forward(params: dict, spec: ModelSpec, opts: RunOptions, groups: tuple[Group, ...],
            cache: dict[str, jax.Array], kv_len: int, with_hidden: bool = False,
            host: HostKV | None = None, counts: jax.Array | None = None) -> ForwardOut:
    """One window -> ForwardOut (logits per group, the updated cache; hiddens with with_hidden,
    static; the updated counts with counts). host: where positions >= host.resident live
    (--kv-resident; see kv_offload.py), else None. With counts (int32 [n_layers, E], the expert
    profile): each MoE layer adds the experts its real tokens routed to. The embedding and the head
    are the layer-stepped stages' own (embed_stage, head_stage), so the two paths cannot drift.

    The layers are unrolled: under lax.scan programs build 3x faster, but each step copies every
    layer's weights out of the stacked array (XLA:CPU does not fuse the slice into the dot): 8.6
    against 10.4 tok/s on SmolLM2."""
    # [R, L, h] each
    xs = embed_stage(params, opts, tuple(g.tokens for g in groups))
    for i, lp in enumerate(params["layers"]):
        # decoder_layer's halves: the cache's layer (spec.kv_layer: gpt-oss's ring layers and full
        # layers count apart), the expert profile's the model's
        xs, cache = attention(lp, spec.kv_layer(i), spec, opts, groups, xs, cache, kv_len, host)
        xs, counts = ffn_half(lp, i, spec, opts, groups, xs, counts)
    logits, hiddens = head_stage(params, spec, opts, groups, xs, with_hidden=True)
    return ForwardOut(logits, cache, hiddens if with_hidden else None, counts)


def _stored(cache: dict, name: str, x: jax.Array) -> dict[str, jax.Array]:
    """New keys or values x [R, L, K, D] as the cache stores them: cast, or int8 with a scale."""
    if cache[name].dtype == jnp.int8:
        q, scale = quantize_int8(x)
        return {name: q, name + "_scale": scale}
    return {name: x.astype(cache[name].dtype)}


def _write(cache: dict, i: int, slots, at, stored: dict[str, jax.Array]) -> dict:
    """Store layer i's new entries (from _stored) at positions `at` [R, L] of the slots' rows."""
    return cache | {n: cache[n].at[i, slots[:, None], at].set(x) for n, x in stored.items()}


def _read(cache: dict, name: str, i: int, slots, kv_len: int, dtype) -> jax.Array:
    """The first kv_len cached keys or values of layer i for the slots -> [R, kv_len, K, D] in
    dtype."""
    x = cache[name][i, slots, :kv_len]
    if x.dtype == jnp.int8:
        return (x.astype(jnp.float32)
                * cache[name + "_scale"][i, slots, :kv_len][..., None]).astype(dtype)
    return x.astype(dtype)


def decoder_layer(lp: LayerWeights, i, spec: ModelSpec, opts: RunOptions, groups, xs, cache,
                  kv_len: int, host=None, counts=None):
    """Decoder layer i over every group of the window: attention (writing the new keys and values
    into the cache first) and the FFN or experts -> (xs, cache), and the updated counts third when
    `counts` (the expert profile, int32 [n_layers, E]) is given."""
    xs, cache = attention(lp, i, spec, opts, groups, xs, cache, kv_len, host)
    xs, counts = ffn_half(lp, i, spec, opts, groups, xs, counts)
    return (xs, cache) if counts is None else (xs, cache, counts)


def ffn_half(lp, i, spec: ModelSpec, opts: RunOptions, groups, xs, counts=None):
    """The FFN half of layer i (its experts, or its dense FFN) for every group -> (xs, counts): the
    expert profile's counts with the routing of the groups' real tokens added (when given, else
    None)."""
    xs = list(xs)
    for n, g in enumerate(groups):
        x = xs[n]
        R, L = g.tokens.shape
        if lp.is_moe:
            hx = norm_linear_many(x, lp.ffn_norm, spec.rms_eps, [], opts.backend)[0]
            ffn = moe(hx.reshape(R * L, -1), lp, spec, opts.backend,
                      opts.expert_axis).reshape(R, L, -1)
            if counts is not None:      # the same router math as moe()'s: XLA computes it once
                # [R*L, k]
                _, ids = route(hx.reshape(R * L, -1), lp.router.weight, spec, opts.backend,
                               lp.router.bias, lp.router.logit_bias)
                real = jnp.repeat((g.pos.reshape(-1) >= 0).astype(jnp.int32), ids.shape[1])
                counts = counts.at[i, ids.reshape(-1)].add(real)
        else:
            _, (gx, ux) = norm_linear_many(x, lp.ffn_norm, spec.rms_eps, [lp.mlp.gate, lp.mlp.up],
                                           opts.backend)
            ffn = swiglu_down(gx, ux, lp.mlp.down, opts.backend)
        xs[n] = x + ffn
    return xs, counts


def attention(lp: LayerWeights, i, spec: ModelSpec, opts: RunOptions, groups, xs, cache,
              kv_len: int, host=None):
    """The attention half of decoder layer i for every group of the window: xs [R, L, h] per group
    -> (x + attention per group, the cache with the groups' new keys and values). `i` may be a
    traced layer index (layer-stepped programs). Every group's keys and values are written before
    any group reads: with a read between two writes XLA copied the whole donated cache (a window of
    decode rows and a prompt chunk showed the cache's size as temporary memory); written first, it
    is updated in place. The groups' rows are distinct slots, so no group reads another's new
    entries either way: the same bits."""
    if spec.mla is not None:        # deepseek2's latent attention, its own cache entries
        from . import mla
        return mla.attention(lp, i, spec, opts, groups, xs, cache, kv_len, host)
    # gpt-oss's sliding-window layer (static: its window is there): its ring, not the KV
    ring = lp.window is not None
    names = ("k_swa", "v_swa") if ring else ("k", "v")
    new = [_project_qkv(lp, i, spec, opts, g, x, cache, names) for g, x in zip(groups, xs)]
    gates = [gate for _, _, gate in new]
    new = [(q, stored) for q, stored, _ in new]
    for g, (_, stored) in zip(groups, new):
        at = _ring_at(cache, g) if ring else _write_at(cache, g)
        cache = _write(cache, i, g.slots, at, stored)
    if ring:
        return _ring_attention(lp, i, spec, opts, groups, xs, [q for q, _ in new], cache,
                               gates), cache
    if pk.is_cpu(opts.backend):
        if host is None or kv_len <= host.resident:
            return (_attend_in_place(lp, i, opts, groups, xs, [q for q, _ in new], cache,
                                     gates), cache)
        return [_attend_in_place_and_host(lp, i, opts, g, x, q, stored, cache, kv_len, host, gate)
                for g, x, (q, stored), gate in zip(groups, xs, new, gates)], cache
    on_device = kv_len if host is None or kv_len <= host.resident else host.resident
    dtype = jnp.dtype(opts.dtype)
    slots = jnp.concatenate([g.slots for g in groups])          # one read of all the window's rows
    keys = _read(cache, "k", i, slots, on_device, dtype)      # [rows, on_device, K, D]
    vals = _read(cache, "v", i, slots, on_device, dtype)
    out, at = [], 0
    for g, x, (q, stored), gate in zip(groups, xs, new, gates):
        R = g.tokens.shape[0]
        out.append(_attend(lp, i, spec, opts, g, x, q, stored, keys[at:at + R], vals[at:at + R],
                           kv_len, host, gate))
        at += R
    return out, cache


def _write_at(cache: dict, g: Group) -> jax.Array:
    """Where a group's new entries go [R, L]: their positions; padding (and any position past the
    cache, --kv-resident's host part) to the scratch position, which no query reads."""
    scratch = cache["k"].shape[2] - 1
    return jnp.where((g.pos >= 0) & (g.pos < scratch), g.pos, scratch)


def _ring_at(cache: dict, g: Group) -> jax.Array:
    """Where a group's new entries go in a ring layer's ring [R, L]: position p at entry p % ring;
    padding to the last entry, which no query reads."""
    ring = cache["k_swa"].shape[2] - 1
    return jnp.where(g.pos >= 0, g.pos % ring, ring)


def _ring_attention(lp: LayerWeights, i, spec: ModelSpec, opts: RunOptions, groups, xs, qs, cache,
                    gates) -> list:
    """A sliding-window layer's attention over its ring (ring_shapes; its entries already written):
    x + attention per group.

    A row's keys: ring entry j holds the latest position written there, and for a row whose last
    real query position in this window is qmax, that is kpos = qmax - ((qmax - j) mod ring) for
    every entry a query of the row may see. The ring holds window + T entries (T: the most tokens a
    slot reads in one window: ring_size), so the keys a query q >= qmax - T + 1 sees, positions q -
    window + 1 .. q, are all there, written in this window or the slot's earlier ones; an entry
    written by a position past qmax (a rejected draft, a longer turn cut back) gets a kpos <= qmax -
    ring, out of every query's window: never read. So the slot's ring is right wherever it has read
    exactly its kept tokens (its live state) or was restored from a checkpoint taken there.

    xla: attend over each row's ring with those positions (k_pos). cpu: the C++ kernel over each
    token's own window of keys, gathered in position order from max(0, q - window + 1) on (its
    tiles then fall where the token's position puts them, however it is batched): the kernel's
    fixed order a query, as for the full layers."""
    ring = cache["k_swa"].shape[2] - 1
    if pk.is_cpu(opts.backend):
        H, D = qs[0].shape[2:]
        W = spec.sliding_window
        q = jnp.concatenate([q.reshape(-1, 1, H, D) for q in qs])               # [T, 1, H, D]
        slots = jnp.concatenate([jnp.repeat(g.slots, g.tokens.shape[1]) for g in groups])
        pos = jnp.concatenate([g.pos.reshape(-1) for g in groups])               # [T]
        base = jnp.maximum(pos - (W - 1), 0)
        # [T, W + 1]: the kernel takes a cache's last position for scratch, never read
        at = (base[:, None] + jnp.arange(W + 1, dtype=jnp.int32)) % ring

        def view(name):                # [1, T, W + 1, K(, D)]: the tokens' windows as a cache
            return cache[name][i, slots[:, None], at][None] if name in cache else None

        T = q.shape[0]
        flat = pk.cpu.attention(q, view("k_swa"), view("v_swa"), 0,
                                jnp.arange(T, dtype=jnp.int32),
                                jnp.where(pos >= 0, pos - base, -1)[:, None],
                                view("k_swa_scale"), view("v_swa_scale"), sinks=lp.sinks,
                                window=lp.window)
        o, n = [], 0
        for g in groups:
            m = g.tokens.shape[0] * g.tokens.shape[1]
            o.append(flat[n:n + m].reshape(*g.tokens.shape, H, -1))
            n += m
    else:
        dtype = jnp.dtype(opts.dtype)
        chunk = min(opts.attn_chunk, ring)
        padded = -(-ring // chunk) * chunk
        slots = jnp.concatenate([g.slots for g in groups])
        pad = ((0, 0), (0, padded - ring), (0, 0), (0, 0))
        keys = jnp.pad(_read(cache, "k_swa", i, slots, ring, dtype), pad)   # [rows, padded, K, D]
        vals = jnp.pad(_read(cache, "v_swa", i, slots, ring, dtype), pad)
        j = jnp.arange(padded, dtype=jnp.int32)
        o, n = [], 0
        for g, q in zip(groups, qs):
            R = g.tokens.shape[0]
            qmax = jnp.max(g.pos, axis=1)[:, None]                                     # [R, 1]
            kpos = jnp.where(j < ring, qmax - jnp.mod(qmax - j, ring), -1)         # [R, padded]
            o.append(attend(q, keys[n:n + R], vals[n:n + R], g.pos, chunk, sinks=lp.sinks,
                            window=lp.window, k_pos=kpos))
            n += R
    return [_output(lp, opts, x, y.astype(x.dtype).reshape(*g.tokens.shape, -1), gate)
            for g, x, y, gate in zip(groups, xs, o, gates)]


def _project_qkv(lp: LayerWeights, i, spec: ModelSpec, opts: RunOptions, g: Group, x, cache,
                 names=("k", "v")):
    """Queries [R, L, H, D], the new keys and values as the cache stores them (_stored) and the
    output gate [R, L, H * Dv] (the hybrid families' gated attention: attn_q holds [q | gate] a
    head), else None, for one group. names: the cache's arrays they go to (gpt-oss's rings:
    "k_swa", "v_swa")."""
    dtype = jnp.dtype(opts.dtype)
    H, K, D, Dv = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.value_dim
    R, L = g.tokens.shape
    _, (q, k, v) = norm_linear_many(x, lp.attn_norm, spec.rms_eps, [lp.wq, lp.wk, lp.wv],
                                    opts.backend)
    if lp.bq is not None:
        q, k, v = q + lp.bq.astype(dtype), k + lp.bk.astype(dtype), v + lp.bv.astype(dtype)
    gate = None
    if spec.attn_output_gate:
        q, gate = jnp.split(q.reshape(R, L, H, 2 * D), 2, axis=-1)
        gate = gate.reshape(R, L, H * D)
    q, k, v = q.reshape(R, L, H, D), k.reshape(R, L, K, D), v.reshape(R, L, K, Dv)
    if lp.q_norm is not None:
        # through norm_linear_many (the cpu backend's fixed-order norm a row): XLA's mean over the
        # head dim is not batch-invariant, a token's bits changing once a window holds 64 or more
        # (found by tests/test_structured.py's mixed windows, issue 33: 1 ulp on exact, whole tokens
        # on int8)
        q = norm_linear_many(q, lp.q_norm, spec.rms_eps, [], opts.backend)[0]
        k = norm_linear_many(k, lp.k_norm, spec.rms_eps, [], opts.backend)[0]
    q, k = rope(q, g.pos, spec), rope(k, g.pos, spec)
    return q, _stored(cache, names[0], k) | _stored(cache, names[1], v), gate


def _output(lp: LayerWeights, opts: RunOptions, x, y, gate):
    """x + the attention output y [R, L, H * Dv] projected by wo (plus its bias, gpt-oss's), gated
    first by sigmoid(gate) where the family gates it (qwen3next, qwen35moe)."""
    if gate is not None:
        y = (y.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    out = linear(y, lp.wo, opts.backend)
    if lp.bo is not None:
        out = out + lp.bo.astype(out.dtype)
    return x + out


def _attend_in_place(lp: LayerWeights, i, opts: RunOptions, groups, xs, qs, cache, gates) -> list:
    """The cpu backend's attention for every group of the window: its C++ kernel reads the slots'
    keys and values from the cache where they lie, only the positions each query sees (no gather, no
    transposed copy: XLA's cost more than the layer's products at one decode row), in a fixed order
    a query (cpu/attention.cc), so a query's bits do not depend on how it is grouped. Several groups
    (decode rows and a prompt chunk) go in ONE call, each token a row of its own: with one call a
    group XLA copied a cache tensor for the window
    (test_a_mixed_window_does_not_copy_the_kv_cache)."""
    kc, vc, ks, vs = cache["k"], cache["v"], cache.get("k_scale"), cache.get("v_scale")
    gpt_oss = {"sinks": lp.sinks, "window": lp.window}          # None but for gpt-oss
    if len(groups) == 1:
        o = [pk.cpu.attention(qs[0], kc, vc, i, groups[0].slots, groups[0].pos, ks, vs,
                              **gpt_oss)]
    else:
        H, D = qs[0].shape[2:]
        # [tokens, 1, H, D]
        q = jnp.concatenate([q.reshape(-1, 1, H, D) for q in qs])
        slots = jnp.concatenate([jnp.repeat(g.slots, g.tokens.shape[1]) for g in groups])
        pos = jnp.concatenate([g.pos.reshape(-1, 1) for g in groups])
        # [tokens, 1, H, Dv]
        flat = pk.cpu.attention(q, kc, vc, i, slots, pos, ks, vs, **gpt_oss)
        o, at = [], 0
        for g in groups:
            n = g.tokens.shape[0] * g.tokens.shape[1]
            o.append(flat[at:at + n].reshape(*g.tokens.shape, H, -1))
            at += n
    return [_output(lp, opts, x, y.astype(x.dtype).reshape(*g.tokens.shape, -1), gate)
            for g, x, y, gate in zip(groups, xs, o, gates)]


def _attend_in_place_and_host(lp: LayerWeights, i, opts: RunOptions, g: Group, x, q, stored, cache,
                              kv_len: int, host, gate=None):
    """The cpu backend's attention with --kv-resident past the device part: the kernel over the
    device cache's positions [0, resident), then over each host block as kv_offload brings it, the
    softmax state carried from part to part in the kernel's tile order: the bits of one call over
    all the keys."""
    R, L = g.tokens.shape
    fetch, starts, block = host_source(host, i, g.slots, g.pos, stored, kv_len,
                                       min(opts.attn_chunk, kv_len), jnp.float32)
    part = pk.cpu.attention_part
    out, state = part(q, cache["k"], cache["v"], i, g.slots, g.pos, (0, 0, host.resident), None,
                      cache.get("k_scale"), cache.get("v_scale"))
    rows = jnp.arange(R, dtype=jnp.int32)

    def host_block(carry, b0):
        # [R, block, K, D] float32
        kb, vb = fetch(b0)
        return (part(q, kb[None], vb[None], 0, rows, g.pos, jnp.stack([b0, b0, b0 + block]),
                     carry[1]), None)

    (out, _), _ = jax.lax.scan(host_block, (out, state), starts)
    return _output(lp, opts, x, out.astype(x.dtype).reshape(R, L, -1), gate)


def _attend(lp: LayerWeights, i, spec: ModelSpec, opts: RunOptions, g: Group, x, q, stored, keys,
            vals, kv_len: int, host=None, gate=None):
    """One group's queries over its slots' keys and values read from the device cache (keys [R,
    on_device, K, D], vals) -> x + attention. With a host store and kv_len past its resident
    positions, positions >= host.resident are written to and read from host RAM (kv_offload.py); the
    device cache holds the first ones and a scratch position."""
    dtype = jnp.dtype(opts.dtype)
    H, Dv = spec.n_heads, spec.value_dim
    R, L = g.tokens.shape
    chunk = min(opts.attn_chunk, kv_len)
    more = None
    if host is not None and kv_len > host.resident:
        more = host_source(host, i, g.slots, g.pos, stored, kv_len, chunk, dtype)
    # [R, L, H, Dv]
    o = attend(q, keys, vals, g.pos, chunk, more, sinks=lp.sinks, window=lp.window)
    return _output(lp, opts, x, o.reshape(R, L, H * Dv), gate)


# ---- the stages forward() shares with the layer-stepped windows (stages.py) ----------------------

def embed_stage(params: dict, opts: RunOptions, tokens: tuple) -> list:
    dtype = jnp.dtype(opts.dtype)
    return [embed_rows(params["embed"], t, dtype) for t in tokens]                  # [R, L, h] each


def head_stage(params: dict, spec: ModelSpec, opts: RunOptions, groups, xs,
               with_hidden: bool = False):
    """The final norm and the logits per group; with_hidden: -> (logits, hiddens) as forward() gives
    them."""
    out, hiddens = [], []
    for x, g in zip(xs, groups):
        x = norm_linear_many(x, params["norm"], spec.rms_eps, [], opts.backend)[0]
        hiddens.append(x)                                                              # [R, L, h]
        if g.picks is not None:
            x = x.reshape(-1, x.shape[-1])[g.picks]                                    # [E, h]
        elif not g.all_logits:
            R = x.shape[0]
            last = jnp.maximum(jnp.sum(g.pos >= 0, axis=1) - 1, 0)
            x = x[jnp.arange(R), last]                                                 # [R, h]
        out.append(linear(x, params["output"], opts.backend).astype(jnp.float32))
    return (out, hiddens) if with_hidden else out
