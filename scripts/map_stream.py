"""How fast the int8 kernel streams a model's expert blocks at one row (decode's case), read in
place from the GGUF file's map (the page cache, 4 KiB pages) against the same bytes copied into
anonymous memory (issue 36: is a larger-than-RAM model's map slower to stream than RAM?).

    python scripts/map_stream.py MODEL.gguf [LAYERS]

The first LAYERS (default 4) MoE layers' gate, up and down expert tensors (GGUF blocks, every
expert of a layer as one matrix), one product of a row of ones each, timed as the best of 3 passes
over all of them: GB of blocks a second. Run it when the file's pages are in the page cache (a
first pass reads them) and on a quiet machine. Session 38 (Zen 4, the 37.4 GiB qwen3moe Q8_0 file,
6 layers, 4.8 GB): 19.7-21.1 GB/s from either: the map's pages are not what makes decode slower
than the kernel's rate.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import cpu
from pallas_kernels.layout import layout_for
from strata_jax.gguf import GGUFModel


def expert_blocks(model: GGUFModel, layers: int) -> list[np.ndarray]:
    """Each expert tensor of the first `layers` layers as [experts x rows, row_bytes] views of the
    map."""
    out = []
    for layer in range(layers):
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            data = model.tensors[f"blk.{layer}.{name}.weight"].data
            out.append(data.reshape(-1, data.shape[-1]))
    return out


def rate(arrays: list, qtype, repeats: int = 3) -> float:
    """GB of blocks a second over one product a matrix (the best of `repeats` passes)."""
    gb = sum(a.nbytes for a in arrays) / 1e9
    lays = [layout_for(qtype, a.shape[-1]) for a in arrays]
    # values a row: the row's blocks times the values a block
    ks = [a.shape[-1] // lay.nbytes * lay.values for a, lay in zip(arrays, lays)]
    xs = {k: jnp.ones((1, k), jnp.float32) for k in ks}

    def one_pass():
        for a, lay, k in zip(arrays, lays, ks):
            jax.block_until_ready(cpu.qmatmul(xs[k], a, lay, math="int8"))

    one_pass()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t0)
    return gb / best


def main() -> None:
    model = GGUFModel.open(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    views = expert_blocks(model, layers)
    qtype = model.tensors["blk.0.ffn_gate_exps.weight"].qtype
    gb = sum(a.nbytes for a in views) / 1e9
    # device_put of a 64-byte aligned map view is the engine's way: no copy on a CPU
    mapped = [jax.device_put(a) for a in views]
    name = pk.as_qtype(qtype).name
    print(f"{gb:.2f} GB of {name} blocks; from the map: {rate(mapped, qtype):.1f} GB/s", flush=True)
    anon = [jax.device_put(np.array(a)) for a in views]
    print(f"an anonymous copy: {rate(anon, qtype):.1f} GB/s", flush=True)
    print(f"the map again: {rate(mapped, qtype):.1f} GB/s; "
          f"the copy again: {rate(anon, qtype):.1f} GB/s")


if __name__ == "__main__":
    main()
