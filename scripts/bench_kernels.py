"""Kernel throughput of pallas_kernels on this machine.

    python scripts/bench_kernels.py [--types Q4_K,IQ4_XS,IQ3_S] [--backend xla]
        [--rows 2048 --cols 4096] dequantization: GB of GGUF blocks per second
    python scripts/bench_kernels.py --matmul [--types Q4_1,Q4_K,Q8_0] [--m 1,4,8,32,64]
        [--shapes 576x1536,1536x576] x [M, k] @ W^T, W [n, k] (a shape is k x n): the cpu backend on
            GGUF blocks against jnp.dot on the
        dequantized float32 weights, with the blocks' bytes / time
    python scripts/bench_kernels.py --experts [--types Q4_1] [--m 1,4,8] [--shapes 576x1536]
        [--n-experts 8] each row times its expert (top-2 of n-experts, distinct): cpu expert_matmul
            against the xla backend's
    python scripts/bench_kernels.py --decode-chain MODEL.gguf [--m 1]
        [--math int8|int8-blocks|exact|both] every product of one decode step of a dense GGUF model
            (each layer's q, k, v, o, gate, up, down,
        then the output head), chained in one jitted function on the cpu backend with the
            file's real
        weights: the step's products alone, streaming from memory as in the engine (not from L2)

Times are medians of --repeats calls of a jitted function (each includes JAX's dispatch, ~7 us here:
the `noop` line). A k-quant needs k a multiple of 256: its k is rounded down (so 576 becomes 512).
STRATA_CPU_THREADS=1 runs the cpu kernels on one thread. Measure on a quiet machine (the header
shows the load average).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk


def median_us(f, *args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def bench_dequant(qtype: str, backend: str, rows: int, cols: int,
                  repeats: int) -> tuple[float, float]:
    blocks = jax.device_put(pk.random_blocks(qtype, (rows, cols), np.random.default_rng(0)))
    f = jax.jit(lambda b: pk.dequantize(b, qtype, backend=backend))
    us = median_us(f, blocks, repeats=repeats)
    return blocks.nbytes / us / 1e3, rows * cols / us / 1e3


def _k_for(qtype: str, k: int) -> int:
    bs = pk.block_size(pk.as_qtype(qtype))
    return k // bs * bs


def matmul_rows(types, ms, shapes, repeats):
    rng = np.random.default_rng(0)
    cpu = jax.jit(lambda x, b, t: pk.qmatmul(x, b, t, backend="cpu"), static_argnums=2)
    dot = jax.jit(jnp.dot)
    print("| type | k x n | M | cpu us | GB/s of blocks | float32 jnp.dot us | dot / cpu |")
    print("|---|---|---|---|---|---|---|")
    for t in types:
        for k0, n in shapes:
            k = _k_for(t, k0)
            b = jax.device_put(pk.random_blocks(t, (n, k), rng))
            # [k, n] float32
            w = jax.device_put(np.asarray(pk.dequantize(b, t)).T.copy())
            for m in ms:
                x = jax.device_put(rng.standard_normal((m, k)).astype(np.float32))
                c = median_us(cpu, x, b, t, repeats=repeats)
                d = median_us(dot, x, w, repeats=repeats)
                print(f"| {t} | {k} x {n} | {m} | {c:.1f} | {b.nbytes / c / 1e3:.1f} | {d:.1f} | "
                      f"{d / c:.2f} |")


def expert_rows(types, ms, shapes, n_experts, repeats):
    rng = np.random.default_rng(0)
    fns = {be: jax.jit(lambda x, b, i, t, be=be: pk.expert_matmul(x, b, i, t, backend=be),
                       static_argnums=3)
           for be in ("cpu", "xla")}
    print(f"| type | k x n | tokens (x2 rows, top-2 of {n_experts}) | cpu us | GB/s of chosen "
          "blocks | xla us | xla / cpu |")
    print("|---|---|---|---|---|---|---|")
    for t in types:
        for k0, n in shapes:
            k = _k_for(t, k0)
            b = jax.device_put(pk.random_blocks(t, (n_experts, n, k), rng))
            for m in ms:
                ids = np.stack([rng.choice(n_experts, 2, replace=False)
                                for _ in range(m)]).reshape(-1).astype(np.int32)
                x = jax.device_put(rng.standard_normal((2 * m, k)).astype(np.float32))
                chosen = len(set(ids.tolist())) * b.nbytes // n_experts
                c = median_us(fns["cpu"], x, b, jnp.asarray(ids), t, repeats=repeats)
                xl = median_us(fns["xla"], x, b, jnp.asarray(ids), t, repeats=repeats)
                print(f"| {t} | {k} x {n} | {m} | {c:.1f} | {chosen / c / 1e3:.1f} | {xl:.1f} | "
                      f"{xl / c:.2f} |")


def decode_chain(path: str, m: int, repeats: int, math: str) -> None:
    from pallas_kernels import cpu
    from pallas_kernels.layout import layout_for
    from strata_jax.gguf import GGUFModel
    from strata_jax.model.weights import blocks_in_place

    model = GGUFModel.open(path)
    head = "output.weight" if "output.weight" in model.tensors else "token_embd.weight"
    names = [f"blk.{i}.{n}.weight" for i in range(model.spec.n_layers)
             for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                       "ffn_down")] + [head]
    infos = [model.tensors[n] for n in names]
    # "int8" reads the weights packed as the engine loads them (pallas_kernels/cpu/packed.h),
    # "int8-blocks" and "exact" the GGUF blocks in place
    pack = math == "int8"
    ws = [jax.device_put(pk.pack(t.data, t.qtype)) if pack and pk.packs(t.qtype)
          else blocks_in_place(t.data)
          for t in infos]
    lays = [layout_for(t.qtype.name + (pk.PACKED_SUFFIX if pack and pk.packs(t.qtype) else ""),
                       t.row_bytes)
            for t in infos]
    math = "exact" if math == "exact" else "int8"

    def chain(x, ws):
        h = x
        # each product's input depends on the last one's output
        for w, lay in zip(ws, lays):
            k = lay.blocks_in(w.shape[-1]) * lay.values
            h = cpu.qmatmul(jnp.broadcast_to(h[:, :1], (m, k)) * 1e-3, w, lay, math=math)
        return h

    us = median_us(jax.jit(chain), jnp.ones((m, model.spec.hidden), jnp.float32), ws,
                   repeats=repeats)
    total = sum(int(w.nbytes) for w in ws)
    print(f"| {path.rsplit('/', 1)[-1]} | {'int8, packed' if pack else math} | M = {m} | {len(ws)} "
          f"products | {total / 1e6:.1f} MB | {us / 1e3:.2f} ms | {total / us / 1e3:.2f} GB/s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=None)
    ap.add_argument("--backend", default="xla")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--matmul", action="store_true")
    ap.add_argument("--experts", action="store_true")
    ap.add_argument("--m", default=None, help="comma-separated M (tokens for --experts)")
    ap.add_argument("--shapes", default=None, help="comma-separated k x n, e.g. 576x1536,1536x576")
    ap.add_argument("--n-experts", type=int, default=8)
    ap.add_argument("--math", default="both", choices=("int8", "int8-blocks", "exact", "both"),
                    help="--decode-chain's cpu math: int8 (weights packed, as the engine loads "
                         "them), int8-blocks (GGUF blocks in place), exact, or all three (both)")
    ap.add_argument("--decode-chain", default=None, metavar="MODEL.gguf")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    mode = ("decode-chain" if a.decode_chain else "matmul" if a.matmul else "experts" if a.experts
            else "dequantize")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {mode}, load average "
          f"{load:.2f}, STRATA_CPU_THREADS={os.environ.get('STRATA_CPU_THREADS', 'unset')}")
    if a.decode_chain:
        print("| model | rows | products | bytes | median | rate |")
        print("|---|---|---|---|---|---|")
        for m in [int(v) for v in (a.m or "1").split(",")]:
            for math in ("int8", "int8-blocks", "exact") if a.math == "both" else (a.math,):
                decode_chain(a.decode_chain, m, a.repeats or 30, math)
        return
    if a.matmul or a.experts:
        from pallas_kernels import cpu
        print(f"# cpu kernels: {cpu.level() if cpu.available() else cpu.unavailable_reason()}")
        print("# noop jit call: "
              f"{median_us(jax.jit(lambda x: x + 1), jnp.zeros((1, 576)), repeats=300):.1f} us")
        shapes = [tuple(int(v) for v in s.split("x"))
                  for s in (a.shapes or "576x1536,1536x576").split(",")]
        repeats = a.repeats or 200
        if a.matmul:
            matmul_rows((a.types or "Q4_1,Q4_K,Q8_0").split(","),
                        [int(v) for v in (a.m or "1,4,8,32,64").split(",")], shapes, repeats)
        else:
            expert_rows((a.types or "Q4_1").split(","),
                        [int(v) for v in (a.m or "1,4,8").split(",")], shapes, a.n_experts, repeats)
        return
    print(f"# backend {a.backend}, [{a.rows} x {a.cols}] values, median of {a.repeats or 5}")
    print("| type | GB/s of blocks | G values/s |")
    print("|---|---|---|")
    for t in (a.types or "Q4_K,IQ4_XS,IQ3_S").split(","):
        gbs, gvs = bench_dequant(t, a.backend, a.rows, a.cols, a.repeats or 5)
        print(f"| {t} | {gbs:.2f} | {gvs:.2f} |")


if __name__ == "__main__":
    main()
