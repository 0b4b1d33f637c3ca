"""Requests into slots: the admission half of the scheduling (the Scheduler plans windows over the
slots).

First come first served: a waiting request takes a free slot as soon as there is one, the slot the
prefix cache picks (the one whose kept KV it reuses most). A request cancelled or past its deadline
is ended where it is, waiting or on a slot, before the next window is planned.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from ..request import Request
from .output import Output, first_line
from .slots import Slot

log = logging.getLogger("strata_jax.engine")


class Admission:
    def __init__(self, prefix, tokenizer, speculator, output: Output,
                 cache_lost: Callable[[], bool],
                 lose_cache: Callable[[Exception], None], request_timeout_s: float):
        self.prefix = prefix              # PrefixCache: which slot, and what it reuses
        self.tokenizer = tokenizer        # each request's incremental detokenizer
        self.speculator = speculator      # None without --spec: its drafts of a slot start afresh
        self.output = output
        self._cache_lost, self._lose_cache = cache_lost, lose_cache
        self.request_timeout_s = request_timeout_s
        self.waiting: deque[Request] = deque()

    def wait(self, req: Request) -> None:
        """A new request joins the queue (it takes a slot in admit, in order of arrival)."""
        self.waiting.append(req)

    def admit(self, slots: list[Slot]) -> None:
        """Waiting requests onto free slots, in order of arrival."""
        while self.waiting:
            free = [s for s in slots if s.free]
            if not free:
                return
            req = self.waiting.popleft()
            if req.cancelled.is_set():
                self.output.finish_unslotted(req, "cancelled")
                continue
            req.t_start = time.monotonic()
            placed = self.place(req.prompt, free, [s for s in slots if not s.free], req.cache_salt)
            if placed is None:
                self.output.fail_unslotted(req, "the prefix cache failed to place the request (see "
                                                "the log)")
                continue
            slot, req.reused = placed
            try:
                slot.assign(req, self.tokenizer.stream_decoder(), req.reused)
                if self.speculator is not None:
                    self.speculator.reset(slot)
                if req.progress:
                    self.output.progress(slot)
            except Exception as e:
                log.exception("request %d could not start", req.id)
                slot.release(keep=False)
                self.output.fail_unslotted(req, f"the engine could not start the request: "
                                                f"{type(e).__name__}: {first_line(e)}", count=True)

    def place(self, prompt: list[int], free: list[Slot], busy: list[Slot] = (),
              salt: str | None = None) -> tuple[Slot, int] | None:
        """The prefix cache's choice of slot (and its stores, restores and forks); None if that
        failed."""
        try:
            return self.prefix.place(prompt, free, busy, salt)
        except Exception as e:  # noqa: BLE001 - a failed copy must not take the engine down
            log.error("the prefix cache failed to place a request: %s", e)
            if self._cache_lost():
                self._lose_cache(e)
            for s in free:
                s.forget()
            return None

    def expire(self, slots: list[Slot]) -> None:
        """End the requests cancelled or past their deadline, on slots and waiting."""
        now = time.monotonic()
        for s in slots:
            if s.free:
                continue
            if s.request.cancelled.is_set():
                self.output.finish(s, "cancelled")
            elif now > s.request.deadline:
                self.output.fail(s, "the request passed its deadline "
                                    f"({self.request_timeout_s:.0f} s)")
        for req in list(self.waiting):
            if req.cancelled.is_set():
                self.waiting.remove(req)
                self.output.finish_unslotted(req, "cancelled")
            elif now > req.deadline:
                self.waiting.remove(req)
                self.output.fail_unslotted(req, "the request waited for a slot past its deadline")
