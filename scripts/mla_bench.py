"""MLA at decode, for a deepseek2 GGUF (docs/BENCHMARKS.md: "gpt-oss and DeepSeek-V3-class models
made at 1 GB against llama.cpp (issue 37)"):

1. KV bytes a token from the engine's ledger (kv_cache.kv_bytes: what it reserves a slot and
   position): the file's latent cache, the same layers with full attention (every head's keys,
   nope + rope, and values, v), and the real DeepSeek-V3 shape (61 layers, 128 heads, kv_lora 512,
   rope 64, nope 128, v 128; its MTP layer left out), in float32 (the engine's cpu default) and
   2 bytes (bfloat16; llama.cpp's f16 cache is the same size).
2. The absorbed and unabsorbed forms: the attention halves of every layer, one decode token of one
   sequence over C cached positions, jitted whole, the weights as the engine holds them (GGUF
   blocks packed, float32, the cpu backend's products). Three forms over the same cache of latents
   [c ; k_pe]:
     absorbed, C++ kernel: what the engine runs (mla.attention on the cpu backend: q~ = W_kb^T
         q_nope against the cache in place, pk.cpu.attention, then W_vb and W_o);
     absorbed, XLA: the same arithmetic with layers.attend (XLA) for the attention;
     unabsorbed, XLA: mla.unabsorbed, every head's keys and values decompressed from the C latents
         (W_kb c, W_vb c a position and head), multi-head attention, then W_o.
   The FFN halves are the same in every form and left out; the cache entry's write (one position)
   too. Best and median milliseconds a token over 7 rounds of 5 calls (3 of 1 where a call takes
   over a second), for each C; the three outputs are checked equal first.

    PYTHONPATH=. python3 scripts/mla_bench.py /work/bench/deepseek2-1g.gguf [C ...]
"""

import sys
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from strata_jax.engine.execute.kv_cache import kv_bytes
from strata_jax.gguf import GGUFModel
from strata_jax.model import mla
from strata_jax.model.layers import attend
from strata_jax.model.load import load_params
from strata_jax.model.weights import linear

model = GGUFModel.open(sys.argv[1])
lengths = [int(a) for a in sys.argv[2:]] or [256, 1024, 4096]
spec = model.spec


def per_token(spec, dtype) -> int:
    # the ledger reserves (device_len + 1) positions a slot: one more position is one token's bytes
    return kv_bytes(spec, dtype, 1, 1) - kv_bytes(spec, dtype, 1, 0)


def full_attention(spec):
    """The same layers with every head's keys (nope + rope) and values (v) cached."""
    m = spec.mla
    return replace(spec, mla=None, n_kv_heads=spec.n_heads, head_dim=m.nope + m.rope,
                   value_dim=m.v_head)


v3 = replace(spec, n_layers=61, n_heads=128, n_nextn=0, head_dim=512 + 64, value_dim=512,
             mla=replace(spec.mla, kv_lora=512, rope=64, nope=128, v_head=128))
print("| model | layers | MLA (latent + rope key) f32 / 2 B | full attention f32 / 2 B | ratio |")
print("|---|---:|---|---|---:|")
for name, s in ((sys.argv[1], spec), ("DeepSeek-V3 shape", v3)):
    mla_b, full_b = ((per_token(x, jnp.float32), per_token(x, jnp.bfloat16))
                     for x in (s, full_attention(s)))
    print(f"| {name} | {s.n_kv_layers} | {mla_b[0]:,} / {mla_b[1]:,} B | "
          f"{full_b[0]:,} / {full_b[1]:,} B | {full_b[0] / mla_b[0]:.1f}x |")
print()

layers = load_params(model, "blocks", "float32", experts=False, pack=True)["layers"]
L, kv_lora, D = len(layers), spec.mla.kv_lora, spec.head_dim
rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(1, 1, spec.hidden)), jnp.float32)
slots = jnp.zeros((1,), jnp.int32)


def absorbed_kernel(layers, x, cache, pos):
    out = []
    for i, lp in enumerate(layers):
        q_nope, q_pe, _ = mla.project(lp, spec, "cpu", x, pos)
        q = mla.absorbed_query(lp, spec, q_nope, q_pe)
        lat = pk.cpu.attention(q, cache, cache, i, slots, pos)
        out.append(mla.out_projection(lp, spec, "cpu", lat[..., :kv_lora]))
    return jnp.stack(out)


def absorbed_xla(layers, x, cache, pos):
    out = []
    for i, lp in enumerate(layers):
        q_nope, q_pe, _ = mla.project(lp, spec, "cpu", x, pos)
        q = mla.absorbed_query(lp, spec, q_nope, q_pe)
        k = cache[i, :, :-1]                                         # [1, C, 1, kv_lora + rope]
        lat = attend(q, k, k[..., :kv_lora], pos, min(512, k.shape[1]))
        out.append(mla.out_projection(lp, spec, "cpu", lat))
    return jnp.stack(out)


def unabsorbed_xla(layers, x, cache, pos):
    out = []
    for i, lp in enumerate(layers):
        q_nope, q_pe, _ = mla.project(lp, spec, "cpu", x, pos)
        k = cache[i, :, :-1]
        o = mla.unabsorbed(lp, spec, q_nope, q_pe, k, pos, min(512, k.shape[1]))
        out.append(linear(o.reshape(1, 1, -1), lp.wo, "cpu"))
    return jnp.stack(out)


def best_median(f, *args):
    """Best and median ms a call: 7 rounds of 5 calls, or 3 of 1 where a call takes over a second
    (the unabsorbed form at thousands of positions)."""
    t = time.perf_counter()
    f(*args).block_until_ready()
    n_rounds, calls = (3, 1) if time.perf_counter() - t > 1.0 else (7, 5)
    rounds = []
    for _ in range(n_rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f(*args).block_until_ready()
        rounds.append((time.perf_counter() - t) / calls * 1e3)
    return min(rounds), sorted(rounds)[n_rounds // 2]


print(f"{sys.argv[1]}: {L} layers, {spec.n_heads} heads, kv_lora {kv_lora}, rope {spec.mla.rope}, "
      f"nope {spec.mla.nope}, v {spec.mla.v_head}; jax {jax.__version__}")
print("| cached positions | absorbed, C++ kernel (engine) | absorbed, XLA | unabsorbed, XLA |")
print("|---:|---|---|---|")
for C in lengths:
    # [layers, slots, C + 1, 1, kv_lora + rope]: the engine's layout (device_len + 1 positions)
    cache = jnp.asarray(rng.normal(size=(L, 1, C + 1, 1, D)).astype(np.float32))
    pos = jnp.full((1, 1), C - 1, jnp.int32)
    outs, cells = [], []
    for form in (absorbed_kernel, absorbed_xla, unabsorbed_xla):
        f = jax.jit(form)
        outs.append(np.asarray(f(layers, x, cache, pos)))
        best, median = best_median(f, layers, x, cache, pos)
        cells.append(f"{best:.2f} / {median:.2f} ms")
    # the three forms are one computation: a check that the timings are of the same thing
    scale = float(np.abs(outs[2]).max())
    for o in outs[:2]:
        np.testing.assert_allclose(o, outs[2], rtol=0, atol=2e-3 * scale)
    print(f"| {C:,} | " + " | ".join(cells) + " |", flush=True)
