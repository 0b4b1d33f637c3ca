"""What a generation route needs of the server (app.py makes one for all of them): the supervisor,
the model's names, the chat parser with the server's defaults, and the two hooks every job passes
through (`served_as` before it starts, `done` when it ends). The Anthropic Messages route
(messages.py) and the OpenAI Responses route (responses.py) translate their bodies into a chat
job with `parse_chat` and their answers from generate.py's chunks, so every route runs a request
the same way: generate.start, then generate.chunks or generate.whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RouteContext:
    sup: Any                                   # the Supervisor
    cfg: Any                                   # the ServerConfig
    names: Any                                 # generate.ModelNames
    metrics: Any                               # http/metrics.Metrics
    json_body: Callable                        # the guard: a POST body is JSON (415 otherwise)
    # (body bytes, names) -> Job: generate.parse_chat with the server's defaults
    parse_chat: Callable
    served_as: Callable                        # (job) -> None: the server's flags on a job
    done: Callable                             # generate.start's on_done: metrics and latency
    # (request, *tickets) -> coroutine: cancels the tickets when the client goes away
    watch: Callable
