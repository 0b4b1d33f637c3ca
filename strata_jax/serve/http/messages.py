"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (issue 38).

    POST /v1/messages  {model, max_tokens, messages, system, tools, tool_choice, thinking,
                        stop_sequences, temperature, top_p, top_k, metadata, stream}
        -> a Message (messages_answer.py), or its events (messages_stream.py)
    POST /v1/messages/count_tokens  {the same, no max_tokens}  -> {"input_tokens": n}

A body is decoded and bounded as Anthropic's (messages_schema.py: a 400 names Anthropic's field),
translated into the chat body (messages_translate.py) and run as any chat is: parse_chat, then
generate.start and generate.whole or generate.chunks (http/routes.py), so templates, tools,
grammars, reasoning and the engine are the chat route's. Errors on these paths have Anthropic's
shape (app.py asks messages_answer.error_body). The API key is the server's (`x-api-key`, as
Anthropic's clients send it); `anthropic-version` and `anthropic-beta` are accepted and ignored.
Requests count under the endpoint "messages" in /metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

from ..errors import ApiError, invalid
from . import generate
from .generate import Job
from .messages_answer import message, message_id
from .messages_schema import decode
from .messages_stream import Events
from .messages_translate import chat_body
from .routes import RouteContext

ENDPOINT = "messages"
JSON = "application/json"
_json = msgspec.json.Encoder()


def handlers(routes: RouteContext) -> list:
    metrics = routes.metrics

    def job_of(body: bytes, count_only: bool = False) -> Job:
        """The chat job for an Anthropic body; a rejected one is counted, as the chat route's."""
        try:
            req = decode(body)
            if req.max_tokens is None and not count_only:
                raise invalid("max_tokens: field required (the most tokens to generate, thinking "
                              "included)", "max_tokens")
            job = routes.parse_chat(_json.encode(chat_body(req)), routes.names)
            if routes.sup.info and not routes.sup.info.get("chat_template", True):
                raise invalid("this model has no chat template (tokenizer.chat_template is not in "
                              "its GGUF), so it cannot format messages", "messages")
        except ApiError:
            metrics.requests.labels(ENDPOINT, "rejected").inc()
            raise
        job.include_usage, job.route = job.stream, ENDPOINT
        # Anthropic's clients ask a fixed max_tokens (Claude Code 32,000) whatever the context: it
        # is a ceiling here, cut to the room the prompt leaves (stop_reason max_tokens at the end)
        job.params.fit_max_tokens = True
        routes.served_as(job)
        return job

    @post("/v1/messages", status_code=200, guards=[routes.json_body])
    async def create(request: Request) -> Response:
        job = job_of(await request.body())
        ended = _Ended(routes)
        try:
            prepared, ticket = await generate.start(routes.sup, job)
        except ApiError:
            metrics.requests.labels(ENDPOINT, "rejected").inc()
            raise
        if job.stream:
            events = Events(message_id(job.id), job.model, len(prepared.ids))
            return Stream(_stream(routes, job, prepared, ticket, events, ended),
                          media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(routes.watch(request, ticket))
        try:
            body = await generate.whole(routes.sup, job, prepared, ticket, ended.done)
        finally:
            watcher.cancel()
        return Response(message(body, ended.stopping_word), media_type=JSON)

    @post("/v1/messages/count_tokens", status_code=200, guards=[routes.json_body])
    async def count_tokens(request: Request) -> dict[str, Any]:
        """The prompt tokens the same request would read, rendered and tokenized as it would be
        (tools and thinking included)."""
        job = job_of(await request.body(), count_only=True)
        prepared = await routes.sup.prepare(f"count-{job.id}", job.prompt, job.params,
                                            job.chat_template_kwargs, time.monotonic() + 30.0)
        return {"input_tokens": len(prepared.ids)}

    return [create, count_tokens]


async def _stream(routes: RouteContext, job: Job, prepared: Any, ticket: Any, events: Events,
                  ended: _Ended) -> AsyncIterator[bytes]:
    for b in events.start():
        yield b
    # closed when the client goes away, so its request is cancelled at once (chunks' finally)
    async with aclosing(generate.chunks(routes.sup, job, prepared, ticket, ended.done)) as each:
        async for chunk in each:
            if "error" in chunk:
                yield events.error(chunk)
                return
            for b in events.feed(chunk):
                yield b
    # the chunks have ended: the request's on_done has run and knows its stop string
    for b in events.end(ended.stopping_word):
        yield b


class _Ended:
    """A request's on_done hook: the server's own (metrics), and keeps the stop string that ended it
    (the engine's final stats), for stop_reason "stop_sequence"."""

    def __init__(self, routes: RouteContext):
        self.routes = routes
        self.stopping_word = ""

    def done(self, job: Job, ticket: Any, outcome: str, stats: dict | None,
             seconds: float) -> None:
        self.stopping_word = (stats or {}).get("stopping_word") or ""
        self.routes.done(job, ticket, outcome, stats, seconds)
