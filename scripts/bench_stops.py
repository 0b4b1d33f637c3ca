"""Stop-string matching cost a token (issue 13, item 6): 16 stop strings of 512 characters that
never match, on answers of growing length, token by token (4 characters a token), with the engine's
incremental StopMatcher and with the search over the whole text that it replaced.

    python scripts/bench_stops.py            # prints microseconds a token at each answer length
"""

from __future__ import annotations

import random
import time

from strata_jax.engine.schedule.stops import StopMatcher


def whole_text(text: str, stops: tuple[str, ...]) -> tuple[int | None, int]:
    """The old way: search the whole text, then try every prefix length of every stop at its end."""
    hits = [text.find(s) for s in stops if s in text]
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                held = max(held, n)
                break
    return (min(hits) if hits else None), held


def per_token_us(n_chars: int, stops: tuple[str, ...], incremental: bool,
                 tokens: int = 200) -> float:
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(n_chars))
    m = StopMatcher(stops)
    m.find(text)
    t0 = time.perf_counter()
    for _ in range(tokens):
        text += "".join(rng.choice("abcdefgh ") for _ in range(4))
        if incremental:
            m.find(text)
            m.held(text)
        else:
            whole_text(text, stops)
    return (time.perf_counter() - t0) / tokens * 1e6


def main() -> None:
    rng = random.Random(1)
    # stops that share letters with the text (so prefixes are tried) and never match: "z" ends each
    stops = tuple("".join(rng.choice("abcdefgh ") for _ in range(511)) + "z" for _ in range(16))
    print("answer chars | incremental us/token | whole-text us/token")
    for n in (1_000, 10_000, 100_000, 1_000_000):
        print(f"{n:>12} | {per_token_us(n, stops, True):>20.1f} | "
              f"{per_token_us(n, stops, False):>19.1f}")


if __name__ == "__main__":
    main()
