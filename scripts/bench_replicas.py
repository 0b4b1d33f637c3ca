"""Throughput of `strata-jax serve` against `serve --replicas N` (Ray Serve,
strata_jax/serve/replicas/ray_app.py).

    python scripts/bench_replicas.py [MODEL.gguf | --tiny] [--replicas 1,2] [--clients 4]
        [--requests 4] [--max-tokens 32] [--parallel 4] [--repeat 1] [--json FILE]

With no MODEL, the default model (SmolLM2-135M-Instruct, fetched once); `--tiny` makes a tiny qwen3
GGUF (a check that the script works: its figures are the proxy's overhead, not an engine's). Cases,
in order:

    server      one plain `strata-jax serve` (no Ray): the baseline
    ray N       N replicas behind Ray Serve's proxy and our ingress, for each N of --replicas

Each case: --clients threads, each sending --requests chat requests of conversations of their own
(so they hash over the replicas), max_tokens tokens each (ignore_eos), greedy. The whole load runs
once unmeasured (programs built, prefix caches warm), then --repeat times measured; the best run is
kept. Figures: requests/s, generated tokens/s, median and worst request latency, and how many
requests each replica answered. Prints a Markdown table and writes every figure as JSON. Measure on
a quiet machine: the figures are times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from strata_jax.serve.launch import ServerProcess, free_port
from strata_jax.serve.replicas.replica_routing import REPLICA_HEADER


def load(url: str, clients: int, requests: int, max_tokens: int, salt: str) -> dict:
    """One run of the load; every figure of it."""
    latencies: list[float] = []
    tokens = [0]
    by_replica: collections.Counter = collections.Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            for i in range(requests):
                body = {"model": "m", "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True,
                        "messages": [{"role": "user",
                                      "content": f"[{salt} {c}.{i}] Write a story about a ship."}]}
                t0 = time.monotonic()
                r = http.post("/v1/chat/completions", json=body)
                dt = time.monotonic() - t0
                with lock:
                    if r.status_code != 200:
                        failures.append(f"{r.status_code}: {r.text[:200]}")
                        continue
                    latencies.append(dt)
                    tokens[0] += r.json()["usage"]["completion_tokens"]
                    by_replica[r.headers.get(REPLICA_HEADER, "server")] += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    done = len(latencies)
    return {"wall_s": round(wall, 2), "requests": done, "failures": failures, "tokens": tokens[0],
            "requests_per_s": round(done / wall, 3), "tokens_per_s": round(tokens[0] / wall, 2),
            "latency_p50_s": round(statistics.median(latencies), 2) if latencies else None,
            "latency_max_s": round(max(latencies), 2) if latencies else None,
            "by_replica": dict(sorted(by_replica.items()))}


def measure(name: str, url: str, args) -> dict:
    print(f"{name}: warm-up run", file=sys.stderr, flush=True)
    load(url, args.clients, args.requests, args.max_tokens, "warm-up")
    runs = []
    for k in range(args.repeat):
        runs.append(load(url, args.clients, args.requests, args.max_tokens, f"run {k}"))
        print(f"{name}: {runs[-1]}", file=sys.stderr, flush=True)
    return {"case": name, **max(runs, key=lambda r: r["tokens_per_s"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--tiny", action="store_true", help="a tiny qwen3 made here (checks the script)")
    p.add_argument("--replicas", default="1,2", help="Ray cases: replica counts (default 1,2)")
    p.add_argument("--no-server", action="store_true", help="leave out the plain server's case")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=4, help="requests each client sends in a run")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--parallel", type=int, default=4, help="each server's --parallel")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()

    if args.tiny:
        from strata_jax.makers.make_model import make_model

        model = str(make_model(Path(tempfile.mkdtemp()) / "tiny.gguf", arch="qwen3", layers=2,
                               hidden=64)[0])
    elif args.model:
        model = args.model
    else:
        from strata_jax.fetch import smollm2_path

        model = str(smollm2_path())
    serve_args = [model, "--parallel", str(args.parallel), "--max-context", str(args.max_context)]
    rows = []
    if not args.no_server:
        with ServerProcess(serve_args) as srv:
            srv.wait_ready(600)
            rows.append(measure("server", srv.url, args))

    counts = [int(n) for n in args.replicas.split(",") if n]
    if counts:
        import ray
        from ray import serve

        from strata_jax.serve.replicas import ray_app

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        port = free_port()
        try:
            for n in counts:
                url = ray_app.start(serve_args, n, port=port)
                rows.append(measure(f"ray {n}", url, args))
                ray_app.stop()
        finally:
            serve.shutdown()
            ray.shutdown()

    print(f"\nmodel {Path(model).name}, --parallel {args.parallel}, {args.clients} clients x "
          f"{args.requests} requests x {args.max_tokens} tokens, {os.cpu_count()} CPUs\n")
    print("| case | requests/s | tokens/s | latency p50 s | latency max s | answered by | "
          "failures |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        spread = ", ".join(f"{k} {v}" for k, v in r["by_replica"].items())
        print(f"| {r['case']} | {r['requests_per_s']} | {r['tokens_per_s']} | {r['latency_p50_s']} "
              f"| {r['latency_max_s']} | {spread} | {len(r['failures'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "args": vars(args), "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
