"""The load tests' client for Anthropic's Messages API (`POST /v1/messages`, streamed): a chat body
as the replay builds it (OpenAI's shape: messages with tool_calls and `role: tool` results, tools,
tool_choice) sent as Claude Code would send it, and the stream measured into the same `Result` as
`stream_chat`'s, so every report reads the same figures on either API.

Anthropic's usage counts the prompt in two parts: `input_tokens` read now and
`cache_read_input_tokens` served from a cache (here the prefix cache): they are Result's prompt_n
and cache_n, and their sum its prompt_tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from _loadtest import Result, _fill_figures, error_message

STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                "tool_use": "tool_calls"}


def messages_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat-completions body -> the Messages body that asks the same."""
    system = [m["content"] for m in chat["messages"] if m["role"] in ("system", "developer")]
    # Anthropic's API requires a model: the server serves its one model under any name unless
    # started with --strict-model-name (then give the replay --model NAME)
    body: dict[str, Any] = {"model": chat.get("model") or "default",
                            "messages": _messages(chat["messages"]),
                            "max_tokens": chat.get("max_tokens") or 256, "stream": True}
    if system:
        body["system"] = "\n\n".join(system)
    for key in ("temperature", "top_p", "top_k"):
        if chat.get(key) is not None:
            body[key] = chat[key]
    if chat.get("tools"):
        body["tools"] = [{"name": t["function"]["name"],
                          "description": t["function"].get("description", ""),
                          "input_schema": t["function"].get("parameters") or {"type": "object"}}
                         for t in chat["tools"]]
        choice = chat.get("tool_choice", "auto")
        body["tool_choice"] = ({"type": "auto"} if choice == "auto" else {"type": "none"}
                               if choice == "none" else {"type": "any"} if choice == "required"
                               else {"type": "tool", "name": choice["function"]["name"]})
    return body


def _messages(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's turns -> Anthropic's: tool results are user turns of tool_result blocks, calls are
    the assistant's tool_use blocks; consecutive turns of one role are merged, as the API wants
    them alternating."""
    out: list[dict[str, Any]] = []
    for m in chat:
        if m["role"] in ("system", "developer"):
            continue
        if m["role"] == "tool":
            role, blocks = "user", [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                     "content": m.get("content") or ""}]
        else:
            role = m["role"]
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            for call in m.get("tool_calls") or ():
                try:
                    args = json.loads(call["function"]["arguments"] or "{}")
                except ValueError:
                    args = {}
                blocks.append({"type": "tool_use", "id": call["id"],
                               "name": call["function"]["name"],
                               "input": args if isinstance(args, dict) else {}})
        if not blocks:
            blocks = [{"type": "text", "text": "(empty)"}]
        if out and out[-1]["role"] == role:
            out[-1]["content"] += blocks
        else:
            out.append({"role": role, "content": blocks})
    return out


async def stream_messages(client: httpx.AsyncClient, url: str, chat: dict[str, Any],
                          timeout: float, t0: float,
                          headers: dict[str, str] | None = None) -> Result:
    """POST a streamed Messages request built from a chat body and measure it, as stream_chat does
    (never raises for what the server or the network does: every failure is `error`). Its
    tool_use blocks come back as OpenAI tool_calls, so the replay's agents run them the same
    way."""
    r = Result(sent_s=time.monotonic() - t0)
    start = time.monotonic()
    first = last = None
    usage: dict[str, Any] = {}
    stopped = False
    pieces: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url.rstrip("/") + "/v1/messages",
                                     json=messages_body(chat),
                                     headers={**(headers or {}),
                                              "anthropic-version": "2023-06-01"}) as resp:
                r.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    r.error = f"HTTP {resp.status_code}: {error_message(text)}"
                    stopped = True
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        ev = json.loads(line[5:].strip())
                        kind = ev.get("type")
                        if kind == "error":
                            r.error = str((ev.get("error") or {}).get("message") or ev)
                        elif kind == "message_start":
                            usage.update(ev["message"].get("usage") or {})
                        elif kind == "content_block_start":
                            block = ev["content_block"]
                            if block.get("type") == "tool_use":
                                r.tool_calls.append({"id": block["id"], "type": "function",
                                                     "function": {"name": block["name"],
                                                                  "arguments": ""}})
                        elif kind == "content_block_delta":
                            d = ev["delta"]
                            now = time.monotonic()
                            if last is not None:
                                r.itl_s.append(now - last)
                            first, last = first or now, now
                            r.chunks += 1
                            if d.get("type") == "text_delta":
                                pieces.append(d["text"])
                            elif d.get("type") == "input_json_delta" and r.tool_calls:
                                r.tool_calls[-1]["function"]["arguments"] += d["partial_json"]
                        elif kind == "message_delta":
                            usage.update(ev.get("usage") or {})
                            reason = (ev.get("delta") or {}).get("stop_reason")
                            r.finish_reason = STOP_REASONS.get(reason, reason)
                        elif kind == "message_stop":
                            stopped = True
                            break
    except TimeoutError:
        r.error = f"no complete answer within the client timeout ({timeout:g} s)"
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except (ValueError, KeyError, TypeError) as e:   # an event that is not what Anthropic sends
        r.error = f"unreadable stream: {type(e).__name__}: {e}"
    r.latency_s = time.monotonic() - start
    r.ttft_s = first - start if first else None
    r.text = "".join(pieces)
    if r.error is None and not stopped:
        r.error = "the stream ended without message_stop"
    elif r.error is None and r.finish_reason is None:
        r.error = "the stream ended without a stop_reason"
    r.ok = r.error is None
    read, cached = usage.get("input_tokens"), usage.get("cache_read_input_tokens") or 0
    prompt = None if read is None else read + cached
    _fill_figures(r, {"prompt_tokens": prompt, "completion_tokens": usage.get("output_tokens")},
                  {"prompt_n": read, "cache_n": cached}, first, last)
    return r
