"""Speculative decoding from the first requests after /health turns 200 (issue 32, finding 6: with
the default warm-up, `--spec N` used to draft nothing because the verify programs were never ready).

    python scripts/bench_spec_first.py [MODEL.gguf] [--spec 0,4] [--requests 3] [--max-tokens 160]

For each --spec value: a fresh `strata-jax serve` (default warm-up, compile cache as the user has
it), wait for /health 200, then at once the code-edit requests of spec_bench.py one after another
(greedy, chat), each timed from the client. Prints a line a request (tokens, seconds, tok/s,
drafted, accepted) and a summary a configuration. Default model: SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from spec_bench import RENAMES, SNIPPETS

from strata_jax.fetch import smollm2_path
from strata_jax.serve.launch import ServerProcess


def run(model: str, spec: int, requests: int, max_tokens: int) -> dict:
    args = [model, "--parallel", "1", "--spec", str(spec)]
    with ServerProcess(args) as srv:
        started = time.monotonic()
        srv.wait_ready(timeout=600)
        ready_s = time.monotonic() - started
        rows = []
        for i in range(requests):
            code, (old, new) = SNIPPETS[i % len(SNIPPETS)], RENAMES[i % len(RENAMES)]
            body = {"messages": [{"role": "user", "content": f"Rename `{old}` to `{new}` in this "
                                                             "code and write the whole code out "
                                                             f"again:\n\n{code}"}],
                    "max_tokens": max_tokens, "temperature": 0}
            t0 = time.monotonic()
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=600)
            seconds = time.monotonic() - t0
            r.raise_for_status()
            t = r.json()["timings"]
            rows.append({"tokens": t["predicted_n"], "seconds": round(seconds, 2),
                         "tok_s": round(t["predicted_n"] / seconds, 1),
                         "decode_tok_s": round(t["predicted_per_second"], 1),
                         "draft_n": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)})
            print(f"spec {spec} request {i + 1}: {json.dumps(rows[-1])}", flush=True)
    tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
    out = {"spec": spec, "ready_s": round(ready_s, 1), "tokens": tokens,
           "seconds": round(seconds, 2),
           "tok_s": round(tokens / seconds, 1), "drafted": sum(r["draft_n"] for r in rows),
           "accepted": sum(r["accepted"] for r in rows), "requests": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "requests"}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--spec", default="0,4")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args()
    model = a.model or str(smollm2_path())
    results = [run(model, int(s), a.requests, a.max_tokens) for s in a.spec.split(",")]
    base = results[0]["tok_s"]
    for r in results:
        print(f"--spec {r['spec']}: {r['tok_s']} tok/s ({r['tok_s'] / base:.2f}x), drafted "
              f"{r['drafted']}, accepted {r['accepted']}, ready in {r['ready_s']} s")


if __name__ == "__main__":
    main()
