"""Decode speed and device-cache hit rate against the cache's size, for both eviction policies.

    python -m strata_jax.experts.sweep [MODEL.gguf] [--sizes 0.1,0.25,0.5,1] [--tokens 32] [--weights blocks]

With no model it upcycles SmolLM2-135M (8 experts, top-2) into the cache folder. Each row is one engine
with `--expert-cache N` (N = the fraction of a layer's experts, at least 1) and one policy; one request
warms it up (programs, cache), a second one is measured. A last row runs `--expert-cache auto` (every
expert on the device, one program a window) for comparison. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

from ..config import EngineConfig
from ..engine import Engine

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _measure(path, cache, policy: str, tokens: int, weights: str) -> dict:
    cfg = EngineConfig(parallel=1, max_context=512, warmup=False, weights=weights, expert_cache=cache)
    t0 = time.perf_counter()
    with Engine.from_gguf(path, cfg, expert_policy=policy) as eng:
        load_s = time.perf_counter() - t0
        eng.generate(PROMPT, max_tokens=8, ignore_eos=True)                    # build programs, warm the cache
        out = eng.generate(PROMPT + " Then", max_tokens=tokens, ignore_eos=True)
        ex = out.stats.get("experts") or {}
        n, h = ex.get("decode_lookups", 0), ex.get("decode_hits", 0)
        return {"slots": eng.stats()["experts"].get("device_slots"), "policy": policy if cache != "auto" else "-",
                "tok_s": out.stats["predicted_per_second"], "hit": 100.0 * h / n if n else 100.0,
                "moved": ex.get("bytes_moved", 0), "load_s": load_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--sizes", default="0.1,0.25,0.5,1")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--weights", default="blocks", choices=["blocks", "dequantized", "auto"])
    ap.add_argument("--policies", default="freq,lru")
    a = ap.parse_args(argv)
    path = a.model
    if path is None:
        from ..testing import cache_dir, smollm2_path
        from ..testing.upcycle import upcycle

        path = cache_dir() / "smollm2-8x2.gguf"
        if not path.exists():
            upcycle(smollm2_path(), path, experts=8, top_k=2)
    from ..gguf import GGUFModel

    n_experts = GGUFModel.open(path).spec.n_experts
    print("| device cache (slots a layer) | policy | decode tok/s | decode hit rate | MiB moved | load s |")
    print("|---|---|---|---|---|---|", flush=True)
    runs = [(f"{f:.0%} ({max(1, round(f * n_experts))})", max(1, round(f * n_experts)), p)
            for f in (float(x) for x in a.sizes.split(",")) for p in a.policies.split(",")]
    for size, n, policy in runs + [("auto (all)", "auto", "freq")]:
        r = _measure(path, n, policy, a.tokens, a.weights)            # a row as soon as it is measured
        print(f"| {size} | {r['policy']} | {r['tok_s']:.2f} | {r['hit']:.1f}% | {r['moved'] / 2**20:.1f} | "
              f"{r['load_s']:.1f} |", flush=True)

if __name__ == "__main__":
    main()
