"""Stop strings matched incrementally (engine/schedule/stops.py): the same answers as searching the
whole text at every token, and a cost a token that does not grow with the answer."""

from __future__ import annotations

import random
import time

from strata_jax.engine.schedule.stops import StopMatcher


def _whole_text(text: str, stops: tuple[str, ...]) -> tuple[int | None, int]:
    """The plain way: the earliest stop anywhere in the text, and the longest stop beginning at its
    end."""
    hits = [text.find(s) for s in stops if s in text]
    held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return (min(hits) if hits else None), held


def test_same_matches_and_held_characters_as_searching_the_whole_text():
    rng = random.Random(0)
    for _ in range(4000):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                      for _ in range(rng.randint(1, 4)))
        m, text = StopMatcher(stops), ""
        for _ in range(30):
            text += "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            found, held = _whole_text(text, stops)
            assert m.find(text) == found, (text, stops)
            if found is not None:
                break
            assert m.held(text) == held, (text, stops)


def test_unicode_and_overlapping_stops():
    m = StopMatcher(("<|im_end|>", "end", "ñé"))
    assert m.find("hello <|im_") is None and m.held("hello <|im_") == 5
    assert m.find("hello <|im_end|>") == 6                  # the longer stop starts first
    m = StopMatcher(("ñé",))
    assert m.find("añ") is None and m.held("añ") == 1 and m.find("añé") == 1


def test_cost_a_token_does_not_grow_with_the_answer():
    """16 stops of 512 characters: reading 4 more characters costs the same after 1K and after
    400K."""
    rng = random.Random(1)
    alphabet = "abcdefgh "
    stops = tuple("".join(rng.choice(alphabet) for _ in range(511)) + "z" for _ in range(16))

    def per_token(n_chars: int) -> float:
        text = "".join(rng.choice(alphabet) for _ in range(n_chars))
        chunks = ["".join(rng.choice(alphabet) for _ in range(4)) for _ in range(2000)]
        m = StopMatcher(stops)
        m.find(text)
        t0 = time.perf_counter()
        for c in chunks:
            text += c
            assert m.find(text) is None
            m.held(text)
        return (time.perf_counter() - t0) / len(chunks)

    short, long = min(per_token(1000) for _ in range(3)), min(per_token(400_000) for _ in range(3))
    # the old whole-text search: ~10x slower at 400K
    assert long < 4 * short + 20e-6, (short, long)
