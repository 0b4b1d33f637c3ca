"""Decode speed of one `strata-jax serve` process against the same model over 2 processes on this
host (--coordinator/--num-processes/--process-id: engine/distributed/hosts.py), issue 19 item 2.

    python scripts/bench_hosts.py MODEL.gguf [--max-tokens 64] [--repeat 3] [--json FILE]
        [-- serve flags]

Cases: `one` (a plain server), `two` (process 0 serving HTTP, process 1 following; each process one
CPU device, the experts split in half between them). Each case: the server started, its warm-up and
queued builds waited for (and --settle seconds more for the follower's own, which nothing reports),
one unmeasured request, then --repeat times: one request alone (its decode rate: the server's
`timings.predicted_per_second`, after its first token) and 4 at once (all their generated tokens
over the wall time from sending them, prompts included). Greedy, ignore_eos, --max-tokens tokens
each; the best run is kept, every run printed. Measure on a quiet machine: these are times.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx

from strata_jax.serve.launch import ServerProcess, free_port

SERVE = ["--parallel", "4", "--max-context", "128", "--prefill", "16"]


def ask(url: str, k: int, max_tokens: int) -> dict:
    prompt = [(11 * i + 37 * k) % 400 + 5 for i in range(12)]
    r = httpx.post(url + "/completion",
                   json={"prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                                              "ignore_eos": True, "cache_prompt": False},
                   timeout=600)
    r.raise_for_status()
    return r.json()


def runs(url: str, max_tokens: int, repeat: int) -> dict:
    ask(url, 99, max_tokens)
    alone, together = [], []
    for n in range(repeat):
        alone.append(round(ask(url, n, max_tokens)["timings"]["predicted_per_second"], 1))
        got: list[int] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=lambda k=k, n=n, got=got: got.append(
            ask(url, 10 * n + k, max_tokens)["tokens_predicted"])) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together.append(round(sum(got) / (time.monotonic() - t0), 1))
    return {"alone": alone, "together": together, "best_alone": max(alone),
            "best_together": max(together)}


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--settle", type=float, default=30.0,
                   help="seconds to wait after process 0's builds, for the follower's own "
                        "background builds (it compiles the same layouts; nothing reports them)")
    p.add_argument("--pin", action="store_true",
                   help="each process of the group (and the one process) on a core of its own "
                        "(taskset -c I): as if each were a host of one core")
    a = p.parse_args(argv)
    flags = [a.model, *SERVE, *extra]
    out = {}
    def cmd(i: int) -> list[str] | None:
        return ["taskset", "-c", str(i), sys.executable, "-m", "strata_jax"] if a.pin else None

    with ServerProcess(flags, command=cmd(0)) as one:
        one.wait_ready(600).wait_built(600)
        out["one"] = runs(one.url, a.max_tokens, a.repeat)
    print("one process:", out["one"], flush=True)
    port = free_port()
    group = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    with ServerProcess([*flags, *group, "--process-id", "1"], command=cmd(1)), \
            ServerProcess([*flags, *group, "--process-id", "0"], command=cmd(0)) as lead:
        lead.wait_ready(600).wait_built(600)
        time.sleep(a.settle)
        out["two"] = runs(lead.url, a.max_tokens, a.repeat)
    print("two processes:", out["two"], flush=True)
    print("| processes | 1 request, tok/s | 4 at once, tok/s |\n|---:|---|---|")
    for name, n in (("one", 1), ("two", 2)):
        r = out[name]
        print(f"| {n} | {r['best_alone']} ({', '.join(map(str, r['alone']))}) | "
              f"{r['best_together']} ({', '.join(map(str, r['together']))}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
