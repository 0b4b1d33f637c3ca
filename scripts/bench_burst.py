"""B requests arriving at once, ours against llama.cpp's batched decode, in one run (issue 15's
measure).

Each of B requests has a prompt of --prompt-tokens random ids and generates --tokens tokens (greedy,
no EOS). The figure is (prompt + generated tokens of all B) / wall time from the first submit to the
last token. Ours: after a warm-up burst on other prompts of the same length (and after the warm-up's
background builds), once on fresh prompts and once more on the same prompts (their KV is then in the
prefix cache), with the programs compiled during each burst (0: nothing was compiled while serving)
and the time to first token. llama.cpp (llama-cpp-python's low-level API, as bench/llamacpp.py): one
context of B sequences, the B prompts through llama_decode in batches of --llama-batch tokens, then
one token a sequence a step, like llama-batched-bench; its "again" is the same prompts once more (it
keeps no prefix across these runs).

    python scripts/bench_burst.py [MODEL.gguf] [--parallel-list 8,32] [--prompt-tokens 128]
        [--tokens 64] [--threads 2] [--no-llama] [--json OUT] [--batch-tokens N] [--expert-cache N]

Measure on a quiet machine: the header prints the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from strata_jax.bench.machine import limit_threads, load_average
from strata_jax.bench.ours import _drain, prompt_ids


def ours_burst(eng, prompts: list[list[int]], tokens: int) -> dict:
    compiles = eng.stats()["programs"]["compiles"]
    t = time.perf_counter()
    handles = [eng.submit(p, max_tokens=tokens, temperature=0.0, ignore_eos=True) for p in prompts]
    times, _ = _drain(handles)
    wall = time.perf_counter() - t
    ttft = sorted(ts[0] - t for ts in times)
    return {"tokens_per_second": sum(len(p) + tokens for p in prompts) / wall, "seconds": wall,
            "ttft_p50": ttft[len(ttft) // 2], "ttft_max": ttft[-1],
            "compiles": eng.stats()["programs"]["compiles"] - compiles}


def measure_ours(model: str, bs: list[int], plen: int, tokens: int, extra: dict) -> dict:
    from strata_jax import Engine, EngineConfig

    t = time.perf_counter()
    eng = Engine.from_gguf(model, EngineConfig(parallel=max(bs),
                                               max_context=max(256, plen + tokens + 16), **extra))
    eng.wait_for_programs()
    out = {"load_seconds": time.perf_counter() - t,
           "programs_after_load": eng.stats()["programs"]["built"], "runs": {}}
    vocab = eng.spec.vocab_size
    for b in bs:
        # warm-up
        ours_burst(eng, [prompt_ids(vocab, plen, 10_000 + 100 * b + i) for i in range(b)], tokens)
        prompts = [prompt_ids(vocab, plen, 20_000 + 100 * b + i) for i in range(b)]
        out["runs"][b] = {"fresh": ours_burst(eng, prompts, tokens),
                          "again": ours_burst(eng, prompts, tokens)}
    st = eng.stats()
    out["stats"] = {k: st[k] for k in ("windows", "window_rows", "prompt_rows",
                                       "multi_prompt_windows", "narrowed_windows")}
    out["programs_built"] = st["programs"]["built"]
    eng.close()
    return out


def llama_burst(lc, prompts: list[list[int]], tokens: int, n_batch: int) -> dict:
    n, plen = len(prompts), len(prompts[0])
    per_seq = -(-(plen + tokens) // 256) * 256
    with lc.context(n * per_seq, n, n_batch) as (ctx, batch):
        runs = []
        for _ in range(2):                       # fresh, then the same prompts again
            lc.clear(ctx)
            t = time.perf_counter()
            items = [(tok, p, s, p == plen - 1) for s, ids in enumerate(prompts)
                     for p, tok in enumerate(ids)]
            last = [0] * n
            for at in range(0, len(items), n_batch):
                part = items[at:at + n_batch]
                lc.decode(ctx, batch, part)
                for i, (_, p, s, want) in enumerate(part):
                    if want:
                        last[s] = lc.argmax(ctx, i)
            for k in range(tokens - 1):
                lc.decode(ctx, batch, [(last[s], plen + k, s, True) for s in range(n)])
                last = [lc.argmax(ctx, s) for s in range(n)]
            wall = time.perf_counter() - t
            runs.append({"tokens_per_second": n * (plen + tokens) / wall, "seconds": wall})
    return {"fresh": runs[0], "again": runs[1]}


def measure_llama(model: str, bs: list[int], plen: int, tokens: int, threads: int,
                  n_batch: int) -> dict:
    from strata_jax.bench.llamacpp import LlamaCpp

    lc = LlamaCpp(model, threads)
    try:
        out = {}
        for b in bs:
            llama_burst(lc, [prompt_ids(lc.n_vocab, plen, 10_000 + 100 * b + i) for i in range(b)],
                        tokens, n_batch)
            out[b] = llama_burst(lc, [prompt_ids(lc.n_vocab, plen, 20_000 + 100 * b + i)
                                      for i in range(b)],
                                 tokens, n_batch)
    finally:
        lc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--parallel-list", default="8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-batch", type=int, default=512,
                    help="llama_decode batch for the prompts (n_batch)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--batch-tokens", default=None)
    ap.add_argument("--expert-cache", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model is None:
        from strata_jax.fetch import smollm2_path

        a.model = str(smollm2_path())
    bs = [int(x) for x in a.parallel_list.split(",")]
    extra = {k: v for k, v in (("batch_tokens", a.batch_tokens), ("expert_cache", a.expert_cache))
                if v is not None}
    limit_threads(a.threads)
    head = {"model": a.model, "load_average_start": load_average(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "prompt_tokens": a.prompt_tokens, "tokens": a.tokens, "threads": a.threads,
            "engine": extra}
    print(f"# {head['date']}, load average {head['load_average_start']}, {a.model}, B x "
          f"({a.prompt_tokens} + {a.tokens})", flush=True)
    ours = measure_ours(a.model, bs, a.prompt_tokens, a.tokens, extra)
    theirs = (None if a.no_llama
              else measure_llama(a.model, bs, a.prompt_tokens, a.tokens, a.threads, a.llama_batch))
    head["load_average_end"] = load_average()
    print(f"strata-jax: load + warm-up {ours['load_seconds']:.1f} s ({ours['programs_after_load']} "
          f"programs); {ours['stats']}; {ours['programs_built']} programs in all")
    print("| B | prompts | strata-jax tok/s | TTFT p50 / max (s) | compiles while serving | "
          "llama.cpp tok/s | ratio |")
    print("|---|---|---:|---|---:|---:|---:|")
    for b in bs:
        for kind in ("fresh", "again"):
            o = ours["runs"][b][kind]
            t = theirs[b][kind]["tokens_per_second"] if theirs else None
            ratio = f"{o['tokens_per_second'] / t:.2f}" if t else "-"
            print(f"| {b} | {kind} | {o['tokens_per_second']:.0f} | {o['ttft_p50']:.2f} / "
                  f"{o['ttft_max']:.2f} | {o['compiles']} | {f'{t:.0f}' if t else '-'} | {ratio} |")
    print(f"# load average at the end {head['load_average_end']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**head, "strata_jax": ours, "llama_cpp": theirs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
