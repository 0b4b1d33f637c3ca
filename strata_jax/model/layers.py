"""The pieces of a decoder layer, as pure functions. Shapes: R rows (sequences in a window), L
tokens a row, H query heads, K kv heads, D head dim, C cached positions, E experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk

from ..gguf import ModelSpec
from .gpt_oss import sink_softmax_end, swiglu_oai
from .params import ExpertBiases, LayerWeights, Mlp
from .rope_yarn import YARN_ARCHS, yarn_frequencies
from .weights import QTensor, Weight, expert_linear_tiles, linear, linear_many


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def norm_linear_many(x: jax.Array, w: jax.Array, eps: float, ws: list[Weight],
                     backend: str) -> tuple[jax.Array, list[jax.Array]]:
    """rms_norm(x, w, eps) and linear_many of it by `ws` (none: the norm alone) -> (hx, [hx @ W^T
    ...]). The cpu backend, for float32 x and weights in blocks, computes the norm in the products'
    kernel call (pallas_kernels.cpu.norm_qmatmul_many): one call instead of XLA's four small
    operations a norm (~2.4% of a SmolLM2 decode token). Its norm is not XLA's bit for bit (its own
    fixed order a row), so every program that computes a given norm (the whole-window one, the
    layer-stepped stages, the router's prediction) comes here, and all get the same bits."""
    if (not pk.is_cpu(backend) or x.dtype != jnp.float32
            or not all(isinstance(v, QTensor) for v in ws)):
        hx = rms_norm(x, w, eps)
        return hx, linear_many(hx, ws, backend) if ws else []
    lead = x.shape[:-1]
    hx, ys = pk.norm_qmatmul_many(x.reshape(-1, x.shape[-1]), w, eps,
                                  [(v.data, v.qtype) for v in ws], backend)
    return hx.reshape(x.shape), [y.reshape(*lead, -1) for y in ys]


def rope(x: jax.Array, pos: jax.Array, spec: ModelSpec) -> jax.Array:
    """Rotary embedding of x [R, L, heads, D] at positions pos [R, L].

    llama.cpp's two layouts: "norm" rotates adjacent pairs (llama; its converter permuted q/k for
    it), "neox" rotates the two halves of the rotated dims (Qwen)."""
    d = spec.rope_dims
    inv = 1.0 / (spec.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))          # [d/2]
    mscale = 1.0
    if spec.rope_scaling is not None and spec.rope_scaling.type == "linear":
        inv = inv / spec.rope_scaling.factor
    elif (spec.rope_scaling is not None and spec.rope_scaling.type == "yarn"
          and spec.architecture in YARN_ARCHS):
        inv, mscale = yarn_frequencies(inv, spec)
    # [R, L, 1, d/2]
    ang = pos.astype(jnp.float32)[..., None, None] * inv
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    xr, rest = x[..., :d].astype(jnp.float32), x[..., d:]
    if spec.rope_type == "neox":
        a, b = xr[..., : d // 2], xr[..., d // 2:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(xr.shape)
    return (jnp.concatenate([out.astype(x.dtype), rest], axis=-1) if d < x.shape[-1]
            else out.astype(x.dtype))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, chunk: int,
           more=None, sinks: jax.Array | None = None, window: jax.Array | None = None,
           k_pos: jax.Array | None = None) -> jax.Array:
    """q [R, L, H, D] over the cached k, v [R, C, K, D] (key c sits at position c); a query at
    position p sees keys 0..p (none when p < 0: padding). -> [R, L, H, Dv].

    Keys are taken in chunks of `chunk` with an online softmax, always the same chunks in the same
    order. A chunk that is wholly in a row's future changes nothing, bit for bit (its max is -inf:
    the running max, the rescale factor 1.0 and the sums stay exactly as they were), so a row's
    result does not depend on how long the window's longest row made C: the same request gives the
    same bits alone or batched.

    `more` (--kv-resident): keys past C that live in host RAM, as (fetch, block starts [n], block):
    fetch(start) -> (k [R, block, K, D], v [R, block, K, Dv]) at positions start.. . They go through
    the same step after the first C keys, chunk by chunk in position order: the same bits as one
    longer k, v.

    gpt-oss (gpt_oss.py): `sinks` [H], each head's sink logit in the softmax's denominator; `window`
    (an int32 scalar, 0: none) masks keys with q_pos - k_pos >= window. A chunk wholly before a
    query's window changes nothing, as one wholly in its future.

    `k_pos` [R, C] int32 (gpt-oss's ring layers, transformer.py): the position each key holds in
    place of its index (-1: none, never seen). A query sees the same keys, in the same chunk order,
    however its row's window was cut, so its bits are the same alone, batched or resumed.
    """
    R, L, H, D = q.shape
    C, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // K
    n = C // chunk
    qg = (q.astype(jnp.float32) / jnp.sqrt(jnp.float32(D))).reshape(R, L, K, G, D)
    # [n, R, chunk, K, D]
    kc = k.reshape(R, n, chunk, K, D).swapaxes(0, 1)
    vc = v.reshape(R, n, chunk, K, Dv).swapaxes(0, 1)

    def step(carry, xs):
        # [R, K, G, L] ...
        m, s, acc = carry
        kb, vb, c0 = xs[:3]
        # [R, K, G, L, chunk]
        sc = jnp.einsum("rlkgd,rckd->rkglc", qg, kb.astype(jnp.float32))
        # [R or 1, 1, chunk]
        if k_pos is None or len(xs) == 3:       # (host blocks: positions by index)
            kpos = (c0 + jnp.arange(chunk, dtype=jnp.int32))[None, None, :]
            visible = kpos <= q_pos[:, :, None]
        else:
            kpos = xs[3][:, None, :]
            visible = (kpos >= 0) & (kpos <= q_pos[:, :, None])
        # [R, L, chunk]
        if window is not None:
            visible &= (window <= 0) | (q_pos[:, :, None] - kpos < window)
        sc = jnp.where(visible[:, None, None], sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(sc - safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        s = s * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("rkglc,rckd->rkgld", p, vb.astype(jnp.float32))
        return (m_new, s, acc), None

    init = (jnp.full((R, K, G, L), -jnp.inf, jnp.float32), jnp.zeros((R, K, G, L), jnp.float32),
            jnp.zeros((R, K, G, L, Dv), jnp.float32))
    starts = jnp.arange(n, dtype=jnp.int32) * chunk
    xs = (kc, vc, starts) if k_pos is None else (kc, vc, starts,
                                                 k_pos.reshape(R, n, chunk).swapaxes(0, 1))
    carry, _ = jax.lax.scan(step, init, xs)
    if more is not None:
        fetch, block_starts, block = more
        nb = block // chunk

        def host_block(carry, b0):
            # [R, block, K, D]
            kb, vb = fetch(b0)
            # [nb, R, chunk, K, D]
            kb = kb.reshape(R, nb, chunk, K, D).swapaxes(0, 1)
            vb = vb.reshape(R, nb, chunk, K, Dv).swapaxes(0, 1)
            carry, _ = jax.lax.scan(step, carry,
                                    (kb, vb, b0 + jnp.arange(nb, dtype=jnp.int32) * chunk))
            return carry, None

        carry, _ = jax.lax.scan(host_block, carry, block_starts)
    m, s, acc = carry
    if sinks is not None:
        # [1, K, G, 1]
        s, acc = sink_softmax_end(m, s, acc, sinks.reshape(1, K, G, 1))
    # padding rows: 0
    o = acc / jnp.where(s > 0, s, 1.0)[..., None]
    return o.transpose(0, 3, 1, 2, 4).reshape(R, L, H, Dv).astype(q.dtype)


def mlp(x: jax.Array, gate: Weight, up: Weight, down: Weight, backend: str) -> jax.Array:
    """SwiGLU: down(silu(gate x) * up x)."""
    g, u = linear_many(x, [gate, up], backend)
    return swiglu_down(g, u, down, backend)


def swiglu_down(g: jax.Array, u: jax.Array, down: Weight, backend: str) -> jax.Array:
    """The second half of SwiGLU, from gate x and up x: down(silu(g) * u)."""
    return linear(jax.nn.silu(g) * u, down, backend)


def top_k(x: jax.Array, k: int, backend: str) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k of a router's scores [N, E]; on the cpu backends the kernel's (pick.cc: the
    same values and indices, one pass a row where XLA:CPU sorts each row whole)."""
    if pk.is_cpu(backend) and k <= 64:
        return pk.cpu.top_k(x.astype(jnp.float32), k)
    return jax.lax.top_k(x, k)


def route(x: jax.Array, router: Weight, spec: ModelSpec, backend: str,
          bias: jax.Array | None = None,
          logit_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router: x [N, h] -> (weights [N, k] float32, expert ids [N, k] int32), as llama.cpp's
    build_moe_ffn.

    `bias` [E] (GLM-4.5's exp_probs_b): added to the scores to choose the experts only; the weights
    are the unbiased scores of the chosen ones. `logit_bias` [E] (gpt-oss's ffn_gate_inp.bias):
    added to the logits. Gating "softmax_weight" (gpt-oss): the top-k logits, then a softmax over
    them."""
    if pk.is_cpu(backend) and not isinstance(router, QTensor):
        # the cpu kernel's fixed-order rows (ModelRunner.min_rows): the router's logits do not
        # depend on how many rows the window has, so neither does the choice of experts
        logits = pk.cpu.f32_matmul(x, router)
    else:
        logits = linear(x.astype(jnp.float32), router, backend, transposed=False)           # [N, E]
    if logit_bias is not None:
        logits = logits + logit_bias.astype(jnp.float32)
    if spec.expert_gating == "softmax_weight":
        top, ids = top_k(logits, spec.n_experts_used, backend)
        return jax.nn.softmax(top, axis=-1) * spec.expert_weights_scale, ids.astype(jnp.int32)
    probs = (jax.nn.sigmoid(logits) if spec.expert_gating == "sigmoid"
             else jax.nn.softmax(logits, axis=-1))
    if bias is None and spec.expert_groups <= 1:
        w, ids = top_k(probs, spec.n_experts_used, backend)
    else:
        choose = probs if bias is None else probs + bias.astype(jnp.float32)
        if spec.expert_groups > 1:
            choose = limit_groups(choose, spec.expert_groups, spec.expert_groups_used)
        _, ids = top_k(choose, spec.n_experts_used, backend)
        # [N, k]
        w = jnp.take_along_axis(probs, ids, axis=-1)
    if spec.expert_weights_norm:
        # llama.cpp floors the sum at the smallest normal F16 so that near-zero sigmoid scores
        # cannot divide to inf.
        w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 6.103515625e-5)
    return w * spec.expert_weights_scale, ids.astype(jnp.int32)


def limit_groups(scores: jax.Array, groups: int, used: int) -> jax.Array:
    """DeepSeek-V3's group-limited choice: scores [N, E] (biased where there is a bias) with every
    expert outside the `used` best of the `groups` groups (contiguous E/groups experts each; a
    group's score: the sum of its top 2) set to -inf, as llama.cpp's build_moe_ffn and
    transformers' DeepseekV3TopkRouter."""
    N, E = scores.shape
    g = scores.reshape(N, groups, E // groups)
    group_scores = jnp.sum(jax.lax.top_k(g, min(2, E // groups))[0], axis=-1)          # [N, G]
    _, kept = jax.lax.top_k(group_scores, used)
    mask = jnp.zeros((N, groups), bool).at[jnp.arange(N)[:, None], kept].set(True)
    return jnp.where(mask[:, :, None], g, -jnp.inf).reshape(N, E)


def moe(x: jax.Array, lp: LayerWeights, spec: ModelSpec, backend: str,
        axis: str | None = None) -> jax.Array:
    """Mixture of experts over x [N, h]: each token's top-k experts, weighted; plus the shared
    expert. axis: the mesh axis the experts are sharded over (--split experts; inside shard_map),
    else None."""
    w, ids = route(x, lp.router.weight, spec, backend, lp.router.bias, lp.router.logit_bias)
    if axis is None:
        y = expert_rows(x, ids, ids, lp.experts, spec.n_experts, backend, lp.expert_biases)
    else:
        y = sharded_expert_rows(x, ids, lp.experts, spec.n_experts, backend, axis,
                                lp.expert_biases)
    return combine_experts(x, y, w, lp.shared, backend)


def sharded_expert_rows(x: jax.Array, ids: jax.Array, p: dict[str, Weight], n_experts: int,
                        backend: str, axis: str,
                        biases: ExpertBiases | None = None) -> jax.Array:
    """expert_rows when each device of mesh axis `axis` holds a contiguous E/N of the experts (p's
    leading axis is the local one): each device computes only the rows whose expert it holds (local
    id = id - axis_index * E/N; the others get id -1, which the cpu kernel skips and gives zeros
    for, or are masked), then one psum adds the [N, k, h] rows over the axis. Exactly one device
    gives each row and the others add exact zeros, so the sum is the row itself: the same bits as
    one device (tests/test_devices.py)."""
    held = _leading(p["exp_gate"])                                                          # E/N
    local = ids - jax.lax.axis_index(axis) * held
    mine = (local >= 0) & (local < held)                                                    # [N, k]
    if pk.is_cpu(backend) and isinstance(p["exp_gate"], QTensor):
        # the kernel reads no weights for -1 and gives zeros
        where = jnp.where(mine, local, -1)
    else:
        # XLA's tiles need a real expert: computed, then masked
        where = jnp.where(mine, local, 0)
    # n_experts (all of them, not E/N) fixes the tile count: the same shapes as on one device
    y = expert_rows(x, ids, where, p, n_experts, backend, biases)
    y = jnp.where(mine[..., None], y, 0.0)
    return jax.lax.psum(y, axis)


def _leading(w: Weight) -> int:
    """Experts a [E, ...] expert tensor holds (its local shard inside shard_map)."""
    return int((w.data if isinstance(w, QTensor) else w).shape[0])


def expert_rows(x: jax.Array, ids: jax.Array, where: jax.Array, p: dict[str, Weight], n_groups: int,
                backend: str, biases: ExpertBiases | None = None) -> jax.Array:
    """Each token's k expert outputs, not yet weighted: x [N, h], ids [N, k] -> float32 [N, k, h].

    `where` [N, k] says where each chosen expert's weights are in p's tensors (EXPERT_TENSORS): the
    expert id itself when they hold every expert, an arena slot when they hold a device cache
    (expert tiers). `n_groups` fixes the tile count, so the same rows give the same shapes (and
    bits) either way. A row's result depends only on its own input and expert (tiles multiply rows
    independently).

    `biases` (gpt-oss): each row's expert's biases, read by its true id (ids, not where), added to
    gate, up and down, with the clamped SwiGLU (gpt_oss.swiglu_oai)."""
    N, h = x.shape
    k = ids.shape[1]
    # [N*k, h]
    rows = jnp.repeat(x, k, axis=0)
    flat = ids.reshape(-1)
    if pk.is_cpu(backend) and isinstance(p["exp_gate"], QTensor):
        # The cpu kernel groups rows by expert itself and multiplies each row once: no tiles to fill
        # (a tile of 8 rows for one decode token's expert is 7 rows of padding multiplied).
        e = where.reshape(-1)                                                               # [N*k]
        gate, up = pk.expert_matmul_many(rows, e, [(p[n].data, p[n].qtype)
                                                   for n in ("exp_gate", "exp_up")], backend)
        y = pk.expert_matmul(_expert_act(gate, up, biases, flat), p["exp_down"].data, e,
                             p["exp_down"].qtype, backend)
        return _down_bias(y, biases, flat, e).reshape(N, k, h).astype(jnp.float32)
    g = pk.group_rows(where.reshape(-1), n_groups, pk.expert_tile(backend))
    xt = pk.scatter_rows(rows, g)
    gate = expert_linear_tiles(xt, g.tile_expert, p["exp_gate"], backend)
    up = expert_linear_tiles(xt, g.tile_expert, p["exp_up"], backend)
    if biases is None:
        act = jax.nn.silu(gate) * up
    else:        # the rows' biases laid out as the rows are in the tiles
        act = swiglu_oai(gate + pk.scatter_rows(biases.gate[flat], g),
                         up + pk.scatter_rows(biases.up[flat], g)).astype(gate.dtype)
    y = expert_linear_tiles(act, g.tile_expert, p["exp_down"], backend)
    y = pk.gather_rows(y, g).astype(jnp.float32)
    if biases is not None:
        y = y + biases.down[flat]
    return y.reshape(N, k, h)


def _expert_act(gate: jax.Array, up: jax.Array, biases: ExpertBiases | None,
                ids: jax.Array) -> jax.Array:
    """The experts' activation of rows [M, f] whose experts are ids [M]: silu(gate) * up, or with
    gpt-oss's biases the clamped SwiGLU of the biased gate and up."""
    if biases is None:
        return jax.nn.silu(gate) * up
    return swiglu_oai(gate + biases.gate[ids], up + biases.up[ids])


def _down_bias(y: jax.Array, biases: ExpertBiases | None, ids: jax.Array,
               where: jax.Array) -> jax.Array:
    """y [M, h] plus each row's expert's down bias (gpt-oss); rows the kernel skipped (where -1)
    stay zeros."""
    if biases is None:
        return y
    return jnp.where((where >= 0)[:, None], y + biases.down[ids], 0.0)


def expert_rows_sources(x: jax.Array, ids: jax.Array, where: jax.Array,
                        trees: list[dict[str, QTensor]], backend: str,
                        biases: ExpertBiases | None = None) -> jax.Array:
    """expert_rows with each chosen expert in one of several places (cpu backends, block weights):
    `trees` the places' expert tensors in order (an expert tier's arena slots, then every expert's
    host blocks), `where` [N, k] the expert's index over them in order (pk.expert_matmul_sources),
    -1 none (zeros). One kernel call a product; a row's bits are those expert_rows gives from the
    tree that holds it."""
    N, h = x.shape
    k = ids.shape[1]
    # [N*k, h]
    rows = jnp.repeat(x, k, axis=0)
    e = where.reshape(-1)
    gate, up = pk.expert_matmul_sources(rows, e, [[(t[n].data, t[n].qtype) for t in trees]
                                                  for n in ("exp_gate", "exp_up")], backend)
    y, = pk.expert_matmul_sources(_expert_act(gate, up, biases, ids.reshape(-1)), e,
                                  [[(t["exp_down"].data, t["exp_down"].qtype)
                                                               for t in trees]], backend)
    return _down_bias(y, biases, ids.reshape(-1), e).reshape(N, k, h).astype(jnp.float32)


def combine_experts(x: jax.Array, y: jax.Array, w: jax.Array, shared: Mlp | None,
                    backend: str) -> jax.Array:
    """The weighted sum of the experts' outputs y [N, k, h] (weights w [N, k]), plus the shared
    expert."""
    # element-wise, in expert order: no dot whose path depends on the row count
    if pk.is_cpu(backend):
        out = y[:, 0] * w[:, 0, None]
        for j in range(1, y.shape[1]):
            out = out + y[:, j] * w[:, j, None]
    else:
        out = jnp.einsum("nkh,nk->nh", y, w)
    if shared is not None:
        s = mlp(x, shared.gate, shared.up, shared.down, backend).astype(jnp.float32)
        if shared.gate_inp is not None:
            # g [h]
            x32, g = x.astype(jnp.float32), shared.gate_inp.astype(jnp.float32).reshape(-1)
            score = pk.cpu.f32_matmul(x32, g[None, :])[:, 0] if pk.is_cpu(backend) else x32 @ g
            s = s * jax.nn.sigmoid(score)[:, None]
        out = out + s
    return out.astype(x.dtype)
