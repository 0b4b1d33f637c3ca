"""The config's "auto" choices made for this machine (backend, dtype, KV type, weights, prompt
chunk, window budget), once at start: the runner and everything it makes read them from
`ModelRunner.choices`."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

import pallas_kernels as pk

from ..config import ConfigError, EngineConfig
from ..gguf import GGUFModel
from .host_memory import cgroup_available, meminfo

KV_DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16, "int8": jnp.int8}
# Below this many float32 bytes a CPU keeps dequantized weights (see model/weights.py).
DEQUANTIZE_LIMIT = 4 << 30

log = logging.getLogger("strata_jax.engine")


def available_ram() -> int | None:
    """Bytes of RAM available now (/proc/meminfo's MemAvailable, less where a memory cgroup over
    this process has less left: a container's limit), or None where it cannot be read."""
    avail = meminfo("MemAvailable")
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    left = cgroup_available()
    return left if avail is None else (avail if left is None else min(avail, left))


def packable_bytes(model: GGUFModel) -> int:
    """Bytes of the tensors packing would copy (matrices and experts of the types pk.packs): at most
    that much private memory where the file's pages would serve (the expert tiers pack only what
    they hold)."""
    return sum(t.n_bytes for t in model.tensors.values() if packable(t))


def packable(t) -> bool:
    """Whether packing (cpu/packed.h) copies this GGUF tensor: a matrix or experts of a type it
    packs."""
    return len(t.shape) in (2, 3) and pk.packs(t.qtype)


def resolve(cfg: EngineConfig, model: GGUFModel) -> dict:
    """Turn the config's "auto" choices into this machine's: backend (with --cpu-math on the cpu
    backend), dtype, kv, weights ("blocks" or "dequantized"; "pack": whether blocks are packed),
    prefill."""
    on_gpu = jax.default_backend() == "gpu"
    backend = pk.resolve_backend(cfg.backend)
    if pk.is_cpu(backend):
        # the math is part of the backend's name ("cpu" | "cpu-exact"): every program's options
        # carry it as data, and stats show which one runs
        backend = pk.cpu_backend(cfg.cpu_math)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    kv = cfg.kv if cfg.kv != "auto" else ("bf16" if on_gpu else "f32")
    if kv == "bf16" and not on_gpu:
        # XLA's CPU backend computes bfloat16 in float32: each layer's write into a bfloat16 cache
        # converts the whole cache there and back (measured: SmolLM2 decode 18 tok/s against 110)
        log.warning("kv = bf16 on a CPU: every layer's KV write converts the whole cache (XLA "
                    "computes bfloat16 in float32), decode is several times slower; --kv f16 or "
                    "int8 keep the same bytes or fewer without it")
    weights = cfg.weights
    # Packed blocks (cpu/packed.h) are read by the int8 products only: the "cpu" backend's default.
    # The exact math, the xla and pallas backends read GGUF blocks as they lie.
    int8 = pk.is_cpu(backend) and pk.cpu_math(backend) == "int8"
    if weights == "packed" and not int8:
        raise ConfigError("weights = packed: packed weights are read by the cpu backend's int8 "
                          f"math only (backend {backend!r} here): use --weights blocks")
    pack = weights == "packed" or (weights == "auto" and int8)
    if weights == "auto" and pack:
        # packing copies those bytes into private memory: only while that leaves half the RAM free
        # (a model near or past the RAM's size keeps reading the file's pages, as llama.cpp's mmap
        # does)
        need, avail = packable_bytes(model), available_ram()
        if avail is not None and need > avail // 2:
            pack = False
            log.info("weights: GGUF blocks in place, not packed: packing would copy %.1f GiB, more "
                     "than half of the %.1f GiB of RAM available (--weights packed packs anyway)",
                     need / 2**30, avail / 2**30)
    if weights in ("auto", "packed"):
        # The cpu and pallas kernels read GGUF blocks at memory speed: keep them. XLA alone on a CPU
        # has no fast low-bit path, so there a small model gets a float copy (DESIGN.md, Speed).
        f32_bytes = 4 * sum(t.n_values for t in model.tensors.values())
        small = f32_bytes <= DEQUANTIZE_LIMIT
        weights = "dequantized" if (backend == "xla" and not on_gpu and small) else "blocks"
    prefill = cfg.prefill if cfg.prefill != "auto" else (1024 if on_gpu else 256)
    # auto: the budget measured best here on a CPU (docs/BENCHMARKS.md, issue 15); on a GPU vLLM's
    # default for online serving (not measured here: no GPU was at hand). Never below one whole
    # prompt chunk.
    batch = (cfg.batch_tokens if cfg.batch_tokens != "auto"
             else max(prefill, 2048 if on_gpu else 512))
    if batch < prefill:
        raise ConfigError(f"batch_tokens = {batch}: must be at least the prompt chunk a window "
                          f"reads (prefill = {prefill}): a window holds at least one whole chunk")
    return {"backend": backend, "dtype": dtype, "kv": kv, "weights": weights, "pack": pack,
            "prefill": prefill, "batch_tokens": batch}
