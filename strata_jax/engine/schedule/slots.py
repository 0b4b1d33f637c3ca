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
    n_past: int = 0                   # positions of this slot's KV cache that hold the current sequence
    tokens: list[int] = field(default_factory=list)   # the sequence: prompt, then generated tokens
    decoder: object = None            # the request's incremental detokenizer
    text: str = ""                    # generated text so far (before stop-string trimming)
    emitted: int = 0                  # characters of `text` already sent
    stops: StopMatcher = field(default_factory=lambda: StopMatcher(()))   # the request's stop strings
    last_used: float = 0.0            # when its last request ended (prefix cache: least recently used first)
    stopping_word: str = ""           # the stop string that ended its request, if one did (llama.cpp's stop_type)
    salt: str | None = None           # the cache_salt of the request whose KV it holds (prefix_cache.py)

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
        """The tokens whose KV this slot holds (a free slot keeps its last request's: the prefix cache)."""
        return self.tokens[:self.n_past]

    def assign(self, request: Request, decoder, reused: int = 0) -> None:
        """Start `request` here; its first `reused` prompt tokens are already in this slot's KV cache."""
        self.request, self.decoder = request, decoder
        self.tokens, self.salt = list(request.prompt), request.cache_salt
        self.n_past = reused
        self.text, self.emitted, self.stopping_word = "", 0, ""
        self.stops = StopMatcher(request.params.stop)

    def release(self, keep: bool = True) -> None:
        """End the request; keep=False also forgets the KV (after a failure it is not trusted)."""
        self.request, self.decoder = None, None
        self.last_used = time.monotonic()
        if not keep:
            self.forget()

    def forget(self) -> None:
        self.tokens, self.n_past, self.salt = [], 0, None
