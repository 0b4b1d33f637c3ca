"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} (issue 38).

A Responses body becomes the chat-completions body it asks for (responses_request.py), which runs as
a chat request does (parse_chat, generate.start, then generate.whole or generate.chunks); the chat
answer becomes a response object (responses_output.py) or the `response.*` events
(responses_stream.py). A response is kept (`store`, default true) with the messages it came from
(responses_store.py), so `previous_response_id` continues its conversation: the same messages render
the same prompt prefix, and the engine's prefix cache reuses it. Requests count in the metrics under
the endpoint "responses".
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.response import Stream

from ..errors import ApiError, invalid
from . import generate
from .fields import json_object
from .responses_items import output_messages, shown
from .responses_output import new_id, output_items, response_object, status_of, usage
from .responses_request import Asked, translate
from .responses_store import ResponseStore
from .responses_stream import EventStream
from .routes import RouteContext

JSON = "application/json"
ENDPOINT = "responses"
# chat's field names in errors parse_chat and generate.start raise -> the Responses field
RENAMED = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"))


def handlers(routes: RouteContext) -> list:
    store = ResponseStore(routes.cfg.responses_max, routes.cfg.responses_max_mib << 20)
    done = routes.done

    def rejected() -> None:
        routes.metrics.requests.labels(ENDPOINT, "rejected").inc()

    @post("/v1/responses", status_code=200, guards=[routes.json_body])
    async def create(request: Request) -> Response:
        try:
            asked, job = _job(routes, store, await request.body())
            job.route = ENDPOINT
            routes.served_as(job)
            job.include_usage = True
            prepared, ticket = await generate.start(routes.sup, job)
        except ApiError as e:
            rejected()
            raise _renamed(e) from None
        rid = new_id("resp")
        if asked.stream:
            return Stream(_events(routes, store, asked, job, prepared, ticket, rid, done),
                          media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(routes.watch(request, ticket))
        try:
            chat = await generate.whole(routes.sup, job, prepared, ticket, done)
        finally:
            watcher.cancel()
        choice = chat["choices"][0]
        status = status_of(choice["finish_reason"])
        out = response_object(rid, job.model, asked.echo, status,
                              output_items(choice["message"], choice["finish_reason"]),
                              usage(chat.get("usage")), created=job.created)
        _keep(store, asked, out)
        return Response(out, media_type=JSON)

    @get("/v1/responses/{response_id:str}")
    async def fetch(response_id: str) -> dict[str, Any]:
        return _stored(store, response_id, "response_id").response

    @delete("/v1/responses/{response_id:str}", status_code=200)
    async def remove(response_id: str) -> dict[str, Any]:
        _stored(store, response_id, "response_id")
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return [create, fetch, remove]


def _job(routes: RouteContext, store: ResponseStore, body: bytes):
    """The body -> (what it asks, the chat job); 400 / 404 naming the field."""
    if not body.strip():
        raise invalid("the request body is empty: send a JSON object")
    given = json_object(body)
    previous = given.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise invalid(f"previous_response_id = {shown(previous)}: a response's id (a string)",
                          "previous_response_id")
        history = _stored(store, previous, "previous_response_id").messages
    asked = translate(given, history)
    job = routes.parse_chat(msgspec.json.encode(asked.chat), routes.names)
    sup = routes.sup
    if sup.info and not sup.info.get("chat_template", True):
        raise invalid("this model has no chat template (tokenizer.chat_template is not in its "
                      "GGUF), so it cannot format a conversation: send plain text to "
                      "/v1/completions instead", "input")
    return asked, job


def _stored(store: ResponseStore, response_id: str, param: str):
    entry = store.get(response_id)
    if entry is None:
        code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
        raise ApiError(404, f"{param} = {shown(response_id)}: no stored response has this id "
                            f"(never stored, deleted, or evicted: {store.bounds()})",
                       "invalid_request_error", param, code=code)
    return entry


def _keep(store: ResponseStore, asked: Asked, response: dict[str, Any]) -> None:
    if asked.store:
        store.put(response, asked.conversation + output_messages(response["output"]))


def _renamed(e: ApiError) -> ApiError:
    """An error of the chat request this one became, naming the Responses field: a message index
    is not an input index (history and instructions come first), so a message's error names
    `input`."""
    if e.param is not None and e.param.startswith("messages"):
        e.param = "input"
    for chat, ours in RENAMED:
        if e.param is not None and e.param.startswith(chat):
            e.param = ours + e.param[len(chat):]
        e.message = e.message.replace(chat, ours)
    return e


async def _events(routes: RouteContext, store: ResponseStore, asked: Asked, job, prepared, ticket,
                  rid: str, done):
    """The SSE bytes: `event: response.X` and `data: {...}` each. Closing the chunks (the client
    went away: Litestar closes this generator) cancels the request."""
    stream = EventStream(rid, job.model, asked.echo)
    chunks = generate.chunks(routes.sup, job, prepared, ticket, done)
    async with aclosing(chunks), aclosing(stream.events(chunks)) as events:
        async for event in events:
            if event["type"] in ("response.completed", "response.incomplete"):
                _keep(store, asked, stream.final)     # kept before a client can leave
            yield (f"event: {event['type']}\n".encode() + b"data: "
                   + msgspec.json.encode(event) + b"\n\n")
