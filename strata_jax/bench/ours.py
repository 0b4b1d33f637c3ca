"""Our engine's figures: prefill tokens/s (one request reading a prompt) and decode tokens/s with N
sequences at once, each after a warm-up run of the same shape, so that program builds (XLA compiles
a window's program on its first use) are never timed.

Decode with N sequences: the engine admits requests one prompt chunk a window, so for the first few
windows fewer than N sequences decode. The figures are taken over the steady part only: from the
moment the last sequence has its first token to the moment the first sequence has its last. Within
it each sequence's rate is (its tokens - 1) / (its last token's time - its first token's time), with
times taken as its token events arrive; the aggregate is their sum.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np

from strata_jax.bench.machine import rss_mib
from strata_jax.bench.options import BenchOptions
from strata_jax.config import EngineConfig


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    """Random token ids (from the upper seven eighths of the vocabulary, away from the control
    tokens that most vocabularies put first): the same ids go to both engines."""
    return [int(t) for t in np.random.default_rng(seed).integers(vocab // 8, vocab, n)]


def engine_config(opts: BenchOptions) -> EngineConfig:
    """One engine with max(parallel_list) slots serves every N: a window holds only the slots that
    have work, so N requests on it run the same windows as on an engine of N slots."""
    need = opts.context_needed()
    if opts.max_context is not None and opts.max_context < need:
        raise ValueError(f"--max-context {opts.max_context} is too small for the bench: it needs "
                         f"{need} tokens (--prompt-tokens {opts.prompt_tokens} + 1, or "
                         f"--decode-prompt-tokens {opts.decode_prompt_tokens} + --decode-tokens "
                         f"{opts.decode_tokens})")
    max_context = opts.max_context or max(256, 1 << (need - 1).bit_length())
    return replace(opts.engine or EngineConfig(), parallel=opts.max_parallel,
                   max_context=max_context)


def _drain(handles) -> tuple[list[list[float]], list[dict]]:
    """Read every handle on a thread of its own; returns each one's token times and final stats."""
    times: list[list[float]] = [[] for _ in handles]
    stats: list[dict] = [{} for _ in handles]
    errors: list[str] = []

    def read(i: int) -> None:
        for ev in handles[i]:
            if ev.kind == "token":
                times[i].append(time.perf_counter())
            elif ev.kind == "final":
                stats[i] = ev.stats or {}
            else:
                errors.append(ev.error or "unknown error")

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a bench request failed: {errors[0]}")
    return times, stats


def steady_rates(times: list[list[float]]) -> tuple[list[float], float]:
    """Each sequence's tokens/s over the span where all of them decode (see the module docstring),
    and that span's length in seconds."""
    t0, t1 = max(ts[0] for ts in times), min(ts[-1] for ts in times)
    rates = []
    for ts in times:
        inside = [t for t in ts if t0 <= t <= t1]
        # too few tokens to overlap: use the whole run
        if len(inside) < 2 or inside[-1] <= inside[0]:
            inside = ts
        rates.append((len(inside) - 1) / max(inside[-1] - inside[0], 1e-9))
    return rates, t1 - t0


def measure_prefill(eng, opts: BenchOptions) -> dict:
    runs = []
    for i in range(opts.repeat + 1):                    # the first run builds the prompt's programs
        # A new prompt each run: the prefix cache would otherwise reuse the last run's KV and read 1
        # token.
        ids = prompt_ids(eng.spec.vocab_size, opts.prompt_tokens, opts.seed + 7919 * i)
        c = eng.generate(ids, max_tokens=1, temperature=0.0, ignore_eos=True)
        if i:
            runs.append(c.stats["prompt_per_second"])
    return {"prompt_tokens": opts.prompt_tokens, "tokens_per_second": max(runs), "runs": runs}


def measure_decode(eng, opts: BenchOptions, n: int) -> dict:
    prompts = [prompt_ids(eng.spec.vocab_size, opts.decode_prompt_tokens, opts.seed + 1 + i)
               for i in range(n)]
    # Warm-up: the same prompts, enough tokens for every sequence to get past the admission windows.
    warm = min(opts.decode_tokens, n + 8)
    best = None
    for run in range(opts.repeat + 1):
        handles = [eng.submit(p, max_tokens=warm if run == 0 else opts.decode_tokens,
                              temperature=0.0, ignore_eos=True) for p in prompts]
        times, _ = _drain(handles)
        if run == 0:
            continue
        rates, span = steady_rates(times)
        fig = {"parallel": n, "aggregate": sum(rates), "per_sequence": sum(rates) / n,
               "per_sequence_min": min(rates), "steady_seconds": span, "tokens": opts.decode_tokens}
        if best is None or fig["aggregate"] > best["aggregate"]:
            best = fig
    return best


def measure_ours(opts: BenchOptions, cfg: EngineConfig, progress=print) -> dict:
    from strata_jax.engine import Engine

    t = time.perf_counter()
    with Engine.from_gguf(opts.model, cfg) as eng:
        # the warm-up's background builds: none may run while timing
        eng.wait_for_programs()
        load_s = time.perf_counter() - t
        st = eng.stats()
        rss = rss_mib()
        progress(f"strata-jax: loaded in {load_s:.1f} s (weights {st['weights']}"
                 f"{' packed' if st.get('pack') else ''}, {st['dtype']}, kv {st['kv']}, backend "
                 f"{st['backend']}, {cfg.parallel} slots; process RSS {rss:.0f} MiB); prefill of "
                 f"{opts.prompt_tokens} tokens")
        prefill = measure_prefill(eng, opts)
        decode = []
        for n in opts.parallel_list:
            progress(f"strata-jax: decode, {n} sequence{'s' if n > 1 else ''}")
            decode.append(measure_decode(eng, opts, n))
    return {"engine": {k: st[k] for k in ("weights", "pack", "dtype", "kv", "backend", "prefill")},
            "config": cfg.to_dict(), "load_seconds": load_s, "rss_mib_after_load": rss,
            "prefill": prefill, "decode": decode}

