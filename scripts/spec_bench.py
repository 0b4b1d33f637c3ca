"""Speculative decoding on a repetitive text: acceptance rate and decode speed with and without
--spec.

    python scripts/spec_bench.py [MODEL.gguf] [--spec 4] [--drafter ngram|mtp|draft:PATH.gguf]
                                 [--parallel 1] [--max-tokens 160] [--spec-min-p 0.5]
                                     [--spec-max-rows 0] [--ignore-eos]

The task is a code edit: the model is given Python snippets and asked to write them out again with
one name changed, so most of the answer is in the prompt (prompt lookup's best case, and a common
real one). Each configuration runs in its own engine; the programs are built by a warm-up request
first, then the same requests run `--parallel` at a time (greedy). Prints one line a configuration:
decode tok/s (the requests' tokens over the wall time of the decode phase, summed over concurrent
requests), drafts accepted of drafted, and whether the tokens equal the run without speculation.
Default model: SmolLM2.
"""

from __future__ import annotations

import argparse
import os
import time

SNIPPETS = [
    '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result''',
    '''def count_words(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])''',
    '''def merge_sorted(a, b):
    i, j, out = 0, 0, []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]''',
    '''def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config''',
]
RENAMES = [("result", "averages"), ("counts", "frequency"), ("out", "merged"),
           ("config", "settings")]


def messages(i: int) -> list[dict]:
    code = SNIPPETS[i % len(SNIPPETS)]
    old, new = RENAMES[i % len(RENAMES)]
    return [{"role": "user", "content": f"Rename the variable `{old}` to `{new}` in this Python "
                                        "function and write out the whole "
                                        f"function:\n\n```python\n{code}\n```"}]


def prompt(eng, i: int):
    """The chat messages, or their text where the model has no chat template (a made model)."""
    if eng.model.metadata.get("tokenizer.chat_template"):
        return messages(i)
    return messages(i)[0]["content"]


def run(model: str, spec: int, drafter: str, args) -> tuple[float, int, int, list[list[int]]]:
    from strata_jax import Engine, EngineConfig

    # No prefix cache: the timed requests repeat the warm-up's prompts, and reusing their KV would
    # make them read 1-2 tokens, i.e. other layouts, whose programs (and the mtp drafter's) would
    # then be built inside the timed decode.
    cfg = EngineConfig(parallel=max(args.parallel, 2), max_context=1024, spec=spec, drafter=drafter,
                       spec_min_p=args.spec_min_p, spec_max_rows=args.spec_max_rows,
                       prefix_cache=False)
    kw = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    with Engine.from_gguf(model, cfg) as eng:
        # warm-up: builds the programs of this workload
        for i in range(args.parallel):
            eng.generate(prompt(eng, i), **kw)
        handles = [eng.submit(prompt(eng, i), **kw) for i in range(args.parallel)]
        toks, stats = [], []
        for h in handles:
            evs = list(h)
            toks.append([e.token for e in evs if e.kind == "token"])
            stats.append(evs[-1].stats)
    # decode phase: from the first request's first token to the last request's end
    tps = sum(s["predicted_per_second"] for s in stats)
    return (tps, sum(s.get("draft_n", 0) for s in stats),
            sum(s.get("draft_n_accepted", 0) for s in stats), toks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--spec-min-p", type=float, default=0.5)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--spec-max-rows", type=int, default=0,
                    help="draft only while at most this many slots decode")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="decode --max-tokens tokens whatever comes (made models)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from strata_jax.fetch import smollm2_path

        model = str(smollm2_path())
    load = os.getloadavg()[0]
    print(f"{os.path.basename(model)}: parallel {args.parallel}, {args.max_tokens} tokens a "
          f"request, load average {load:.1f} at start")
    t = time.perf_counter()
    base_tps, _, _, base = run(model, 0, "none", args)
    print(f"  --spec 0:                 {base_tps:7.1f} tok/s decode")
    tps, n, acc, toks = run(model, args.spec, args.drafter, args)
    rate = acc / n if n else 0.0
    print(f"  --spec {args.spec} --drafter {args.drafter}: {tps:7.1f} tok/s decode "
          f"({tps / base_tps:.2f}x), drafts accepted {acc} of {n} ({rate:.0%}), same tokens as "
          f"--spec 0: {toks == base}")
    print(f"  ({time.perf_counter() - t:.0f} s in all; load average {os.getloadavg()[0]:.1f} at "
          "the end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
