"""What the supervisor hands around: a prepared request (serve/prompts.py), a request's ticket from
queue to end, the two ways an engine answer can fail to come, and the engine's refusals as the API's
errors."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ...engine.request import Event
from ..errors import ApiError, context_overflow
from ..prompts import Prepared
from ..protocol import Rejected, Submit

__all__ = ["EngineBusy", "EngineGone", "Prepared", "Ticket", "rejection"]

log = logging.getLogger("strata_jax.serve")


@dataclass(eq=False)
class Ticket:
    """A request from the moment it is queued: the Submit frame the engine gets when it is seated,
    and what comes back."""
    id: str
    submit: Submit
    deadline: float                             # time.monotonic()
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "queued"                       # queued | running | done
    seat: int | None = None
    generation: int = 0                         # the engine process it ran on
    arrived: float = field(default_factory=time.monotonic)
    started: float = 0.0
    n_tokens: int = 0
    cancelled: bool = False
    # queue places kept for its request's later choices (choices.py)
    holds: int = 0
    # when its first and latest token events came (latency.py)
    first_at: float = 0.0
    last_at: float = 0.0
    gaps: list[float] = field(default_factory=list)     # seconds between its token events, in order
    # set at its first event (or its end): the engine has taken it, or refused it
    heard: asyncio.Event = field(default_factory=asyncio.Event)
    # the engine's refusal, as the API's error (a grammar it cannot compile)
    refused: ApiError | None = None

    @property
    def ids(self) -> list[int]:
        return self.submit.ids

    def put(self, ev: Event) -> None:
        """One of its events, for its reader."""
        self.heard.set()
        self.events.put_nowait(ev)

    def refuse(self, error: ApiError) -> None:
        self.refused = error

    async def verdict(self) -> None:
        """Wait for the engine's first word on it (its first event, or its end; at most until its
        deadline) -> None, or its refusal raised: the route answers a refused request with the
        refusal's status before it writes anything (generate.start, for a grammar the engine
        compiles when the request reaches it)."""
        try:
            await asyncio.wait_for(self.heard.wait(), max(self.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return                              # (its events say so: choices.events)
        if self.refused is not None:
            raise self.refused

    def places_taken(self) -> None:
        """Its request's later choices are queued now: the places it held for them are theirs."""
        self.holds = 0

    def token_came(self, now: float) -> None:
        if self.first_at:
            self.gaps.append(now - self.last_at)
        else:
            self.first_at = now
        self.last_at = now


class EngineGone(Exception):
    """The engine process ended while we waited for its answer."""


class EngineBusy(Exception):
    """The engine has not read what was written to it (MAX_UNREAD_BYTES): nothing more is sent for
    now."""


def rejection(reply: Rejected) -> ApiError:
    if reply.kind == "context":
        return context_overflow(reply.n_prompt_tokens, reply.max_tokens, reply.n_ctx)
    if reply.kind == "template":
        return ApiError(400, reply.message, "invalid_request_error", "messages")
    if reply.kind == "invalid":
        return ApiError(400, reply.message, "invalid_request_error", reply.param)
    # what it asks for is beyond a bound (--max-tokenize-ids, ...)
    if reply.kind == "too_large":
        return ApiError(413, reply.message, "invalid_request_error", reply.param)
    # a message made to be shown (no paths, no exception text)
    if reply.kind == "server":
        return ApiError(500, reply.message, "server_error")
    # a bug: log, don't echo
    log.error("the engine could not take %s: %s", reply.id, reply.message)
    return ApiError(500,
                    f"internal error in the engine ({reply.id}): the server's log has the details",
                    "server_error")
