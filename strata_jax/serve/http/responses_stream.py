"""A streamed Responses answer: generate.chunks' chat chunks to OpenAI's `response.*` events, in the
order the openai SDK's stream accumulator (openai/lib/streaming/responses) expects them.

    response.created, response.in_progress
    a reasoning item:  output_item.added, content_part.added, reasoning_text.delta..., .done,
                       content_part.done, output_item.done
    the message:       output_item.added, content_part.added, output_text.delta..., .done,
                       content_part.done, output_item.done
    a function call:   output_item.added, function_call_arguments.delta..., .done, output_item.done
    response.completed (or response.incomplete at max_output_tokens; response.failed on an engine
    error)

Each event has its `type` and an increasing `sequence_number`, and names its item by output_index
and item_id. Text that is only white space (between calls) is held until more text comes, so it
opens no message item of its own: the whole answer strips it too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from .responses_output import (
    call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    status_of,
    text_part,
    usage,
)


class EventStream:
    """One streamed response: feed it the chat chunks; `final` is the response object at the
    end (for the store), None when it failed."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any]):
        self.id, self.model, self.echo = response_id, model, echo
        self.created = None
        self.output: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self._seq = 0
        self._open: dict[str, Any] | None = None       # the item being written
        self._calls: dict[int, dict[str, Any]] = {}    # a chat call index -> its item
        self._held = ""                                # white space not yet sent
        self._reason: str | None = None
        self._usage: dict[str, Any] | None = None

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        start = response_object(self.id, self.model, self.echo, "in_progress", [])
        self.created = start["created_at"]
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        async for chunk in chunks:
            if "error" in chunk:
                for event in self._close("incomplete"):
                    yield event
                error = {"code": "server_error", "message": chunk["error"].get("message", ""),
                         "type": chunk["error"].get("type")}
                yield self._event("response.failed", response=self._response("failed", error))
                return
            if chunk.get("usage") is not None:
                self._usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                for event in self._delta(choice.get("delta") or {}):
                    yield event
                self._reason = choice.get("finish_reason") or self._reason
        status = status_of(self._reason)
        end = []
        if not self._calls and not any(item["type"] == "message" for item in self.output):
            end += self._open_message()         # an answer with no call has a message, if empty
        if self._held and self._open is not None and self._open["type"] == "message":
            end += self._text("")
        for event in [*end, *self._close(status)]:
            yield event
        self.final = self._response(status)
        yield self._event(f"response.{status}", response=self.final)

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.id, self.model, self.echo, status, self.output,
                               usage(self._usage), error, created=self.created)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _where(self) -> dict[str, Any]:
        """The open item's place (it is always the last of the output)."""
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if delta.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                out += self._close("completed")
                out += self._add(reasoning_item(new_id("rs"), "", "in_progress"),
                                 {"type": "reasoning_text", "text": ""})
            self._open["content"][0]["text"] += delta["reasoning_content"]
            out.append(self._event("response.reasoning_text.delta", **self._where(),
                                   content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            out += self._text(delta["content"])
        for piece in delta.get("tool_calls") or ():
            out += self._call(piece)
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open is None or self._open["type"] != "message":
            if not (self._held + text).strip() and text:
                self._held += text
                return []
            out += self._open_message()
        text, self._held = self._held + text, ""
        if text:
            self._open["content"][0]["text"] += text
            out.append(self._event("response.output_text.delta", **self._where(),
                                   content_index=0, delta=text, logprobs=[]))
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        return [*self._close("completed"),
                *self._add(message_item(new_id("msg"), "", "in_progress"), text_part(""))]

    def _call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        index, args = piece.get("index", 0), (piece.get("function") or {}).get("arguments") or ""
        if index not in self._calls:
            self._held = ""
            out += self._close("completed")
            item = call_item(new_id("fc"), piece.get("id") or new_id("call"),
                             piece["function"]["name"], "", "in_progress")
            self._calls[index] = item
            out += self._add(item, None)
        if args:
            self._calls[index]["arguments"] += args
            out.append(self._event("response.function_call_arguments.delta", **self._where(),
                                   delta=args))
        return out

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        shown = {**item, "content": []} if part is not None else dict(item)
        out = [self._event("response.output_item.added", output_index=len(self.output) - 1,
                           item=shown)]
        if part is not None:
            out.append(self._event("response.content_part.added", **self._where(),
                                   content_index=0, part=dict(part)))
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's done events; `status` is its own (incomplete: the answer was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = self._where()
        item["status"] = status
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", **where,
                                   arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self._event(done, **where, content_index=0, text=part["text"], **extra))
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=dict(part)))
        out.append(self._event("response.output_item.done", output_index=where["output_index"],
                               item=item))
        return out
