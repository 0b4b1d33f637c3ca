"""A deadline on reading each request: a client that sends its headers or its body a byte at a time
(slowloris), or opens a connection and sends nothing, is answered 408 and disconnected after
--read-timeout-s seconds.

uvicorn (0.3x-0.5x) has only timeout_keep_alive (armed after a response) and h11's size bounds: a
request that never completes holds its connection, and its task, for ever. The server runs uvicorn's
h11 protocol (serve/__init__.py says why h11); this is that protocol with one timer a connection. It
runs from the first byte of a request (from the connection's start for its first) until the request
is whole (h11's state for the client leaves IDLE and SEND_BODY); it is a total, not a gap between
bytes, so trickling does not extend it. Reading the answer, a streamed one too, is not bounded here:
the request's own deadline does that.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("strata_jax.serve")

# the client's side of h11 while its request is incomplete
READING = (h11.IDLE, h11.SEND_BODY)


def protocol(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's `http=` class with a read deadline of `read_timeout_s` seconds (0: none, uvicorn's
    own)."""
    if read_timeout_s <= 0:
        return H11Protocol
    return type("ReadDeadlineH11Protocol", (ReadDeadlineH11Protocol,),
                {"read_timeout_s": float(read_timeout_s)})


class ReadDeadlineH11Protocol(H11Protocol):
    read_timeout_s = 30.0
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()                             # a new request's first bytes
        super().data_received(data)
        self._disarm_when_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # (a pipelined request read meanwhile keeps its timer)
        self._disarm_when_read()

    # ---- the timer -------------------------------------------------------------------------------

    def _arm(self) -> None:
        self._cancel()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _cancel(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _disarm_when_read(self) -> None:
        if self.conn.their_state not in READING:
            self._cancel()

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state not in READING:
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("%s did not send a whole request within %g s (--read-timeout-s): disconnected",
                    client, self.read_timeout_s)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not self._answering():
            self.transport.write(_timeout_response(self.read_timeout_s))
        self.transport.close()                      # the app's read (if any) ends as a disconnect

    def _answering(self) -> bool:
        """The app has begun its answer (it did not wait for the body): a 408 would garble it."""
        return self.cycle is not None and getattr(self.cycle, "response_started", False)


def _timeout_response(seconds: float) -> bytes:
    """A 408 in OpenAI's error shape, written raw: h11 cannot send a response to a request it has
    not read."""
    message = (f"the request was not sent whole within {seconds:g} s (the server's "
               "--read-timeout-s); send the headers and the body at once")
    body = json.dumps({"error": {"message": message, "type": "timeout_error",
                                 "code": 408}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: "
            b"close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
