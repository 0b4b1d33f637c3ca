"""The C++ attention kernel alone, decode-shaped (docs/BENCHMARKS.md: "The C++ attention kernel
after gpt-oss's sinks and window", and session 32's "reads tiles whole"): ROWS rows of 1 token at
position POSITIONS - 1, 9 query heads over 3 kv heads, head 64 (SmolLM2's), one call a layer for
LAYERS layers in one program (30: SmolLM2's, whose caches at a few hundred positions no longer fit
in the L3 cache, as in a real decode step; 1: the cache stays in cache), a DTYPE cache (f32, f16,
bf16). Prints the best and median microseconds a program over 7 rounds.

    python scripts/attention_decode_bench.py [ROWS] [POSITIONS] [LAYERS] [DTYPE]

(defaults: 4 1024 1 f32)
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

args = sys.argv[1:] + ["4", "1024", "1", "f32"][len(sys.argv) - 1:]
R, C, LAYERS, DTYPE = int(args[0]), int(args[1]), int(args[2]), args[3]
H, K, D = 9, 3, 64
cast = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}[DTYPE]
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((R, 1, H, D), np.float32))
kc = jnp.asarray(rng.standard_normal((LAYERS, R, C + 1, K, D), np.float32)).astype(cast)
vc = jnp.asarray(rng.standard_normal((LAYERS, R, C + 1, K, D), np.float32)).astype(cast)
slots = jnp.arange(R, dtype=jnp.int32)
pos = jnp.full((R, 1), C - 1, jnp.int32)


def layers(q, kc, vc):
    for i in range(LAYERS):            # each layer's output the next one's query: one chain
        q = pk.cpu.attention(q, kc, vc, i, slots, pos)
    return q


f = jax.jit(layers)
f(q, kc, vc).block_until_ready()
calls = max(1, 200 // LAYERS)
rounds = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(calls):
        f(q, kc, vc).block_until_ready()
    rounds.append((time.perf_counter() - t) / calls * 1e6)
best, median = min(rounds), sorted(rounds)[3]
read = LAYERS * R * C * K * D * 2 * jnp.dtype(cast).itemsize
print(f"{R} rows x {C} positions x {LAYERS} layers, {DTYPE}: {best:.1f} us best, {median:.1f} us "
      f"median a program ({best * 1e3 / (LAYERS * R * H * C):.1f} ns a query head and key; "
      f"{read / best / 1e3:.1f} GB/s of keys and values)")
