"""A concurrency ladder over the OpenAI streaming API: the test that found Strata #997.

At each level L (`--levels 1,2,3`), `--waves` waves of L streamed chat requests sent at once, each
with a prompt of its own (`--prompt-tokens` long, starting with a unique id so no two share a prefix
beyond the chat template's first tokens). Each request is measured: time to first token, prompt and
decode tokens/s (the server's `timings`, else measured by the client), tokens, outcome. Before each
level the ladder waits for GET /health 200 (the engine may be restarting after a fault). At the end
it reads the server's fault ledger (GET /faults) and its program counters (GET /metrics).

    python scripts/ladder.py --url http://127.0.0.1:8000 --levels 1,2,3 --waves 3 --prompt-tokens 8150 \\
        --max-tokens 512 --reasoning on --json ladder.json --plot ladder.png
    python scripts/ladder.py --start-server model.gguf --levels 1,2,4,8 --parallel 8 --max-context
        2048

With --start-server MODEL, the flags the ladder does not know (`--parallel 8`) go to `strata-jax
serve`, as does everything after `--`.

Exit code: 0 when every request succeeded and the engine never restarted, 1 otherwise, 2 when the
server never became ready (or bad settings).
"""  # noqa: E501

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loadtest import (
    Result,
    Server,
    ServerStartError,
    TokenCounter,
    add_common_flags,
    client_of,
    describe_latency,
    describe_log,
    describe_programs,
    fmt,
    get_faults,
    get_metrics,
    headers_of,
    in_ms,
    latency_figures,
    median,
    new_faults,
    parse_script_args,
    program_figures,
    prompt_of,
    stream_chat,
    template_kwargs_of,
    wait_built,
    wait_healthy,
    write_json,
)

console = Console(highlight=False)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="With --start-server, flags the script does not know (and "
                                "all after `--`) go to `strata-jax serve`.")
    add_common_flags(p)
    p.add_argument("--levels", default="1,2,3",
                   help="concurrency levels, comma-separated (default 1,2,3)")
    p.add_argument("--waves", type=int, default=3, help="waves a level (default 3)")
    p.add_argument("--minutes", type=float, default=0,
                   help="a soak: each level's waves go on past --waves until this many minutes "
                        "have passed since the level began (fresh prompts; default 0: --waves)")
    p.add_argument("--prompt-tokens", type=int, default=8150,
                   help="prompt tokens a request (default 8150)")
    p.add_argument("--max-tokens", type=int, default=512, help="max_tokens a request (default 512)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for all max_tokens (llama.cpp's ignore_eos)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="plot decode tok/s a request and aggregate tok/s against concurrency "
                        "(needs matplotlib: the optional extra strata-jax[plot])")
    args, server_flags = parse_script_args(p, argv)
    try:
        args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        p.error(f"--levels {args.levels!r}: give whole numbers, comma-separated (e.g. 1,2,4,8)")
    for name, value in (("--levels", min(args.levels, default=0)), ("--waves", args.waves),
                        ("--prompt-tokens", args.prompt_tokens), ("--max-tokens", args.max_tokens)):
        if value < 1:
            p.error(f"{name} must be at least 1 (got {value})")
    if args.timeout <= 0:
        p.error(f"--timeout must be positive (got {args.timeout:g})")
    return args, server_flags


def waves_of(args: argparse.Namespace, started: float):
    """A level's wave numbers: --waves of them, then (--minutes) more until that long has passed
    since the level began at `started` (time.time())."""
    wave = 0
    while wave < args.waves or (args.minutes and time.time() - started < args.minutes * 60):
        wave += 1
        yield wave


