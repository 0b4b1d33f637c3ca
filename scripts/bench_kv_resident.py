"""Decode tokens/s with part of each slot's KV in host RAM (--kv-resident) against all KV on the
device.

Two engines on the same model and context: one with every position on the device, one keeping only
the first --kv-resident positions there. Each sequence first reads a --context-token prompt (this
builds the programs); then, in rounds that alternate between the two engines (so a change in the
machine's load hits both alike), the same prompts are sent again: the prefix cache reuses the slot's
KV (host part included), so a round reads one token and decodes --decode-tokens. Reported: the
median over rounds of the summed decode rate of the sequences, and the host KV brought in per
decoded token.

    python scripts/bench_kv_resident.py                      # SmolLM2, 3072-token context, N = 1024
    python scripts/bench_kv_resident.py MODEL.gguf --context 6000 --max-context 8192 --kv-resident
        2048

--windows W: no prompt reading; decode windows run straight on the runner with every slot at
position --context (the KV holds zeros: the values do not change the work), W windows a round: the
time of a decode window, with only one program a setting to build.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from strata_jax import Engine, EngineConfig


def decode_rate(eng: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Send the prompts at once; -> the sum of their decode rates (tokens/s)."""
    handles = [eng.submit(p, max_tokens=tokens, ignore_eos=True) for p in prompts]
    total = 0.0
    for h in handles:
        final = [ev for ev in h if ev.kind in ("final", "error")][-1]
        if final.kind == "error":
            raise RuntimeError(final.error)
        total += final.stats["predicted_per_second"]
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--context", type=int, default=3072,
                    help="prompt tokens each sequence reads (default 3072)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--kv-resident", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--parallel-list", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv", default="auto")
    ap.add_argument("--attn-chunk", default="auto")
    ap.add_argument("--windows", type=int, default=0,
                    help="time W decode windows a round on the runner instead")
    args = ap.parse_args()
    if args.model is None:
        from strata_jax.fetch import smollm2_path

        args.model = str(smollm2_path())
    plist = [int(x) for x in args.parallel_list.split(",")]
    base = {"parallel": max(plist), "max_context": args.max_context, "kv": args.kv,
            "attn_chunk": args.attn_chunk, "request_timeout_s": 7200.0}
    engines = {"all on device": Engine.from_gguf(args.model, EngineConfig(**base)),
               f"kv-resident {args.kv_resident}": Engine.from_gguf(
                   args.model, EngineConfig(**base, kv_resident=args.kv_resident))}
    try:
        (report_windows if args.windows else report)(args, engines, plist)
    finally:
        for eng in engines.values():
            eng.close()
    return 0


def report_windows(args, engines: dict[str, Engine], plist: list[int]) -> None:
    from strata_jax.engine.execute.layouts import GroupInput
    from strata_jax.engine.execute.sampler import SamplingRows
    from strata_jax.engine.schedule.scheduler import bucket

    def window(n: int) -> GroupInput:
        rows = bucket(n, 2)
        pos = np.full((rows, 1), -1, np.int32)
        pos[:n] = args.context
        return GroupInput(np.ones((rows, 1), np.int32), pos, np.arange(rows, dtype=np.int32) % n,
                          SamplingRows.greedy(rows))

    for name, eng in engines.items():
        r, t = eng.runner, time.perf_counter()
        # the host part holds positions device_len..context
        if r.kv_host is not None:
            n_host = args.context - r.device_len
            zeros = {k: np.zeros((r.kv_host.n_layers, n_host, *shape), dt)
                     for k, (shape, dt) in r.kv_host.entries.items()}
            for slot in range(max(plist)):
                r.kv_host.put(slot, r.device_len, zeros)
        for n in plist:
            r.run([window(n)], args.context + 1)
        print(f"{name}: programs built in {time.perf_counter() - t:.0f} s", flush=True)
    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for name, eng in engines.items():
            for n in plist:
                g = window(n)
                t = time.perf_counter()
                for _ in range(args.windows):
                    eng.runner.run([g], args.context + 1)
                ms = (time.perf_counter() - t) / args.windows * 1000
                times.setdefault((name, n), []).append(ms)
                print(f"round {rnd + 1}: {name}, {n} row(s): {ms:.1f} ms a window", flush=True)
    print(f"\nmodel {args.model}, decode windows at position {args.context}, max_context "
          f"{args.max_context}, {args.windows} windows a round, median of {args.rounds} rounds")
    print("| KV placement | rows | ms a decode window | decode tok/s (sum) | vs all on device |")
    print("| --- | --- | --- | --- | --- |")
    first = next(iter(engines))
    for (name, n), xs in times.items():
        med = statistics.median(xs)
        print(f"| {name} | {n} | {med:.1f} | {n * 1000 / med:.1f} | "
              f"{statistics.median(times[(first, n)]) / med:.2f} |")


def report(args, engines: dict[str, Engine], plist: list[int]) -> None:
    rng = np.random.default_rng(0)
    vocab = next(iter(engines.values())).spec.vocab_size
    prompts = [[int(t) for t in rng.integers(100, vocab - 100, args.context)]
               for _ in range(max(plist))]
    for name, eng in engines.items():                       # read the prompts, build the programs
        t = time.perf_counter()
        for n in plist:
            decode_rate(eng, prompts[:n], 4)
        print(f"{name}: prompts read and programs built in {time.perf_counter() - t:.0f} s",
              flush=True)
    rates: dict[tuple[str, int], list[float]] = {}
    fetched: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for name, eng in engines.items():
            for n in plist:
                kv0 = eng.stats()["kv_cache"].get("host_kv_fetched_bytes", 0)
                rate = decode_rate(eng, prompts[:n], args.decode_tokens)
                kv1 = eng.stats()["kv_cache"].get("host_kv_fetched_bytes", 0)
                rates.setdefault((name, n), []).append(rate)
                fetched.setdefault((name, n), []).append((kv1 - kv0) / (n * args.decode_tokens))
                print(f"round {r + 1}: {name}, {n} sequence(s): {rate:.1f} tok/s", flush=True)
    print(f"\nmodel {args.model}, context {args.context} tokens, max_context {args.max_context}, "
          f"{args.decode_tokens} decoded tokens a sequence, median of {args.rounds} rounds")
    print("| KV placement | sequences | decode tok/s (sum) | vs all on device | host KV read a "
          "token |")
    print("| --- | --- | --- | --- | --- |")
    first = next(iter(engines))
    for (name, n), xs in rates.items():
        med = statistics.median(xs)
        ratio = med / statistics.median(rates[(first, n)])
        mib = statistics.median(fetched[(name, n)]) / 2**20
        print(f"| {name} | {n} | {med:.1f} | {ratio:.2f} | {mib:.2f} MiB |")


if __name__ == "__main__":
    raise SystemExit(main())
