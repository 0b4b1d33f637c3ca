"""The requests the server holds, first come first served: a queue here, and at most `parallel` in
the engine at once, one a seat (an engine slot). The supervisor (supervisor.py) owns the engine
process and says when a request may go to it; this owns who waits, who runs, and how long a request
takes (for Retry-After).

Because the queue lives here and not in the engine, an engine that stops takes down only the
requests in its seats. At most `max_queue` (--max-queue) requests wait here beyond the free seats,
counting those the engine is still reading (prepare); one more is answered 503 with Retry-After at
once. A request of n choices counts as n: choice 0 is queued at once, and its ticket holds n - 1
places (Ticket.holds) until the other choices are queued (serve/http/choices.py) or it ends, so no
burst of n = 8 requests passes the bound 8 times over.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ...engine.request import Event
from ..errors import ApiError
from .tickets import EngineBusy, Ticket


class Seats:
    def __init__(self, parallel: int, max_queue: int):
        self.max_queue = max_queue                  # requests waiting here beyond the free seats
        self.queue: deque[Ticket] = deque()
        self.seats: list[Ticket | None] = [None] * parallel
        # requests being read by the engine (prepare, questions)
        self.n_preparing = 0
        # a running mean of request seconds (Retry-After)
        self.request_s = 10.0

    @property
    def running(self) -> list[Ticket]:
        return [t for t in self.seats if t is not None]

    @property
    def free(self) -> int:
        return self.seats.count(None)

    def seat_of(self, rid: str) -> Ticket | None:
        return next((t for t in self.seats if t is not None and t.id == rid), None)

    @property
    def waiting(self) -> int:
        """Places taken beyond the seats: requests being read or queued, and those held for later
        choices."""
        return (self.n_preparing + len(self.queue)
                + sum(t.holds for t in (*self.queue, *self.running)))

    @contextmanager
    def preparing(self, places: int = 1) -> Iterator[None]:
        """A request (its `places` choices) or a question being read by the engine: a wait beyond
        the seats."""
        self.n_preparing += places
        try:
            yield
        finally:
            self.n_preparing -= places

    def enqueue(self, t: Ticket) -> None:
        """A prepared request waits for a seat (dispatch seats it)."""
        self.queue.append(t)

    def admit(self, places: int = 1) -> None:
        """Refuse at once (503 + Retry-After) a request beyond --max-queue waiting ones: a burst is
        answered quickly instead of waiting out its deadline, and the server's memory stays bounded.
        places: the request's n choices, each of which waits as a request does."""
        waiting = self.waiting
        if waiting + places > self.max_queue + self.free:    # (0: none wait beyond the free slots)
            each = (f"; this request's n = {places} choices count as {places} requests"
                    if places > 1 else "")
            raise self.busy(f"the server is full: {waiting} requests wait for {len(self.seats)} "
                            f"slots (--max-queue {self.max_queue}){each}")

    def busy(self, why: str) -> ApiError:
        waiting = self.waiting + 1
        retry = max(1, min(60, math.ceil(self.request_s * waiting / len(self.seats))))
        return ApiError(503, f"{why}; retry in {retry} s", "unavailable_error",
                        headers={"Retry-After": str(retry)})

    def dispatch(self, submit: Callable[[Ticket], Any], generation: int) -> None:
        """Seat the waiting requests on engine `generation` while seats are free; `submit` sends
        one, or raises EngineBusy (the pipe is full), when it waits at the head of the queue for the
        engine's next heartbeat. A request past its deadline ends here with an error."""
        while self.queue and None in self.seats:
            t = self.queue[0]
            if time.monotonic() > t.deadline:
                self.queue.popleft()
                t.state = "done"
                t.put(Event("error",
                                          error="the request waited for a slot past its deadline"))
                continue
            try:
                submit(t)
            except EngineBusy:
                return
            self.queue.popleft()
            seat = self.seats.index(None)
            self.seats[seat] = t
            t.state, t.seat, t.generation, t.started = "running", seat, generation, time.monotonic()

    def withdraw(self, t: Ticket) -> bool:
        """A cancelled request: one still queued ends here ("cancelled"); True when it runs on an
        engine, which must be told (its final "cancelled" event frees the seat)."""
        t.cancelled = True
        if t.state == "queued":
            self.queue.remove(t)
            t.state = "done"
            t.put(Event("final", finish_reason="cancelled"))
        return t.state == "running"

    def end(self, t: Ticket, ev: Event) -> None:
        """A request's last event: its seat (or its place in the queue) is free."""
        if t.state == "running" and t.seat is not None and self.seats[t.seat] is t:
            self.seats[t.seat] = None
            self.request_s = 0.9 * self.request_s + 0.1 * (time.monotonic() - t.started)
        elif t.state == "queued" and t in self.queue:
            self.queue.remove(t)
        t.state = "done"
        t.put(ev)

    def slots(self, n_ctx: int) -> list[dict[str, Any]]:
        """llama.cpp's GET /slots: each seat and the request in it."""
        now = time.monotonic()
        out = []
        for i, t in enumerate(self.seats):
            slot: dict[str, Any] = {"id": i, "is_processing": t is not None, "n_ctx": n_ctx}
            if t is not None:
                slot.update(request_id=t.id, n_prompt_tokens=len(t.ids), n_decoded=t.n_tokens,
                            max_tokens=t.submit.sampling.max_tokens,
                            t_elapsed_ms=round((now - t.started) * 1000, 1),
                            t_queued_ms=round((t.started - t.arrived) * 1000, 1),
                            cancelled=t.cancelled)
            out.append(slot)
        return out
