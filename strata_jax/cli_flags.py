"""Engine flags on the command line: one flag a field of EngineConfig (`max_context` <-> `--max-context`),
so serve, generate and bench take the same flags and Python users the same names."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from . import envs
from .config import ConfigError, EngineConfig

HELP = {
    "parallel": "slots: conversations decoded together",
    "max_context": "tokens a slot holds (prompt + answer)",
    "kv": "KV cache type: bf16, f16, f32, int8 or auto",
    "prefill": "prompt tokens a window reads for one slot (auto or a power of two)",
    "batch_tokens": "tokens a window holds: every decoding row plus prompt chunks of as many reading slots as fit "
                    "(llama.cpp's --batch-size, vLLM's max_num_batched_tokens; auto: 512 on a CPU, 2048 on a GPU)",
    "spec": "draft tokens a row (speculative decoding)",
    "spec_min_p": "stop drafting below this drafter probability",
    "spec_max_rows": "draft only while at most this many slots decode (0: always), like vLLM's speculative_disable_by_batch_size",
    "drafter": "ngram, mtp, none or draft:PATH.gguf",
    "expert_cache": "experts on the device: auto or a number of expert slots",
    "expert_profile": "expert hotness file: preload and pin the hottest experts",
    "expert_policy": "device expert cache eviction: freq (frequency-aware LRU) or lru",
    "host_experts": "a window's layer whose experts miss the device cache computes them where they live, from the "
                    "host tier's GGUF blocks with the CPU expert kernel, instead of copying them in (auto: by the cost "
                    "rule printed at start; on, off)",
    "pcie_frac": "up to this fraction of a layer's routed experts in a window are read by the device straight from "
                 "host memory (JAX's pinned_host memory kind) instead of being copied into the device cache; the "
                 "coldest misses first (0: off; an error where the device has no pinned_host memory)",
    "host_device": "the CPU device that computes host experts: auto (the device itself on a CPU, the first CPU device "
                   "beside a GPU) or cpu:N",
    "layer_step": "expert tiers: auto runs a window as one program whenever its experts are where one program can "
                  "read them (every routed expert in the device cache, or the host tier's blocks with --host-experts), "
                  "else layer by layer; always: every window layer by layer",
    "expert_prefetch": "copy the experts the next layer will likely need into the device cache ahead of it",
    "resident_budget_gib": "host RAM for experts, GiB",
    "pool_workers": "file-tier reader threads",
    "vram_reserve_mib": "device memory kept free, MiB",
    "device_memory_mib": "device-memory budget the engine enforces, MiB",
    "max_programs": "live compiled windows (LRU; 0 = no bound; env STRATA_BATCH_GRAPHS)",
    "prefix_cache": "keep each slot's KV after its request and reuse the longest matching prefix",
    "conversation_cache_mib": "host RAM for evicted conversations' KV, MiB",
    "conversation_cache_slots": "conversations kept in host RAM",
    "kv_resident": "a slot's KV beyond this many tokens lives in host RAM (a multiple of the attention chunk)",
    "attn_chunk": "keys an attention step reads: auto (256, less for a small max context) or a power of two",
    "weights": "blocks, dequantized or auto (blocks where a kernel reads them: the cpu or pallas backend; else dequantized when small)",
    "backend": "kernel backend: auto (cpu on a CPU when its C++ kernels are built, pallas on a GPU, else xla), xla, cpu, pallas or interpret",
    "dtype": "activations: auto, float32 or bfloat16",
    "request_timeout_s": "a request's deadline, seconds",
    "seed": "default sampling seed",
    "warmup": "build the base window programs at start (decode rows alone, a prompt chunk alone, both); a layout "
              "met later is built off the engine thread while windows of built layouts run (off: each layout is "
              "built when first met, and its window waits)",
    "compile_cache": "keep compiled programs in <cache folder>/jax-compile (private) so a restart does not compile "
                     "again (env STRATA_JAX_COMPILE_CACHE=DIR or off)",
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        if f.name == "max_programs":
            default = _env_max_programs()
        if isinstance(default, bool):
            g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=f"{HELP.get(f.name, '')} (default {default})")
            continue
        kind = {"int": int, "float": float}.get(type(default).__name__, str)
        if f.name in ("resident_budget_gib", "device_memory_mib"):
            kind = float
        if f.name == "kv_resident":
            kind = int
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=argparse.SUPPRESS,
                       metavar="X", help=f"{HELP.get(f.name, '')} (default {default})")


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if "max_programs" not in values and "max_programs" not in overrides:
        values["max_programs"] = _env_max_programs()     # the flag's default: env STRATA_BATCH_GRAPHS, else 64
    return EngineConfig(**{**overrides, **values})


def _env_max_programs() -> int:
    try:
        return envs.max_programs()
    except envs.EnvError as e:
        raise ConfigError(str(e)) from None
