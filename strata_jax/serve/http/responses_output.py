"""The response object of OpenAI's Responses API (the openai SDK's `Response` model), made from a
chat answer: its output items (reasoning, the message, function calls), status and usage.

A chat answer cut at max_tokens (finish_reason "length") is an `incomplete` response with
`incomplete_details: {"reason": "max_output_tokens"}`, and its last item is `incomplete` too; an
engine error is a `failed` one (streams only: a whole answer is an HTTP error, as chat's is).
"""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat: dict[str, Any] | None) -> dict[str, Any]:
    """Chat's usage -> Responses'; reasoning_tokens where the chat usage counts them, else 0."""
    chat = chat or {}
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    prompt, completion = chat.get("prompt_tokens", 0), chat.get("completion_tokens", 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """A chat answer's message -> output items: reasoning (when the model reasoned), the message
    (when it wrote text, or made no call), then a function_call item a call."""
    items = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or ""))
    for call in calls:
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"],
                               call["function"]["arguments"]))
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def response_object(response_id: str, model: str, echo: dict[str, Any], status: str,
                    output: list[dict[str, Any]], used: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None,
                    created: int | None = None) -> dict[str, Any]:
    """The whole response object; `echo`: the request's fields it repeats
    (responses_request.Asked.echo)."""
    created = created if created is not None else int(time.time())
    return {"id": response_id, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": model, "output": output, "usage": used, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
                                  else None,
            **echo}