def request_body(args: argparse.Namespace, messages: list[dict[str, Any]],
                 seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": args.max_tokens, "seed": seed}
    if args.model:
        body["model"] = args.model
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.reasoning is not None:
        body["chat_template_kwargs"] = template_kwargs_of(args)
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def ladder(args: argparse.Namespace, url: str, report: dict[str, Any],
                 t0: float) -> dict[str, Any]:
    """Run the ladder, filling `report` as it goes (so that an interrupted run still has its
    finished levels and the engine restarts seen after each)."""
    headers, kwargs = headers_of(args), template_kwargs_of(args)
    report.update({"command": sys.argv, "url": url, "settings": {
        k: getattr(args, k)
        for k in ("levels", "waves", "prompt_tokens", "max_tokens", "reasoning", "temperature",
                                      "ignore_eos", "timeout", "seed")}, "levels": []})
    async with client_of(max(args.levels), args.timeout) as client:
        ready, why = await wait_healthy(client, url, args.health_timeout)
        if not ready:
            report["error"] = (f"the server at {url} was not ready within {args.health_timeout:g} "
                               f"s: {why}")
            return report
        report["waited_for_builds_s"] = round(await wait_built(client, url, headers,
                                                               args.health_timeout), 1)
        faults_before = await get_faults(client, url, headers)

        # every prompt is made (and counted) before the first request, so counting never overlaps a
        # wave
        counter = TokenCounter.from_gguf(args.tokenizer) if args.tokenizer else TokenCounter()
        await counter.calibrate(client, url, kwargs, headers)
        rng = random.Random(args.seed)
        prompts = {(level, wave): [await prompt_of(counter, client, url, rng, args.prompt_tokens,
                                                   kwargs, headers)
                                   for _ in range(level)]
                   for level in args.levels for wave in range(1, args.waves + 1)}
        report["prompt_counting"] = counter.source
        counts = [n for batch in prompts.values() for _, n in batch]
        if any(abs(n - args.prompt_tokens) > max(8, args.prompt_tokens // 10) for n in counts):
            console.print(f"[yellow]prompts came out at {min(counts)}..{max(counts)} tokens, not "
                          f"~{args.prompt_tokens} (the chat template and the question alone take "
                          f"{min(counts)} or more, or the count is an estimate)[/yellow]")
        console.print(f"ladder on {url}: levels {args.levels}, {args.waves} waves, prompts of "
                      f"~{args.prompt_tokens} tokens (counted by the {counter.source}), max_tokens "
                      f"{args.max_tokens}")

        for level in args.levels:
            ready, why = await wait_healthy(client, url, args.health_timeout)
            if not ready:
                entry = not_run(level, args.waves, "the server was not ready within "
                                f"{args.health_timeout:g} s before level {level}: {why}")
                report["levels"].append(entry)
                console.print(f"[red]level {level}: not run: {entry['error']}[/red]")
                break
            waves, started = [], time.time()
            for wave in waves_of(args, started):
                batch = prompts.get((level, wave)) or [  # a --minutes wave past --waves
                    await prompt_of(counter, client, url, rng, args.prompt_tokens, kwargs,
                                    headers) for _ in range(level)]
                start = time.monotonic()
                results = await asyncio.gather(*(
                    stream_chat(client, url, request_body(args, messages,
                                                          args.seed + 1000 * level + 10 * wave + i),
                                args.timeout, t0, headers)
                    for i, (messages, _) in enumerate(batch)))
                wall = time.monotonic() - start
                waves.append({"wave": wave, "wall_s": round(wall, 3),
                              "aggregate_tps": round(sum(r.tokens for r in results) / wall, 3)
                                               if wall else None,
                              "requests": [{"index": i, "prompt_tokens_counted": n, **r.to_json()}
                                           for i, ((_, n), r) in enumerate(zip(batch, results))]})
                console.print(f"  level {level} wave {wave}: {sum(r.ok for r in results)}"
                              f"/{len(results)} ok in {wall:.1f} s", style="dim")
            entry = {**summarize(level, waves), "started": round(started, 1)}
            report["levels"].append(entry)
            print_level(entry)
            await read_server(client, url, headers, faults_before, report)
        await read_server(client, url, headers, faults_before, report)
    return tally(report, t0)


async def read_server(client, url: str, headers: dict[str, str] | None,
                      faults_before: dict[str, Any] | None, report: dict[str, Any]) -> None:
    """The engine restarts since the ladder began (GET /faults) and the program counters (GET
    /metrics)."""
    faults_now = await get_faults(client, url, headers)
    report["engine_restarts"], report["faults"] = new_faults(faults_before, faults_now)
    report["faults_available"] = faults_now is not None
    report["programs"] = program_figures(await get_metrics(client, url, headers))


def tally(report: dict[str, Any], t0: float) -> dict[str, Any]:
    report["wall_s"] = round(time.monotonic() - t0, 3)
    every = [r for lv in report.get("levels", []) for w in lv["waves"] for r in w["requests"]]
    report["requests"], report["failed"] = len(every), sum(not r["ok"] for r in every)
    report["latency"] = latency_figures(every)                # over all levels
    report.setdefault("engine_restarts", 0)
    report.setdefault("faults", [])
    report.setdefault("faults_available", False)
    return report


def not_run(level: int, waves: int, error: str) -> dict[str, Any]:
    fail = Result(error=error).to_json()
    return {**summarize(level, [{"wave": w, "wall_s": 0.0, "aggregate_tps": None,
                                 "requests": [{"index": i, **fail} for i in range(level)]}
                                for w in range(1, waves + 1)]), "error": error}


def summarize(level: int, waves: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = [r for w in waves for r in w["requests"]]
    ok = [r for r in reqs if r["ok"]]
    wall = sum(w["wall_s"] for w in waves)
    return {"level": level, "waves": waves, "requests": len(reqs), "ok": len(ok),
            "failed": len(reqs) - len(ok),
            **latency_figures(reqs),                     # TTFT, ITL, e2e: p50 and p95
            "median_prompt_tps": median([r["prompt_tps"] for r in ok]),
            "median_decode_tps": median([r["decode_tps"] for r in ok]),
            "aggregate_tps": round(sum(r["tokens"] for r in reqs) / wall, 3) if wall else None}


def print_level(entry: dict[str, Any]) -> None:
    t = Table(title=f"level {entry['level']}: {entry['ok']}/{entry['requests']} ok",
              title_justify="left")
    for col in ("wave", "req", "outcome", "prompt tok", "TTFT s", "prompt tok/s", "decode tok/s",
                "tokens", "time s"):
        t.add_column(col, justify="left" if col == "outcome" else "right", overflow="fold")
    # numbered under the table: error messages are too long for a column
    errors: list[str] = []
    for w in entry["waves"]:
        for r in w["requests"]:
            prompt = (r["prompt_tokens"] if r["prompt_tokens"] is not None
                      else f"~{r.get('prompt_tokens_counted', '-')}")
            if not r["ok"] and r["error"] not in errors:
                errors.append(r["error"])
            outcome = "ok" if r["ok"] else f"[red]failed ({errors.index(r['error']) + 1})[/red]"
            t.add_row(str(w["wave"]), str(r["index"] + 1), outcome, str(prompt),
                      fmt(r["ttft_s"], 2),
                      fmt(r["prompt_tps"]), fmt(r["decode_tps"]), str(r["tokens"]),
                      fmt(r["latency_s"], 2))
    console.print(t)
    for i, message in enumerate(errors, 1):
        console.print(f"[red]({i})[/red] {message}")
    console.print(f"level {entry['level']}: decode {fmt(entry['median_decode_tps'])} tok/s a "
                  f"request (median), aggregate {fmt(entry['aggregate_tps'])} tok/s, "
                  f"{describe_latency(entry)}, prompt {fmt(entry['median_prompt_tps'])} tok/s "
                  "(median)\n")


def print_summary(report: dict[str, Any]) -> None:
    t = Table(title="ladder", title_justify="left")
    for col in ("level", "ok", "failed", "TTFT s p50 / p95", "ITL ms p50 / p95", "e2e s p50 / p95",
                "prompt tok/s (median)",
                "decode tok/s a request (median)", "aggregate tok/s"):
        t.add_column(col, justify="right")
    for lv in report["levels"]:
        t.add_row(str(lv["level"]), f"{lv['ok']}/{lv['requests']}", str(lv["failed"]),
                  f"{fmt(lv['ttft_p50_s'], 2)} / {fmt(lv['ttft_p95_s'], 2)}",
                  f"{fmt(in_ms(lv['itl_p50_s']))} / {fmt(in_ms(lv['itl_p95_s']))}",
                  f"{fmt(lv['e2e_p50_s'], 2)} / {fmt(lv['e2e_p95_s'], 2)}",
                  fmt(lv["median_prompt_tps"]), fmt(lv["median_decode_tps"]),
                  fmt(lv["aggregate_tps"]))
    console.print(t)
    if report.get("latency"):
        console.print(f"all levels: {describe_latency(report['latency'])}")
    errors = Counter(r["error"] for lv in report["levels"] for w in lv["waves"]
                     for r in w["requests"] if not r["ok"])
    for message, n in errors.most_common():
        console.print(f"[red]{n} failed:[/red] {message}")
    if report.get("faults_available"):
        console.print("engine restarts during the ladder (GET /faults): "
                      f"{report['engine_restarts']}")
        for f in report["faults"]:
            console.print(f"  {f.get('time')}: {f.get('message')} ({f.get('requests_in_flight')} "
                          "requests in flight)")
    else:
        console.print("engine restarts: unknown (the server has no GET /faults)")
    console.print(describe_programs(report.get("programs") or {}))
    console.print(describe_log(report.get("server_log")))
    console.print(f"{report['requests'] - report['failed']}/{report['requests']} requests ok, "
                  f"{report['failed']} failed, in {report['wall_s']:.1f} s")


def plot(path: str, report: dict[str, Any]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print(f"[yellow]--plot {path}: matplotlib is not installed, so no plot (it is "
                      "optional: pip install 'strata-jax\\[plot]' or pip install "
                      "matplotlib)[/yellow]")
        return False
    levels = report["levels"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs, ys = [], []
    for lv in levels:
        for w in lv["waves"]:
            for r in w["requests"]:
                if r["ok"] and r["decode_tps"]:
                    xs.append(lv["level"])
                    ys.append(r["decode_tps"])
    ax.scatter(xs, ys, s=14, alpha=0.6, label="decode tok/s, each request")
    ax.plot([lv["level"] for lv in levels], [lv["median_decode_tps"] or 0 for lv in levels], "o-",
            label="decode tok/s a request (median)")
    ax.plot([lv["level"] for lv in levels], [lv["aggregate_tps"] or 0 for lv in levels], "s--",
            label="aggregate tok/s (tokens / wave time)")
    for lv in levels:
        if lv["failed"]:
            ax.annotate(f"{lv['failed']} failed", (lv["level"], 0), color="red", ha="center",
                        va="bottom")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens / s")
    ax.set_xticks(sorted({lv["level"] for lv in levels}))
    s = report["settings"]
    ax.set_title(f"{s['prompt_tokens']}-token prompts, max_tokens {s['max_tokens']}, {s['waves']} "
                 "waves a level")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args, server_flags = parse_args(sys.argv[1:] if argv is None else argv)
    report: dict[str, Any] = {}
    t0 = time.monotonic()
    server = None
    try:
        with Server(args, server_flags) as server:
            asyncio.run(ladder(args, server.url, report, t0))
    except ServerStartError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    except KeyboardInterrupt:
        if not report.get("levels"):
            console.print("[red]interrupted before a level ended: no report[/red]")
            return 130
        # the levels that ended are reported (and their failures count); the level in progress is
        # not
        tally(report, t0)
        report["interrupted"] = f"after level {report['levels'][-1]['level']}"
        console.print("[red]interrupted: the report holds the levels that ended "
                      f"({report['interrupted']}); engine restarts as of then[/red]")
    if server is not None and server.log_counts is not None:
        report["server_log"] = server.log_counts
    write_json(args.json, report)
    if "error" in report:
        console.print(f"[red]{report['error']}[/red]")
        return 2
    print_summary(report)
    if args.plot and plot(args.plot, report):
        console.print(f"plot: {args.plot}")
    return (1 if report["failed"] or report["engine_restarts"] else 130 if "interrupted" in report
            else 0)


if __name__ == "__main__":
    sys.exit(main())
