"""The server's questions to the engine process (Supervisor.ask): /tokenize, /detokenize
(serve/tokens.py), /slots/N (engine/slot_files.py) and the embeddings
(serve/http/embeddings.py).

Each is admitted as a generation request is (issue 32, items 3, 4, 16): it takes a place in
--max-queue while it waits for its answer (beyond it: 503 with Retry-After at once), and its command
obeys the pipe's byte bound (engine_process.MAX_UNREAD_BYTES: a 503 with Retry-After while the
engine has not read what was sent), so no burst of questions grows the server's memory or the
engine's work without bound. An engine that stops meanwhile is said at once, with its exit (the
fault's public text), not as a timeout; a question out of time (or whose client went away) is
cancelled in the engine, which drops an embedding's next pieces.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..errors import ApiError
from ..protocol import Answer, Cancel, Command
from .answers import expect
from .tickets import EngineBusy, EngineGone


async def ask(sup: Any, cmd: Command, timeout: float, send: Callable[[Command], bool]) -> Answer:
    """`cmd` (with its id) to the engine of `sup` (a Supervisor: its seats, answers, wait_ready),
    `send` writing to it -> its Answer; the engine's refusal as its ApiError; 503s as the module
    says."""
    op = type(cmd).__struct_config__.tag
    deadline = time.monotonic() + timeout
    # 503 + Retry-After at once beyond --max-queue (seats.py)
    sup.seats.admit()
    try:
        with sup.seats.preparing():
            await sup.wait_ready(deadline)
            reply = await sup.answers.ask(cmd, deadline)
    except EngineBusy as e:                     # the pipe's byte bound
        raise sup.seats.busy(str(e)) from None
    # it stopped: its exit, now (not "did not answer" later)
    except EngineGone as e:
        raise ApiError(503, f"the engine stopped while answering {op}: {e}; please retry",
                       "unavailable_error") from None
    except (TimeoutError, asyncio.CancelledError) as e:     # out of time, or the client went away
        send(Cancel(cmd.id))
        if isinstance(e, asyncio.CancelledError):
            raise
        raise ApiError(503, f"the engine did not answer {op} within {timeout:g} s",
                       "unavailable_error") from None
    return expect(reply, Answer)
