"""A decode window's program alone against the engine's decode (issue 33: where a step goes).

    python scripts/window_alone.py MODEL.gguf [WINDOWS] [EXPERT_CACHE]

An Engine(parallel=1, max_context=512, warmup=False) decodes three requests of the same 32-token
prompt (64 tokens each, EOS ignored) and records its decode windows; then one of them (the middle
one: one row, its position ~64) is run WINDOWS (200) times in a row on the same inputs, with no
engine around it: "window" the model program alone, "window+sampler" chained with the sampler's
program as run-ahead chains them (each window fed the last one's tokens on the device). Prints one
JSON line: the engine's decode tok/s a request, and the ms a window of each loop (best of 3, two
rounds each). If "window+sampler" is close to 1000 / the engine's tok/s, the engine's own work
between windows is hidden and the time is the program's (session 36, Ice Lake, AVX2: 6.6-7.1 ms a
window against the engine's 6.75 ms a token: docs/BENCHMARKS.md); `scripts/bench_kernels.py
--decode-chain` gives the products' share of it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import numpy as np

from strata_jax.config import EngineConfig
from strata_jax.engine import Engine


def main() -> None:
    model = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    tiers = {"expert_cache": int(sys.argv[3])} if len(sys.argv) > 3 else {}
    cfg = EngineConfig(parallel=1, max_context=512, warmup=False, **tiers)
    with Engine.from_gguf(model, cfg) as eng:
        runner = eng.runner
        seen = []
        run = runner.run

        def recording(groups, kv_needed, ahead=False):
            if len(groups) == 1 and groups[0].tokens.shape[1] == 1:
                seen.append((groups[0], kv_needed))
            return run(groups, kv_needed, ahead)

        runner.run = recording
        ids = [(7 * i + 11) % 1000 + 300 for i in range(32)]
        rates = []
        for _ in range(3):
            times = [time.perf_counter() for ev in eng.submit(ids, max_tokens=64, ignore_eos=True)
                     if ev.kind == "token"]
            rates.append((len(times) - 2) / (times[-1] - times[1]))
        runner.run = run
        g, kv_needed = seen[len(seen) // 2]
        layout = runner.layout_of([g], kv_needed)
        out = {"engine_tok_s": [round(r, 1) for r in rates], "layout": str(layout)}
        for mode in ("window+sampler", "window") * 2:
            best = []
            for _ in range(3):
                gg, t0 = g, time.perf_counter()
                for _ in range(n):
                    logits, _ = runner.executor.forward([gg], layout)
                    if mode == "window+sampler":
                        tokens, nxt = runner.answers.tokens_on_device(logits[0], gg)
                        gg = replace(gg, tokens=nxt)
                np.asarray(tokens if mode == "window+sampler" else logits[0])
                best.append((time.perf_counter() - t0) / n * 1e3)
            out.setdefault(mode, []).append(round(min(best), 3))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
