"""The commands that wait for the engine's reply, by id: the supervisor sends a command (stats,
tokenize, ...), and the reply that names its id (rejected, stats, saved, answer) resolves it. An
engine that stops fails every one still waiting (EngineGone), so the caller can ask the next
engine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ApiError
from ..protocol import Answer, AnyReply, Command, Rejected, Saved, Stats
from .tickets import EngineGone, rejection

log = logging.getLogger("strata_jax.serve")

R = TypeVar("R")


class Answers:
    def __init__(self, send: Callable[[Command], bool]):
        # writes a command to the engine; False: it is not running
        self._send = send
        self._waiting: dict[str, asyncio.Future] = {}

    async def ask(self, cmd: Any, deadline: float) -> AnyReply:
        """Send `cmd` (a Command with an id) and wait until `deadline` (time.monotonic()) for the
        reply that names it; EngineGone when it cannot be sent or the engine stops meanwhile,
        TimeoutError after the deadline."""
        rid = cmd.id
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            if not self._send(cmd):
                raise EngineGone("the engine process is not running")
            return await asyncio.wait_for(fut, max(deadline - time.monotonic(), 0.0))
        finally:
            self._waiting.pop(rid, None)

    def came(self, reply: Rejected | Stats | Saved | Answer) -> None:
        fut = self._waiting.pop(reply.id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def fail_all(self, why: str) -> None:
        """The engine stopped: every command still waiting fails with EngineGone(why)."""
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(EngineGone(why))
        self._waiting.clear()


def expect(reply: AnyReply, kind: type[R]) -> R:
    """`reply` when it is the `kind` asked for; the engine's Rejected as the API's error; any other
    reply is the engine's bug (a 500, logged)."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Rejected):
        raise rejection(reply)
    log.error("the engine answered %s with a %s frame, not %s", getattr(reply, "id", "?"),
              type(reply).__name__, kind.__name__)
    raise ApiError(500, "internal error: the engine's answer was not the one asked for",
                   "server_error")
