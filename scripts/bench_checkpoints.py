"""A hybrid family's second turn with and without state checkpoints (issue 34): the time to the
first token of turn 2 (its prompt = turn 1's prompt and answer and a new message), on one engine
with prefix reuse (it resumes at the slot's live state) and one without (it reads the whole prompt).

    python scripts/bench_checkpoints.py MODEL.gguf [--prompt-tokens 512] [--new-tokens 32]
        [--answer 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from strata_jax import Engine, EngineConfig


def second_turn(path: str, prefix: bool, n_prompt: int, n_new: int, n_answer: int,
                rounds: int = 2) -> tuple[float, int]:
    """The last of `rounds` rounds (each a fresh first turn, then the timed second turn; the first
    round builds the programs): its time and tokens resumed. Every round's time and programs built
    are printed."""
    rng = np.random.default_rng(0)
    new = [int(t) for t in rng.integers(3, 500, n_new)]
    cfg = EngineConfig(max_context=2 * (n_prompt + n_new + n_answer) + 64, prefix_cache=prefix)
    with Engine.from_gguf(path, cfg) as eng:
        for r in range(rounds):
            first = [int(t) for t in np.random.default_rng(100 + r).integers(3, 500, n_prompt)]
            answer = eng.generate(first, max_tokens=n_answer, ignore_eos=True).tokens
            built = eng.stats()["programs"]["compiles"]
            t0 = time.perf_counter()
            got = eng.generate(first + answer + new, max_tokens=1, ignore_eos=True)
            took = time.perf_counter() - t0
            print(f"  round {r}: {took * 1000:.0f} ms, "
                  f"{eng.stats()['programs']['compiles'] - built} programs built")
    return took, got.stats["reused_tokens"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    for prefix in (True, False):
        took, reused = second_turn(a.model, prefix, a.prompt_tokens, a.new_tokens, a.answer,
                                   a.rounds)
        print(f"prefix reuse {'on ' if prefix else 'off'}: turn 2 "
              f"({a.prompt_tokens + a.answer + a.new_tokens} tokens) first token in "
              f"{took * 1000:.0f} ms, {reused} tokens resumed")


if __name__ == "__main__":
    main()
