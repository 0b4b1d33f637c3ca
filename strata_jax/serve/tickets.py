"""What the supervisor hands around: a prepared prompt, a request's ticket from queue to end, the two ways
an engine answer can fail to come, and the engine's refusals as the API's errors."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError, context_overflow

log = logging.getLogger("strata_jax.serve")


@dataclass
class Prepared:
    ids: list[int]
    max_tokens: int
    think: bool                                 # the prompt opened a reasoning part (<think>)
    tool_format: str | None = None              # tools in play: one of tool_formats.FORMATS
    grammar: list | None = None                 # the grammar that forces a tool call (tool_choice required, named)
    logit_bias: list | None = None              # [[id, bias]] when the request biased texts (llama.cpp's logit_bias)
    text: str | None = None                     # the prompt as text, when asked (llama.cpp's "__verbose")


@dataclass(eq=False)
class Ticket:
    """A request from the moment it is queued."""
    id: str
    ids: list[int]
    params: dict[str, Any]
    deadline: float                             # time.monotonic()
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "queued"                       # queued | running | done
    seat: int | None = None
    generation: int = 0                         # the engine process it ran on
    arrived: float = field(default_factory=time.monotonic)
    started: float = 0.0
    n_tokens: int = 0
    cancelled: bool = False
    first_at: float = 0.0                       # when its first and latest token events came (latency.py)
    last_at: float = 0.0
    gaps: list[float] = field(default_factory=list)     # seconds between its token events, in order

    def token_came(self, now: float) -> None:
        if self.first_at:
            self.gaps.append(now - self.last_at)
        else:
            self.first_at = now
        self.last_at = now


class EngineGone(Exception):
    """The engine process ended while we waited for its answer."""


class EngineBusy(Exception):
    """The engine has not read what was written to it (MAX_UNREAD_BYTES): nothing more is sent for now."""


def rejection(reply: dict[str, Any]) -> ApiError:
    kind = reply["kind"]
    if kind == "context":
        return context_overflow(reply["n_prompt_tokens"], reply["max_tokens"], reply["n_ctx"])
    if kind == "template":
        return ApiError(400, reply["message"], "invalid_request_error", "messages")
    if kind == "invalid":
        return ApiError(400, reply["message"], "invalid_request_error", reply.get("param"))
    if kind == "server":                        # a message made to be shown (no paths, no exception text)
        return ApiError(500, reply["message"], "server_error")
    log.error("the engine could not take %s: %s", reply.get("id"), reply.get("message"))   # a bug: log, don't echo
    return ApiError(500, f"internal error in the engine ({reply.get('id')}): the server's log has the details",
                    "server_error")
