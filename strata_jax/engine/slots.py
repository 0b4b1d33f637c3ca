"""Slots: one conversation's place in the KV cache, and where its request stands."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass(eq=False)
class Slot:
    index: int
    request: Request | None = None
    n_past: int = 0                   # positions of this slot's KV cache that hold the current sequence
    tokens: list[int] = field(default_factory=list)   # the sequence: prompt, then generated tokens
    decoder: object = None            # the request's incremental detokenizer
    text: str = ""                    # generated text so far (before stop-string trimming)
    emitted: int = 0                  # characters of `text` already sent

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

    def assign(self, request: Request, decoder) -> None:
        self.request, self.decoder = request, decoder
        self.tokens = list(request.prompt)
        self.n_past = 0
        self.text, self.emitted = "", 0

    def release(self) -> None:
        self.request, self.decoder = None, None
