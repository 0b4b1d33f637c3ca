"""Decode tokens/s with 0, 1 and all of 8 rows constrained by a JSON schema (docs/BENCHMARKS.md,
"Constrained decoding"), on the engine without HTTP.

    python scripts/bench_structured.py [MODEL.gguf]      # default: SmolLM2-135M-Instruct (49,152 tokens)

8 requests at once (--parallel 8), greedy, 64 tokens each past a short prompt; k of them carry a
schema whose one string must be 400 characters long, so no constrained row ends early. Each mix runs
twice and the second is timed (the first builds the controlled programs). Decode tokens/s: the
tokens generated after each request's first, over the time from the last first token to the last
token.
"""  # noqa: E501

from __future__ import annotations

import json
import sys

from strata_jax import Engine, EngineConfig
from strata_jax.fetch import smollm2_path

SCHEMA = json.dumps({"type": "object",
                     "properties": {"story": {"type": "string", "minLength": 400}},
                     "required": ["story"], "additionalProperties": False})
N, TOKENS = 8, 64


def run(eng: Engine, constrained: int) -> float:
    handles = [eng.submit([{"role": "user", "content": f"Tell me story number {i}"}],
                          max_tokens=TOKENS, temperature=0, ignore_eos=True,
                          grammar=("json_schema", SCHEMA) if i < constrained else None)
               for i in range(N)]
    firsts, ends, n = [], [], 0
    for h in handles:
        for ev in h:
            if ev.kind == "error":
                raise RuntimeError(ev.error)
            if ev.kind == "final":
                st = ev.stats
                n += st["generated_tokens"] - 1
        firsts.append(h.request.t_first)
        ends.append(h.request.t_end)
    return n / (max(ends) - max(firsts))


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else smollm2_path()
    with Engine.from_gguf(path, EngineConfig(parallel=N, max_context=512)) as eng:
        eng.wait_for_programs()
        print(f"{path}: vocab {eng.spec.vocab_size}, {N} requests x {TOKENS} tokens, greedy")
        for k in (0, 1, N):
            run(eng, k)
            rates = [run(eng, k) for _ in range(2)]
            print(f"  {k} of {N} rows constrained: decode {max(rates):.1f} tok/s (runs: "
                  f"{', '.join(f'{r:.1f}' for r in rates)})")


if __name__ == "__main__":
    main()
