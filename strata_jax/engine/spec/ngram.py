"""The ngram drafter: prompt lookup over the slot's own sequence (no extra weights).

To draft the token after a sequence, take its last k tokens (k = 3, then 2, then 1: the longest
suffix that occurred before) and look at what followed each earlier occurrence. The draft is the
most frequent follower (the most recent among equals), and its probability is that follower's
relative frequency: the share of the earlier occurrences it followed. A suffix seen once gives
probability 1; a suffix followed by three different tokens gives 1/3 or more. Drafting goes on over
the sequence plus its own drafts, and stops at --spec-min-p (a lookup this uncertain is unlikely to
be accepted) or when no suffix occurred.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_n: int = 3):
        self.max_n = max_n

    def reset(self, slot) -> None:
        """Nothing is kept between windows: the lookup reads the slot's sequence each time."""

    def propose(self, slots, counts: list[int],
                min_p: float) -> list[tuple[list[int], list[float]]]:
        out = []
        for slot, n in zip(slots, counts):
            seq = np.asarray(slot.tokens, np.int64)
            toks, probs = [], []
            for _ in range(n):
                tok, p = self.next_token(seq)
                if tok is None or p < min_p:
                    break
                toks.append(tok)
                probs.append(p)
                seq = np.append(seq, tok)
            out.append((toks, probs))
        return out

    def next_token(self, seq: np.ndarray) -> tuple[int | None, float]:
        """The drafted follower of seq [T] and its relative frequency; (None, 0) when no suffix
        recurs."""
        for k in range(min(self.max_n, len(seq) - 1), 0, -1):
            # [T-k, k]: each has a follower
            windows = sliding_window_view(seq[:-1], k)
            hits = np.flatnonzero((windows == seq[-k:]).all(axis=1))
            if hits.size == 0:
                continue
            followers = seq[hits + k]
            values, counts = np.unique(followers, return_counts=True)
            best = counts.max()
            winners = set(values[counts == best].tolist())
            # the most recent of the best
            tok = next(int(t) for t in followers[::-1] if int(t) in winners)
            return tok, float(best) / followers.size
        return None, 0.0

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass
