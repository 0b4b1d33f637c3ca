"""Where the expert tiers' one-program decode window spends its host time (issue 33, session 33).

    python scripts/stepped_dispatch_ab.py 1|0 EXPERT_CACHE [MODEL.gguf]

An Engine(parallel=1, max_context=512, warmup=False, expert_cache=EXPERT_CACHE) with --run-ahead on
(1) or off (0) on the SmolLM2 8x2 twin (or MODEL); three requests of the same 32-token prompt, 64
tokens each, EOS ignored. Prints one JSON line for the last request: tok/s from submit to the last
token, and the milliseconds a token spent in LayerStepper._dispatch_resident (handing the program
its arrays) and _count_resident (waiting for the router ids, then counting them). Alternate on and
off runs: the VM's speed moves between runs.
"""

from __future__ import annotations

import json
import sys
import time

from strata_jax.config import EngineConfig
from strata_jax.engine import Engine
from strata_jax.engine.execute import stepped

TWIN = "/root/.cache/strata-jax/twins/SmolLM2-135M-Instruct.Q4_1-8x2.gguf"


def timed(acc: dict, name: str) -> None:
    f = getattr(stepped.LayerStepper, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
    setattr(stepped.LayerStepper, name, g)


def main() -> None:
    ahead, slots = sys.argv[1] == "1", int(sys.argv[2])
    model = sys.argv[3] if len(sys.argv) > 3 else TWIN
    acc: dict = {}
    for name in ("_dispatch_resident", "_count_resident"):
        timed(acc, name)
    cfg = EngineConfig(parallel=1, max_context=512, warmup=False, run_ahead=ahead,
                       expert_cache=slots)
    with Engine.from_gguf(model, cfg) as eng:
        ids = [(7 * i + 11) % 1000 + 300 for i in range(32)]
        for _ in range(3):
            acc.clear()
            t0, n = time.perf_counter(), 0
            for ev in eng.submit(ids, max_tokens=64, ignore_eos=True):
                n += ev.kind == "token"
            dt = time.perf_counter() - t0
    print(json.dumps({"run_ahead": ahead, "tok_s": round(n / dt, 1),
                      "ms_per_token": {k: round(1000 * v / n, 3) for k, v in acc.items()}}))


if __name__ == "__main__":
    main()
