"""One JSON object or array read as its text arrives: where it ends and where its keys' values
lie."""

from __future__ import annotations

import json
from typing import Any


class JsonScan:
    """One JSON object or array as its text arrives: where it ends, and where each of its own keys'
    values lie (spans into the text it was fed). It checks brackets and strings only: json.loads
    says the rest."""

    def __init__(self):
        self.text, self.depth, self.in_str, self.esc = "", 0, False, False
        self.end: int | None = None           # one past the closing bracket
        self.keys: dict[str, list] = {}       # key -> [start, end or None]
        self._key_at: int | None = None        # a key's opening quote (depth 1)
        self._expect_key, self._key = True, None
        self._open: list | None = None         # the value span being read (depth 1)

    def feed(self, text: str) -> None:
        base = len(self.text)
        self.text += text
        for i, c in enumerate(text, base):
            if self.end is not None:
                return
            self._char(i, c)

    def _char(self, i: int, c: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1 and self._key_at is not None:
                    try:
                        self._key = json.loads(self.text[self._key_at:i + 1])
                    except ValueError:
                        self._key = None
                    self._key_at = None
                elif self.depth == 1 and self._open is not None:
                    self._open[1] = i + 1
                    self._open = None
            return
        if self._open is not None and self.depth == 1 and (c.isspace() or c in ",}]"):
            self._open[1], self._open = i, None          # the end of a number, true, false or null
        if c.isspace():
            return
        if c == '"':
            self.in_str = True
            if self.depth == 1 and self._expect_key:
                self._key_at = i
            elif self.depth == 1:
                self._start_value(i)
        elif c in "{[":
            if self.depth == 1 and not self._expect_key:
                self._start_value(i)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self._open is not None:
                self._open[1], self._open = i + 1, None
            if self.depth == 0:
                self.end = i + 1
        elif self.depth == 1 and c == ":":
            self._expect_key = False
        elif self.depth == 1 and c == ",":
            self._expect_key = True
        elif self.depth == 1 and not self._expect_key and self._open is None:
            self._start_value(i)

    def _start_value(self, i: int) -> None:
        self._open = [i, None]
        if self._key is not None and self._key not in self.keys:
            self.keys[self._key] = self._open
        self._key = None

    def value(self, key: str) -> Any:
        span = self.keys.get(key)
        if not span or span[1] is None:
            return None
        try:
            return json.loads(self.text[span[0]:span[1]])
        except ValueError:
            return None
