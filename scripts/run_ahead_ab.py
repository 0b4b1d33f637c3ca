"""Decode speed of one engine with run-ahead on or off (issue 33, session 31: run_ahead.py).

    python scripts/run_ahead_ab.py MODEL.gguf 1|0 [TOKENS] [REQUESTS] [EXPERT_CACHE]

An Engine(parallel=1, max_context=512, warmup=False) with --run-ahead on (1) or off (0), and
--expert-cache EXPERT_CACHE when given (the expert tiers' one-program windows: session 33);
REQUESTS (4) requests of the same 32-token prompt, TOKENS (64) generated each, EOS ignored; prints
one JSON line: the decode tok/s of every request but the first (it builds the programs), the
windows run ahead and taken, whether every request gave the same tokens, the first 8 of them.
Alternate on and off runs: the VM's speed moves between runs.
"""

from __future__ import annotations

import json
import sys
import time

from strata_jax.config import EngineConfig
from strata_jax.engine import Engine


def main() -> None:
    model, ahead = sys.argv[1], sys.argv[2] == "1"
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    requests = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    tiers = {"expert_cache": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    cfg = EngineConfig(parallel=1, max_context=512, warmup=False, run_ahead=ahead, **tiers)
    with Engine.from_gguf(model, cfg) as eng:
        ids = [(7 * i + 11) % 1000 + 300 for i in range(32)]
        rates, outs = [], []
        for _ in range(requests):
            times, toks = [], []
            for ev in eng.submit(ids, max_tokens=tokens, ignore_eos=True):
                if ev.kind == "token":
                    times.append(time.perf_counter())
                    toks.append(ev.token)
            rates.append((len(times) - 2) / (times[-1] - times[1]))
            outs.append(toks)
        stats = eng.stats()
    print(json.dumps({"run_ahead": ahead, "tok_s": [round(r, 1) for r in rates[1:]],
                      "windows_ahead": stats["windows_ahead"],
                      "windows_ahead_taken": stats["windows_ahead_taken"],
                      "same_tokens": all(o == outs[0] for o in outs), "first": outs[0][:8],
                      "experts": {k: stats["experts"].get(k) for k in ("one_program", "hits",
                                                                       "lookups")}}))


if __name__ == "__main__":
    main()
