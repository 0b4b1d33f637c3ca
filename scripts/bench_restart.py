"""Restart time: how long until `strata-jax serve` serves, at a first start, at a second start of
the same model, and after an engine fault, with and without JAX's persistent compilation cache
(compile_cache.py).

    python scripts/bench_restart.py [MODEL.gguf | --tiny] [--parallel 4] [--max-context 4096]
        [--fault-window 3] [--repeat 1] [--json FILE] [--serve-arg=--prefill=256 ...]

With no MODEL, the default model (SmolLM2-135M-Instruct, fetched once into the cache folder);
`--tiny` makes a tiny qwen3moe GGUF in a temporary folder (a check that the script works, not a
figure). Every case has compile cache folders of its own (STRATA_JAX_COMPILE_CACHE, in a private
temporary folder), so the user's own cache is neither used nor touched:

    cold start           an empty cache: from starting the process to GET /health 200, and to a
                         first answer
    second start         the same cache again (the programs the first start stored)
    restart, cache       STRATA_FAULT=exit:N@1: the first engine exits at its N-th window (a request
                         makes it), the supervisor starts another; seconds from the fault (the
                         /faults entry's time) to /health 200 and to a served request; the first
                         engine filled the cache
    restart, no cache    the same with STRATA_JAX_COMPILE_CACHE=off

Each row also gives the engine's own figures from the server's log (`engine G ready in S s: ... N
programs built in B s`) and, for restarts, the supervisor's wait before it starts the new engine
(the backoff: 1 s after a first fault). Prints a Markdown table and writes every figure as JSON.
Measure on a quiet machine: the figures are times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from strata_jax.serve.launch import ServerProcess

PROMPT = "The capital of France is"
READY = re.compile(r"engine (\d+) ready in ([\d.]+) s: .*?(\d+) programs built in ([\d.]+) s")


def _ready_lines(log: str) -> dict[int, dict]:
    """The server's `engine G ready ...` lines -> {G: {"engine_start_s", "programs_built",
    "build_s"}}."""
    return {int(m[1]): {"engine_start_s": float(m[2]), "programs_built": int(m[3]),
                        "build_s": float(m[4])}
            for m in READY.finditer(log)}


def _answer(srv: ServerProcess, max_tokens: int, timeout: float) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=timeout,
                      json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True})


def start_case(serve_args: list[str], cache: str, timeout: float) -> dict:
    """A server start: seconds from starting the process to /health 200 and to a first answer."""
    t0 = time.monotonic()
    with ServerProcess(serve_args, env={"STRATA_JAX_COMPILE_CACHE": cache}) as srv:
        srv.wait_ready(timeout)
        ready = time.monotonic() - t0
        r = _answer(srv, 4, timeout)
        served = time.monotonic() - t0
        if r.status_code != 200:
            raise RuntimeError(f"the first request failed: {r.status_code} {r.text}\n{srv.log()}")
        engine = _ready_lines(srv.log()).get(1, {})
    return {"to_health_s": round(ready, 3), "to_answer_s": round(served, 3), **engine}


def restart_case(serve_args: list[str], cache: str, window: int, timeout: float) -> dict:
    """A fault at the first engine's `window`-th window: seconds from the fault to /health 200 and
    to a served request on the next engine."""
    env = {"STRATA_JAX_COMPILE_CACHE": cache, "STRATA_FAULT": f"exit:{window}@1"}
    with ServerProcess(serve_args, env=env) as srv:
        srv.wait_ready(timeout)
        # its windows reach the fault; it ends with an error
        doomed = _answer(srv, window + 8, timeout)
        end = time.monotonic() + timeout
        first_503 = None
        while time.monotonic() < end:
            try:
                h = srv.health()
            except httpx.HTTPError:
                h = None
            now = time.time()
            if h is not None and h.status_code == 503 and first_503 is None:
                first_503 = now
            if h is not None and h.status_code == 200 and h.json().get("generation", 1) >= 2:
                break
            time.sleep(0.02)
        else:
            raise TimeoutError(f"no second engine within {timeout:.0f} s:\n{srv.log()}")
        healthy = time.time()
        r = _answer(srv, 4, timeout)
        served = time.time()
        if r.status_code != 200:
            raise RuntimeError(f"the request after the restart failed: {r.status_code} "
                               f"{r.text}\n{srv.log()}")
        faults = httpx.get(srv.url + "/faults", timeout=10).json()["faults"]
        if not faults:
            raise RuntimeError("no fault was recorded (the doomed request: "
                               f"{doomed.status_code})\n{srv.log()}")
        fault = faults[0]
        engine = _ready_lines(srv.log()).get(2, {})
    at = fault["unix_time"]
    return {"to_health_s": round(healthy - at, 3), "to_answer_s": round(served - at, 3),
            "first_503_after_s": round(first_503 - at, 3) if first_503 else None,
            "backoff_s": fault["restart_in_s"], "fault": fault["reason"], **engine}


def tiny_model(folder: Path) -> str:
    from strata_jax.makers.make_model import make_model

    return str(make_model(folder / "tiny-moe.gguf", arch="qwen3moe", layers=2, hidden=64, heads=4,
                          kv_heads=2, experts=8, experts_used=2, expert_ffn=32)[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a .gguf file (default: the default model, SmolLM2)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny made qwen3moe model: checks the script, no figure")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--fault-window", type=int, default=3, metavar="N",
                    help="the first engine exits at window N")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="runs a case; the median is shown")
    ap.add_argument("--cases", default="cold,second,restart-cache,restart-no-cache")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more `serve` argument")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take")
    ap.add_argument("--json", metavar="FILE", help="default: docs/results/restart-<model>.json")
    a = ap.parse_args(argv)

    # 0o700: the compile caches live here
    work = Path(tempfile.mkdtemp(prefix="strata-restart-"))
    model = tiny_model(work) if a.tiny else a.model
    serve_args = ([model] if model else []) + ["--parallel", str(a.parallel), "--max-context",
                                               str(a.max_context), *a.serve_arg]
    cases = a.cases.split(",")
    rows: dict[str, list[dict]] = {c: [] for c in cases}
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    for i in range(a.repeat):
        cold = str(work / f"cache-start-{i}")
        for case in cases:
            if case == "cold":
                r = start_case(serve_args, cold, a.timeout)
            elif case == "second":
                if not Path(cold).exists():
                    # "second" alone: fill the cache first
                    start_case(serve_args, cold, a.timeout)
                r = start_case(serve_args, cold, a.timeout)
            elif case == "restart-cache":
                r = restart_case(serve_args, str(work / f"cache-restart-{i}"), a.fault_window,
                                 a.timeout)
            elif case == "restart-no-cache":
                r = restart_case(serve_args, "off", a.fault_window, a.timeout)
            else:
                raise SystemExit(f"--cases: unknown case {case!r}")
            rows[case].append(r)
            print(f"{case} run {i + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)

    what = {"cold": ("first start", "empty"), "second": ("second start", "warm"),
            "restart-cache": ("restart after a fault", "on"),
            "restart-no-cache": ("restart after a fault", "off")}
    print(f"\nmodel {model or 'default (SmolLM2)'}, --parallel {a.parallel} --max-context "
          f"{a.max_context} {' '.join(a.serve_arg)}; {a.repeat} run(s), median; load average "
          f"{load} at the start, "
          f"{round(os.getloadavg()[0], 2) if hasattr(os, 'getloadavg') else None} at the end")
    print("| case | compile cache | s to /health 200 | s to an answer | engine ready in s | "
          "programs built | build s | backoff s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    med = {}
    for case, runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]
             if isinstance(runs[0][k], (int, float))}
        med[case] = m
        name, cache = what[case]
        base = "from the process start" if case in ("cold", "second") else "from the fault"
        backoff = f"{m['backoff_s']:g}" if "backoff_s" in m else "-"
        print(f"| {name} ({base}) | {cache} | {m.get('to_health_s', float('nan')):.2f} | "
              f"{m.get('to_answer_s', float('nan')):.2f} | "
              f"{m.get('engine_start_s', float('nan')):.1f} | {m.get('programs_built', 0):.0f} | "
              f"{m.get('build_s', float('nan')):.1f} | {backoff} |")
    out = Path(a.json or f"docs/results/restart-{Path(model).stem if model else 'smollm2'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "parallel": a.parallel, "max_context": a.max_context,
                               "serve_args": a.serve_arg, "fault_window": a.fault_window,
                               "repeat": a.repeat,
                               "load_average": load, "machine": platform.platform(),
                               "date": time.strftime(
                                   "%Y-%m-%d %H:%M:%S %Z"), "median": med, "runs": rows}, indent=1))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
