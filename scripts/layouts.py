"""How many window programs a workload compiles, against parallel (the Strata #997 question).

Strata keyed a window's graph on which slots it held: up to 2^P - 1 layouts for P slots (255 for 8),
~13 MiB each, never freed. Here a layout is a window's static shape and slot ids are inputs. On the
cpu backend a window is packed (engine/schedule/scheduler.py): (tokens bucket, logits bucket), one
KV length; on the other backends (groups' rows x tokens, KV bucket): rows bucketed (2, 4, 8, ...),
prompt chunks too (16 ... --prefill), KV lengths to chunk * 2^i.
This runs a mixed workload (random prompt lengths and answer lengths, requests arriving while others
run) on a tiny model at several parallel settings and prints the programs built and the bound.

    python scripts/layouts.py [--parallel 1,2,4,8,16] [--requests 48] [--max-context 2048]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from strata_jax import Engine, EngineConfig
from strata_jax.makers.make_model import make_model


def bound(eng) -> int:
    """Layouts the scheduler can make. Packed windows (the cpu backend): ModelRunner.base_layouts(),
    every (tokens, logits) bucket pair, one KV length. Grouped windows (other backends): decode rows
    alone, prompt rows alone, or both, with prompt rows x chunk within --batch-tokens, times the KV
    buckets."""
    r = eng.runner
    if r.packed:
        return len(r.base_layouts())
    parallel, prefill, batch = (r.cfg.parallel, int(r.choices["prefill"]),
                                int(r.choices["batch_tokens"]))
    rows = 1 + max(0, math.ceil(math.log2(max(parallel, 2))))          # 2, 4, ..., >= parallel
    lengths = [16 << i for i in range(int(math.log2(prefill // 16)) + 1)]
    prompt_rows = [1 << i for i in range(math.ceil(math.log2(max(parallel, 1))) + 1)]
    prompts = sum(1 for p in prompt_rows for n in lengths if p == 1 or p * n <= batch)
    kv = 1 + max(0, math.ceil(math.log2(r.cache_len / r.opts.attn_chunk)))
    if parallel == 1:
        # never decode and read at once
        return (1 + len(lengths)) * kv
    return (rows + prompts + rows * prompts) * kv


def run(model: Path, parallel: int, n_requests: int, max_context: int, prefill: int, seed: int,
        grouped: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    eng = Engine.from_gguf(model, EngineConfig(parallel=parallel, max_context=max_context,
                                               prefill=prefill, warmup=False))
    if grouped:                     # the other backends' windows, on this CPU
        eng.scheduler.packed = eng.runner.packed = False
    handles = []

    def client(i: int) -> None:
        time.sleep(float(rng.uniform(0, 2.0)))
        n_prompt = int(rng.integers(4, max_context // 2))
        n_out = int(rng.integers(4, min(96, max_context - n_prompt)))
        h = eng.submit([int(t) for t in rng.integers(3, 500, n_prompt)], max_tokens=n_out,
                       ignore_eos=True)
        handles.append(h)
        for _ in h:
            pass

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_requests)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = eng.stats()
    eng.close()
    return {"parallel": parallel, "requests": n_requests, "programs": s["programs"]["built"],
            "bound": bound(eng), "prompt_rows_a_window": s["prompt_rows"] / max(1, s["windows"]),
            "strata_0_1_39_bound": 2 ** parallel - 1, "windows": s["windows"],
            "rows_a_window": s["window_rows"] / max(1, s["windows"]), "seconds": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grouped", action="store_true",
                    help="grouped windows (the xla and pallas backends' kind)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = make_model(Path(d) / "tiny.gguf", arch="qwen3moe", layers=2, hidden=64, heads=4,
                           kv_heads=2, experts=8, experts_used=2, expert_ffn=32)[0]
        print(f"# {a.requests} requests, prompts 4..{a.max_context // 2} tokens, answers 4..96, "
              f"--max-context {a.max_context} --prefill {a.prefill}")
        print("| parallel | programs built | bound (layouts possible) | Strata 0.1.39 slot layouts "
              "| windows | rows a window | prompt chunks a window |")
        print("|---|---|---|---|---|---|---|")
        for p in (int(x) for x in a.parallel.split(",")):
            r = run(model, p, a.requests, a.max_context, a.prefill, a.seed, a.grouped)
            print(f"| {p} | {r['programs']} | {r['bound']} | {r['strata_0_1_39_bound']} | "
                  f"{r['windows']} | {r['rows_a_window']:.2f} | {r['prompt_rows_a_window']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
