"""Decode speed and device-cache hit rate against the cache's size, for both eviction policies, with
and without prefetch.

    python -m strata_jax.bench.sweep [MODEL.gguf] [--experts 16] [--sizes 0.1,0.25,0.5,1]
        [--policies freq,lru] [--prefetch off,on] [--tokens 32] [--weights blocks]
            [--what hits,speed]

With no model it upcycles SmolLM2-135M (`--experts` experts, top-2) into the cache folder. The
workload: a warm-up request, then the real-text chat prompts of PROMPTS one after another,
`--tokens` decoded tokens each (greedy, no early stop), on one slot.

`hits`: one engine with every expert in the device cache records the routing (each layer's lookups
and prefetch guesses; routing does not depend on the cache: same bits), and experts/replay.py
replays that trace through the cache's own bookkeeping for every size x policy x prefetch: the
decode hit rate those engines would report, over the prompts after the warm-up
(tests/test_experts.py checks a replay against a real run). `speed`: each row is a real engine with
`--expert-cache N` (N = the fraction of a layer's experts, at least the top-k), measuring decode
tokens/s (decode time only) and the hit rate; a last row runs `--expert-cache auto` (every expert on
the device, one program a window). Prints Markdown tables, a row as soon as it is measured. JAX's
persistent compilation cache (the engine's, in the cache folder) spares most builds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..config import EngineConfig
from ..engine import Engine

WARMUP = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPTS = [
    "Explain how a refrigerator keeps food cold, step by step.",
    "What are the main causes of the French Revolution?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for growing tomatoes on a balcony.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue? Answer for a ten-year-old.",
]


def _measure(path, cache, policy: str, prefetch: bool, tokens: int, weights: str) -> dict:
    cfg = EngineConfig(parallel=1, max_context=256, weights=weights, expert_cache=cache,
                       expert_policy=policy, expert_prefetch=prefetch)
    t0 = time.perf_counter()
    with Engine.from_gguf(path, cfg) as eng:
        load_s = time.perf_counter() - t0
        chat = [{"role": "user", "content": WARMUP}]
        # build programs, warm the cache
        eng.generate(chat, max_tokens=8, ignore_eos=True)
        n_tok = gen_s = lookups = hits = moved = pre = pre_hits = 0
        for prompt in PROMPTS:
            out = eng.generate([{"role": "user", "content": prompt}], max_tokens=tokens,
                               ignore_eos=True)
            # the first one came with the prompt
            n_tok += out.stats["generated_tokens"] - 1
            gen_s += out.stats["generate_ms"] / 1000
            ex = out.stats.get("experts") or {}
            lookups += ex.get("decode_lookups", 0)
            hits += ex.get("decode_hits", 0)
            moved += ex.get("bytes_moved", 0)
            pre += ex.get("prefetched", 0)
            pre_hits += ex.get("prefetch_hits", 0)
        return {"slots": eng.stats()["experts"].get("device_slots"), "tok_s": n_tok / gen_s,
                "hit": 100.0 * hits / lookups if lookups else 100.0, "moved": moved,
                "load_s": load_s, "prefetched": pre, "prefetch_hits": pre_hits}


def _trace(path, tokens: int, weights: str, n_experts: int) -> tuple[list, int]:
    """The routing of the workload: (trace, index of the first entry after the warm-up request)."""
    cfg = EngineConfig(parallel=1, max_context=256, weights=weights, expert_cache=n_experts,
                       expert_prefetch=True)
    with Engine.from_gguf(path, cfg) as eng:
        eng.runner.stepper.trace = trace = []
        eng.generate([{"role": "user", "content": WARMUP}], max_tokens=8, ignore_eos=True)
        start = len(trace)
        for prompt in PROMPTS:
            eng.generate([{"role": "user", "content": prompt}], max_tokens=tokens, ignore_eos=True)
        return trace, start


def _hit_table(path, spec, runs, tokens: int, weights: str) -> None:
    import pickle

    from ..experts.replay import replay
    from ..fetch import cache_dir

    saved = cache_dir() / f"{path.stem}-trace-{len(PROMPTS)}x{tokens}.pkl"
    if saved.exists():
        trace, start = pickle.loads(saved.read_bytes())
    else:
        trace, start = _trace(path, tokens, weights, spec.n_experts)
        saved.write_bytes(pickle.dumps((trace, start)))
    print("\nhit rates by replaying the routing of the workload "
          f"({sum(e[0] == 'lookup' for e in trace[start:])} layer lookups after the warm-up; trace "
          f"{saved})")
    print("| device cache (slots a layer) | policy | prefetch | decode hit rate | all lookups hit "
          "rate | experts copied a decode token | prefetched (used) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    layers = list(spec.moe_layers)
    for size, n, policy, prefetch in runs:
        if n == "auto":
            continue
        c = replay(trace, layers, spec.n_experts, n, policy, prefetch, count_from=start)
        # one slot
        tokens_decoded = sum(1 for e in trace[start:] if e[0] == "lookup" and e[3]) / len(layers)
        copied = c.decode_misses + (c.prefetched if prefetch else 0)
        print(f"| {size} | {policy} | {'on' if prefetch else 'off'} | "
              f"{100.0 * c.decode_hits / max(c.decode_lookups, 1):.1f}% | "
              f"{100.0 * c.hits / max(c.lookups, 1):.1f}% | {copied / max(tokens_decoded, 1):.1f} "
              f"| {c.prefetched} ({c.prefetch_hits}) |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--experts", type=int, default=16,
                    help="experts a layer when upcycling SmolLM2 (top-2)")
    ap.add_argument("--sizes", default="0.1,0.25,0.5,1")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--weights", default="blocks", choices=["blocks", "dequantized", "auto"])
    ap.add_argument("--policies", default="freq,lru")
    ap.add_argument("--prefetch", default="off", help="off, on, or off,on")
    ap.add_argument("--no-auto", action="store_true", help="skip the all-on-device row")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help="the first N prompts of the workload")
    ap.add_argument("--what", default="hits,speed",
                    help="hits (by trace replay), speed (real runs), or both")
    a = ap.parse_args(argv)
    del PROMPTS[a.prompts:]
    path = a.model
    if path is None:
        from ..fetch import cache_dir, smollm2_path
        from ..makers.upcycle import upcycle

        path = cache_dir() / f"smollm2-{a.experts}x2.gguf"
        if not path.exists():
            upcycle(smollm2_path(), path, experts=a.experts, top_k=2)
    from ..gguf import GGUFModel

    spec = GGUFModel.open(path).spec
    n_experts = spec.n_experts
    print(f"model {path}: {n_experts} experts a layer, top-{spec.n_experts_used}, {spec.n_layers} "
          f"layers; {len(PROMPTS)} requests of {a.tokens} decoded tokens after a warm-up one")
    runs = []
    for f in (float(x) for x in a.sizes.split(",")):
        n = max(spec.n_experts_used, round(f * n_experts))
        for p in a.policies.split(","):
            for pre in a.prefetch.split(","):
                runs.append((f"{f:.0%} ({n})", n, p, pre == "on"))
    if not a.no_auto:
        runs.append(("auto (all, one program)", "auto", "freq", False))
    if "hits" in a.what:
        _hit_table(Path(path), spec, runs, a.tokens, a.weights)
    if "speed" not in a.what:
        return
    print("\nreal runs")
    print("| device cache (slots a layer) | policy | prefetch | decode tok/s | decode hit rate | "
          "MiB moved | prefetched (used) | load s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for size, n, policy, prefetch in runs:
        # a row as soon as it is measured
        r = _measure(path, n, policy, prefetch, a.tokens, a.weights)
        print(f"| {size} | {policy if n != 'auto' else '-'} | {'on' if prefetch else 'off'} | "
              f"{r['tok_s']:.2f} | {r['hit']:.1f}% | {r['moved'] / 2**20:.1f} | {r['prefetched']} "
              f"({r['prefetch_hits']}) | {r['load_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
