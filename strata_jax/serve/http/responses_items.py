"""A Responses request's `input` (a string, or a list of items) to chat messages, and a response's
output items back to the chat message they stand for.

Items read: messages (`{"role", "content"}`, `"type": "message"` optional; content a string or
`input_text` / `output_text` parts), `function_call` (consecutive calls, and a call right after an
assistant message, are one assistant message's tool_calls, as the model wrote them),
`function_call_output` (a tool message) and `reasoning` (the next assistant message's
reasoning_content; dropped when no assistant message follows). Anything else (images, files, item
references, hosted tools' calls) is a 400 naming the item and its type: this server reads text.
The output's messages are made by the same rules (`output_messages`), so a conversation continued
by `previous_response_id` renders as one whose client sent the output items back.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import invalid

MAX_INPUT_ITEMS = 2048            # items a request's `input` may hold
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_SHOWN = 60


def shown(value: Any) -> str:
    """A bad value as an error message shows it: JSON, cut short."""
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, ValueError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def input_messages(given: Any, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` -> chat messages (the new turn's, to follow `history`: a previous response's
    conversation, whose tool calls a function_call_output may answer)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise invalid(f"input = {shown(given)}: a string, or a list of items (messages, "
                      "function_call, function_call_output)", "input")
    if not given:
        raise invalid("input is an empty list: send at least one item (or a string)", "input")
    if len(given) > MAX_INPUT_ITEMS:
        raise invalid(f"input holds {len(given)} items; at most {MAX_INPUT_ITEMS}", "input")
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} = {shown(item)}: an item is an object", where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning_text(item, where)
            continue
        if kind == "message":
            message = _message(item, where)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"] = reasoning
            out.append(message)
        elif kind == "function_call":
            call = _call(item, where)
            calls.add(call["id"])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
                out.append(message)
        elif kind == "function_call_output":
            out.append(_call_output(item, where, calls))
        else:
            raise invalid(f"{where}.type = {shown(kind)}: this server reads message, "
                          "function_call, function_call_output and reasoning items (text only: no "
                          "images, files, item references or hosted tools)", f"{where}.type")
        reasoning = None
    if not out:
        raise invalid("input holds no message or call (only reasoning items)", "input")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role = {shown(role)}: one of {', '.join(ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}] is a {shown(kind)} part: this server reads "
                              "text parts only ({\"type\": \"input_text\", \"text\": ...}, or "
                              "output_text)", f"{where}.content[{j}]")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise invalid(f"{where}.content = {shown(content)}: a string or a list of input_text "
                      "parts", f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise invalid(f"{where}.{key} = {shown(item.get(key))}: a function_call item has "
                          "call_id, name and arguments (a JSON text), each a string",
                          f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(item: dict[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.call_id = {shown(call_id)}: a function_call_output names the call "
                      "it answers by its call_id (a string)", f"{where}.call_id")
    if call_id not in calls:
        raise invalid(f"{where}.call_id = {shown(call_id)}: no function_call with this call_id "
                      "comes before it (in input, or in the previous response)", f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        texts = [p.get("text") for p in output if isinstance(p, dict)]
        if len(texts) != len(output) or not all(isinstance(t, str) for t in texts):
            raise invalid(f"{where}.output: a string or a list of input_text parts",
                          f"{where}.output")
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise invalid(f"{where}.output = {shown(output)}: the call's result as a string",
                      f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(item: dict[str, Any], where: str) -> str | None:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise invalid(f"{where}.content: a reasoning item's content is a list of reasoning_text "
                      "parts", f"{where}.content")
    texts = [p.get("text") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(texts) if texts else None


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items -> the assistant message they stand for (what a later turn renders
    as this one's answer), as `input_messages` reads them back."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "message":
            message["content"] = "".join(p["text"] for p in item["content"])
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    if message["content"] is None and not message.get("tool_calls"):
        message["content"] = ""
    return [message]
