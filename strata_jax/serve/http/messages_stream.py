"""A streamed chat answer (generate.chunks' chat.completion.chunk dicts) as Anthropic's events, each
`event: NAME\\ndata: JSON\\n\\n`:

    message_start {message: content [], usage.input_tokens: the prompt's tokens}
    ping
    content_block_start {index, content_block: thinking | text | tool_use with input {}}
    content_block_delta {index, delta: thinking_delta | text_delta | input_json_delta}
    content_block_stop {index}
    ... a block a part of the answer, in the order the model writes them
    message_delta {delta: {stop_reason, stop_sequence}, usage: the final counts}
    message_stop

A block opens when the answer turns to another kind (reasoning, text, a call: the chunk's
reasoning_content, content or tool_calls), and closes before the next opens. An engine error
mid-answer ends the stream with `event: error` and Anthropic's error body (the SDK raises it).
A thinking block's signature is "" from its start (the SDK's accumulator needs no signature_delta).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .messages_answer import error_body, stop_reason, tool_use_id, usage

_json = msgspec.json.Encoder()


def sse(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode({"type": name, **obj}) + b"\n\n"


class Events:
    """One answer's events, fed the chat chunks in order."""

    def __init__(self, message_id: str, model: str, input_tokens: int):
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.index = -1                         # the block open now (its index), -1: none yet
        self.open: str | None = None            # its kind: thinking, text, tool_use
        self.calls: dict[int, int] = {}         # a call's index in the chat -> its block's
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def start(self) -> list[bytes]:
        message = {"id": self.message_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return [sse("message_start", {"message": message}), sse("ping", {})]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("text", delta["content"])
            for piece in delta.get("tool_calls") or ():
                out += self._call(piece)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                out += self._close()
        return out

    def end(self, stopping_word: str) -> list[bytes]:
        """message_delta and message_stop, once the answer has ended (its stop string known)."""
        reason, sequence = stop_reason(self.finish_reason, stopping_word)
        counts = usage(self.usage)
        return [*self._close(),
                sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": counts}),
                sse("message_stop", {})]

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        """The chat's error body ({"error": {"message", "code"}}) as Anthropic's error event."""
        err = body.get("error") or {}
        return sse("error", {"error": error_body(err.get("code", 500),
                                                 err.get("message", "error"))["error"]})

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = kind
        return [*out, sse("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"index": self.index})]

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = []
        if self.open != kind:
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            out = self._open(kind, block)
        key = "thinking" if kind == "thinking" else "text"
        out.append(sse("content_block_delta", {"index": self.index,
                                               "delta": {"type": f"{key}_delta", key: text}}))
        return out

    def _call(self, piece: dict[str, Any]) -> list[bytes]:
        """OpenAI's call pieces: the first (with id and name) opens a tool_use block, the rest are
        its input's JSON text."""
        out: list[bytes] = []
        fn = piece.get("function") or {}
        if piece.get("id") is not None:
            out = self._open("tool_use", {"type": "tool_use", "id": tool_use_id(piece["id"]),
                                          "name": fn.get("name", ""), "input": {}})
            self.calls[piece.get("index", 0)] = self.index
        args = fn.get("arguments")
        if args:
            index = self.calls.get(piece.get("index", 0), self.index)
            out.append(sse("content_block_delta", {
                "index": index, "delta": {"type": "input_json_delta", "partial_json": args}}))
        return out
