"""The C++ attention kernel alone, decode-shaped (docs/BENCHMARKS.md: "The C++ attention kernel
after gpt-oss's sinks and window"): 4 rows of 1 token, 9 query heads over 3 kv heads, head 64, 1,024
cached positions, float32. Prints the best and median microseconds a call over 7 rounds of 200.

    python scripts/attention_decode_bench.py [ROWS] [POSITIONS]     # default 4 1024
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

R, C = (int(a) for a in (sys.argv[1:] + ['4', '1024'][len(sys.argv) - 1:])[:2])
H, K, D = 9, 3, 64
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((R, 1, H, D), np.float32))
kc = jnp.asarray(rng.standard_normal((1, R, C + 1, K, D), np.float32))
vc = jnp.asarray(rng.standard_normal((1, R, C + 1, K, D), np.float32))
slots = jnp.arange(R, dtype=jnp.int32)
pos = jnp.full((R, 1), C - 1, jnp.int32)
f = jax.jit(lambda q, kc, vc: pk.cpu.attention(q, kc, vc, 0, slots, pos))
f(q, kc, vc).block_until_ready()
rounds = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(200):
        f(q, kc, vc).block_until_ready()
    rounds.append((time.perf_counter() - t) / 200 * 1e6)
best, median = min(rounds), sorted(rounds)[3]
print(f"{R} rows x {C} positions: {best:.1f} us best, {median:.1f} us median a call "
      f"({best * 1e3 / (R * H * C):.1f} ns a query head and key)")
