"""Slots: one conversation's place in the KV cache, and where its request stands."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..request import Request
from .stops import StopMatcher


@dataclass(eq=False)
class Slot:
    index: int
    request: Request | None = None
    # positions of this slot's KV cache that hold the current sequence
    n_past: int = 0
    tokens: list[int] = field(default_factory=list)   # the sequence: prompt, then generated tokens
    decoder: object = None            # the request's incremental detokenizer
    text: str = ""                    # generated text so far (before stop-string trimming)
    emitted: int = 0                  # characters of `text` already sent
    # the request's stop strings
    stops: StopMatcher = field(default_factory=lambda: StopMatcher(()))
    # when its last request ended (prefix cache: least recently used first)
    last_used: float = 0.0
    # the stop string that ended its request, if one did (llama.cpp's stop_type)
    stopping_word: str = ""
    # the cache_salt of the request whose KV it holds (prefix_cache.py)
    salt: str | None = None

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def reading(self) -> bool:
        """Still reading its prompt (the last prompt token is not in the KV cache yet)."""
        return self.request is not None and self.n_past < len(self.request.prompt)

    @property
    def decoding(self) -> bool:
        return self.request is not None and not self.reading

    @property
    def kept(self) -> list[int]:
        """The tokens whose KV this slot holds (a free slot keeps its last request's: the prefix
        cache)."""
        return self.tokens[:self.n_past]

    def assign(self, request: Request, decoder, reused: int = 0) -> None:
        """Start `request` here; its first `reused` prompt tokens are already in this slot's KV
        cache."""
        self.request, self.decoder = request, decoder
        self.tokens, self.salt = list(request.prompt), request.cache_salt
        self.n_past = reused
        self.text, self.emitted, self.stopping_word = "", 0, ""
        self.stops = StopMatcher(request.params.stop)

    # ---- the sequence and its KV: every write of them is one of these (docs/DESIGN.md, "Owners")

    def advance(self, n: int = 1) -> None:
        """n more positions of the sequence are in the KV cache (a window read them)."""
        self.n_past += n

    def add_token(self, token: int) -> None:
        """A generated token joins the sequence (its KV is written by the next window)."""
        self.tokens.append(token)

    def load(self, tokens: list[int], n_past: int) -> None:
        """The slot's KV now holds tokens[:n_past] (restored from a file, or placed by the prefix
        cache for a research read); no request runs on it."""
        self.tokens, self.n_past = list(tokens), n_past

    # ---- the request's text ----------------------------------------------------------------------

    def add_text(self, piece: str) -> None:
        self.text += piece

    def cut_at_stop(self) -> bool:
        """Whether a stop string has appeared in the text: if so the text ends before it and
        stopping_word names it."""
        at = self.stops.find(self.text)
        if at is None:
            return False
        self.stopping_word = next((w for w in self.request.params.stop
                                   if self.text.startswith(w, at)), "")
        self.text = self.text[:at]
        return True

    def take_text(self, upto: int) -> str:
        """The text from what was sent up to `upto` (never back), marked sent."""
        upto = max(upto, self.emitted)
        piece, self.emitted = self.text[self.emitted:upto], upto
        return piece

    def release(self, keep: bool = True) -> None:
        """End the request; keep=False also forgets the KV (after a failure it is not trusted)."""
        self.request, self.decoder = None, None
        self.last_used = time.monotonic()
        if not keep:
            self.forget()

    def forget(self) -> None:
        self.tokens, self.n_past, self.salt = [], 0, None
