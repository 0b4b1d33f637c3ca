"""A request's n choices (`n` up to 8): n engine requests of one prompt, their events merged.

Choice 0 goes to the engine first; the others when its first event comes (its prompt is read by
then), so they take its KV through the prefix cache (the engine copies a busy slot's matching blocks
into theirs: engine/schedule/prefix_cache.py) instead of each reading the prompt again. Until then
choice 0's ticket holds the others' places in the queue (Ticket.holds: --max-queue counts each
choice). A request with a seed gives choice k the seed + k, so the choices differ and each is
reproducible.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from ...engine.request import Event
from ..params import RequestParams
from ..supervisor.supervisor import Supervisor
from ..supervisor.tickets import Prepared, Ticket


async def events(sup: Supervisor, t: Ticket) -> AsyncIterator[Event]:
    """The ticket's events up to its last; an error event when the deadline comes first."""
    while True:
        try:
            ev = await asyncio.wait_for(t.events.get(), max(t.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            sup.cancel(t)
            yield Event("error", error="the request passed its deadline "
                                             f"({sup.config.request_timeout_s:g} s, "
                                             "--request-timeout-s)", finish_reason="timeout")
            return
        yield ev
        if ev.kind in ("final", "error"):
            return


def choice_prepared(prepared: Prepared, k: int) -> Prepared:
    """Choice k's: its seed the request's + k."""
    seed = prepared.sampling.seed
    if seed is None or k == 0:
        return prepared
    return replace(prepared, sampling=replace(prepared.sampling, seed=(seed + k) % 2**32))


class Choices:
    """The tickets of one request's choices, and their events as (choice index, event)."""

    def __init__(self, sup: Supervisor, rid: str, n: int, prepared: Prepared, params: RequestParams,
                 deadline: float, first: Ticket, on_ticket: Callable[[Ticket], None]):
        self.sup, self.rid, self.n, self.prepared = sup, rid, n, prepared
        self.params, self.deadline, self.on_ticket = params, deadline, on_ticket
        self.tickets = [first]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def _pump(self, k: int, t: Ticket) -> None:
        async for ev in events(self.sup, t):
            await self._queue.put((k, ev))

    def _start(self, k: int, t: Ticket) -> None:
        self._tasks.append(asyncio.create_task(self._pump(k, t)))

    async def merged(self) -> AsyncIterator[tuple[int, Event]]:
        """Every choice's events, as they come; each choice's last is its final or error event."""
        self._start(0, self.tickets[0])
        left = 1
        try:
            while left:
                k, ev = await self._queue.get()
                if k == 0 and len(self.tickets) < self.n and ev.kind != "error":
                    self.tickets[0].places_taken()          # the places it held are taken now
                    for j in range(1, self.n):
                        t = self.sup.enqueue(f"{self.rid}-{j}", choice_prepared(self.prepared, j),
                                             self.params, self.deadline)
                        self.tickets.append(t)
                        self.on_ticket(t)
                        self._start(j, t)
                    left += self.n - 1
                left -= ev.kind in ("final", "error")
                yield k, ev
        finally:
            for task in self._tasks:
                task.cancel()
