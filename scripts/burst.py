"""A burst of 50x --parallel requests at once against a real `strata-jax serve` (issue 13, load
shedding): every request answered (a 200, or a quick 503 with Retry-After), the server's memory
before and after, and the next request served.

    python scripts/burst.py [MODEL.gguf] [--parallel 4] [--max-queue 16] [--times 50] [--json FILE]

With no MODEL, the default model (SmolLM2-135M-Instruct). Prints a Markdown table; measure on a
quiet machine (the latencies are times).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import statistics
import time
from pathlib import Path

import httpx

from strata_jax.bench.machine import rss_mib
from strata_jax.serve.launch import ServerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--times", type=int, default=50,
                    help="requests = times x parallel (default 50)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    if a.model is None:
        from strata_jax.fetch import smollm2_path
        a.model = str(smollm2_path())
    args = [a.model, "--parallel", str(a.parallel), "--max-context", "1024", "--max-queue",
            str(a.max_queue)]
    n = a.times * a.parallel
    body = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": a.max_tokens, "temperature": 0}
    with ServerProcess(args) as srv:
        srv.wait_ready(timeout=600)
        url = srv.url + "/v1/chat/completions"
        # warm: programs built, pages touched
        httpx.post(url, json=body, timeout=120)
        before = rss_mib(srv.proc.pid)

        def one(i: int) -> tuple[int, float, str | None]:
            t0 = time.monotonic()
            r = httpx.post(url, json={**body, "seed": i}, timeout=600)
            return r.status_code, time.monotonic() - t0, r.headers.get("retry-after")

        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(min(n, 256)) as pool:
            results = list(pool.map(one, range(n)))
        wall = time.monotonic() - t0
        after = rss_mib(srv.proc.pid)
        t1 = time.monotonic()
        nxt = httpx.post(url, json=body, timeout=120)
        next_s = time.monotonic() - t1
        health = srv.health().json()
    by_code: dict[int, list[float]] = {}
    for code, seconds, _ in results:
        by_code.setdefault(code, []).append(seconds)
    out = {"model": Path(a.model).name, "parallel": a.parallel, "max_queue": a.max_queue,
           "requests": n,
           "wall_s": round(wall, 2), "server_rss_mib_before": round(before, 1),
           "server_rss_mib_after": round(after, 1),
           "next_request_status": nxt.status_code, "next_request_s": round(next_s, 2),
           "restarts": health["restarts"], "machine": platform.node(),
           "by_status": {str(c): {"count": len(v), "median_s": round(statistics.median(v), 3),
                                  "max_s": round(max(v), 3)} for c, v in sorted(by_code.items())},
           "retry_after_missing": sum(1 for c, _, r in results if c == 503 and not r)}
    print(f"| {n} requests ({a.times}x --parallel {a.parallel}), --max-queue {a.max_queue} | wall "
          f"{wall:.1f} s |")
    print("| status | count | median s | max s |\n|---|---|---|---|")
    for c, st in out["by_status"].items():
        print(f"| {c} | {st['count']} | {st['median_s']} | {st['max_s']} |")
    print(f"server RSS {before:.1f} -> {after:.1f} MiB; next request {nxt.status_code} in "
          f"{next_s:.2f} s; restarts {health['restarts']}; 503 without Retry-After: "
          f"{out['retry_after_missing']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
