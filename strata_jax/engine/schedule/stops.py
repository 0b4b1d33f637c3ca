"""Stop strings, matched incrementally: one Aho-Corasick automaton over a request's stop strings
reads each character of the answer once, so a token costs a few steps of it whatever the number and
length of the stops and the length of the answer (the whole text was searched again at every token
before: quadratic in the answer, and 16 stops of 512 characters cost milliseconds a token).

The automaton's state is the longest end of the text that begins some stop string: its length is
what must be held back from the stream (it may yet become a stop), and reaching the end of a stop is
a match.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    """The stop strings of one request and how far into its text the automaton has read."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        # trie edges of each state (state 0: nothing matched)
        self._next: list[dict[str, int]] = [{}]
        # characters of a stop's beginning a state stands for the longest stop ending at a state (0:
        # none)
        self._depth = [0]
        self._ends = [0]
        for s in self.stops:
            self._add(s)
        self._fail = self._failure_links()
        self._state = 0
        self._read = 0                              # characters of the text read so far

    def find(self, text: str) -> int | None:
        """Where the earliest stop string among those ending in the new part of `text` starts, or
        None. `text` only grows between calls."""
        first = None
        for i in range(self._read, len(text)):
            self._state = self._step(self._state, text[i])
            n = self._ends[self._state]
            if n and (first is None or i - n + 1 < first):
                first = i - n + 1
        self._read = len(text)
        return first

    def held(self, text: str) -> int:
        """Characters at the end of `text` (as read by `find`) that could be the start of a stop
        string."""
        return min(self._depth[self._state], len(text))

    # ---- the automaton ---------------------------------------------------------------------------

    def _add(self, s: str) -> None:
        state = 0
        for ch in s:
            nxt = self._next[state].get(ch)
            if nxt is None:
                nxt = len(self._next)
                self._next[state][ch] = nxt
                self._next.append({})
                self._depth.append(self._depth[state] + 1)
                self._ends.append(0)
            state = nxt
        self._ends[state] = max(self._ends[state], len(s))

    def _failure_links(self) -> list[int]:
        """For each state, the state of its longest proper end that also begins a stop (breadth
        first, so shorter states are done first); a state's match is also the longest of its failure
        chain's."""
        fail = [0] * len(self._next)
        todo = deque(self._next[0].values())
        while todo:
            state = todo.popleft()
            for ch, nxt in self._next[state].items():
                f = fail[state]
                while f and ch not in self._next[f]:
                    f = fail[f]
                fail[nxt] = self._next[f].get(ch, 0) if self._next[f].get(ch) != nxt else 0
                self._ends[nxt] = max(self._ends[nxt], self._ends[fail[nxt]])
                todo.append(nxt)
        return fail

    def _step(self, state: int, ch: str) -> int:
        # amortized O(1): each failure step shortens the state, which grows by at most one a
        # character
        while state and ch not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(ch, 0)
