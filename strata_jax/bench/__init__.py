"""`strata-jax bench`: engine-level speed figures, optionally beside llama.cpp's on the same GGUF.

    from strata_jax.bench import BenchOptions, run_bench
    result = run_bench(BenchOptions(model="model.gguf", vs="llama.cpp"))   # a JSON-ready dict

Files: `options` (what to measure), `machine` (CPU, versions, memory bandwidth, thread limit),
`traffic` (weight bytes one decode step reads), `ours` (the Engine), `llamacpp` (llama-cpp-python's
low-level API, batched decoding), `report` (the table), `run` (all of it in order).
"""

from strata_jax.bench.options import BenchOptions
from strata_jax.bench.run import run_bench

__all__ = ["BenchOptions", "run_bench"]
