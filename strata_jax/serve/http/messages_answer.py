"""The chat route's answer as Anthropic's Message: content blocks (thinking, text, tool_use), its
stop_reason and usage, and Anthropic's error shape.

    {"id": "msg_...", "type": "message", "role": "assistant", "model",
     "content": [{"type": "thinking", "thinking", "signature": ""}, {"type": "text", "text"},
                 {"type": "tool_use", "id": "toolu_...", "name", "input"}],
     "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use", "stop_sequence",
     "usage": {"input_tokens", "output_tokens", "cache_read_input_tokens",
               "cache_creation_input_tokens": 0}}      (input + cache_read: the prompt's tokens)

The stop string that ended an answer is the engine's (its final event's stats, `stopping_word`),
which generate.py hands to the request's on_done hook: messages.py keeps it (Stops) for this.
"""

from __future__ import annotations

import json
from typing import Any

# HTTP status -> Anthropic's error type (its documented ones)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
               501: "invalid_request_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def message_id(job_id: str) -> str:
    """The chat job's id (chatcmpl-HEX) as a message id."""
    return "msg_" + job_id.rsplit("-", 1)[-1]


def tool_use_id(call_id: str | None) -> str:
    """The engine's call id, as Anthropic's clients expect one to look (toolu_...)."""
    call_id = call_id or "call"
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id


def stop_reason(finish_reason: str | None, stopping_word: str) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat's finish_reason and the stop string that ended
    the answer (the engine's, "" when none did)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stopping_word:
        return "stop_sequence", stopping_word
    return "end_turn", None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage from the chat's. As Anthropic counts, input_tokens are the prompt tokens
    read now and cache_read_input_tokens those the prefix cache held (the prompt is their sum);
    nothing is written to a cache on request, so cache_creation_input_tokens is 0."""
    chat_usage = chat_usage or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out: dict[str, Any] = {"input_tokens": chat_usage.get("prompt_tokens", 0) - cached,
                           "output_tokens": chat_usage.get("completion_tokens", 0),
                           "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
    thinking = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if thinking is not None:
        out["output_tokens_details"] = {"thinking_tokens": thinking}
    return out


def message(body: dict[str, Any], stopping_word: str) -> dict[str, Any]:
    """A chat.completion (generate.whole) as an Anthropic Message."""
    choice = body["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": tool_use_id(call.get("id")),
                        "name": call["function"]["name"],
                        "input": tool_input(call["function"].get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), stopping_word)
    return {"id": message_id(body["id"]), "type": "message", "role": "assistant",
            "model": body["model"], "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(body.get("usage"))}


def tool_input(arguments: Any) -> dict[str, Any]:
    """A call's arguments (a JSON object as text: the tool parser keeps no other) as an object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
