"""Dequantization throughput of pallas_kernels on this machine (GB of GGUF blocks per second).

    python scripts/bench_kernels.py [--types Q4_K,IQ4_XS,IQ3_S] [--backend xla] [--rows 2048 --cols 4096]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

import pallas_kernels as pk


def bench(qtype: str, backend: str, rows: int, cols: int, repeats: int) -> tuple[float, float]:
    blocks = jax.device_put(pk.random_blocks(qtype, (rows, cols), np.random.default_rng(0)))
    f = jax.jit(lambda b: pk.dequantize(b, qtype, backend=backend))
    f(blocks).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(blocks).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return blocks.nbytes / best / 1e9, rows * cols / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,IQ4_XS,IQ3_S")
    ap.add_argument("--backend", default="xla")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"backend {a.backend}, [{a.rows} x {a.cols}] values, best of {a.repeats}")
    print("| type | GB/s of blocks | G values/s |")
    print("|---|---|---|")
    for t in a.types.split(","):
        gbs, gvs = bench(t, a.backend, a.rows, a.cols, a.repeats)
        print(f"| {t} | {gbs:.2f} | {gvs:.2f} |")


if __name__ == "__main__":
    main()
