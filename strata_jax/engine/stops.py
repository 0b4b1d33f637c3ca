"""Stop strings, matched incrementally: each token looks only at the text it added and the few characters
before it that a stop string could straddle, so 16 long stops on a long answer cost the same at token
10 000 as at token 10 (the whole text was searched again at every token before: quadratic in the answer).
"""

from __future__ import annotations


class StopMatcher:
    """The stop strings of one request, and how far its text has been searched."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.searched = 0                   # text[:searched] holds no stop string

    def find(self, text: str) -> int | None:
        """Where the first stop string starts in `text` (which only grew since the last call), or None."""
        if not self.stops:
            return None
        start = max(self.searched - self.longest + 1, 0)      # a stop may end in the new text, start before it
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self.searched = len(text)
        return min(hits) if hits else None

    def held(self, text: str) -> int:
        """Characters at the end of `text` that could be the start of a stop string: not sent yet."""
        best = 0
        for s in self.stops:
            tail = text[-(len(s) - 1):] if len(s) > 1 else ""
            i = tail.find(s[0]) if tail else -1
            while i >= 0:                   # the earliest place where the tail is a prefix of `s` is the longest
                if s.startswith(tail[i:]):
                    best = max(best, len(tail) - i)
                    break
                i = tail.find(s[0], i + 1)
        return best
