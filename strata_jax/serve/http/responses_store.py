"""Stored responses (OpenAI's Responses API `store`, default true): what `previous_response_id`
continues and `GET /v1/responses/{id}` shows, kept in the server process's memory.

Each entry is the response object and the chat messages it was generated from plus its output as
messages, so the next turn's prompt renders as this one's did with the new input after it: the same
prompt prefix, which the engine's prefix cache then reuses. The store is bounded by count
(--responses-max) and by the bytes of the entries' JSON (--responses-max-mib), and evicts the least
recently used (a `previous_response_id` or GET counts as a use). An entry larger than the byte bound
alone is not kept (a warning in the log). One store a server process, owned by responses.py's
handlers; the event loop is its only thread, so it needs no lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

log = logging.getLogger("strata_jax.serve")


@dataclass
class Stored:
    response: dict[str, Any]                   # the response object, as POST answered it
    messages: list[dict[str, Any]]             # the conversation, its output included (chat shape)
    size: int                                  # bytes of both as JSON: what the byte bound counts


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep a response (the newest), evicting the least recently used beyond the bounds; False
        when it alone is larger than the byte bound (it is not kept)."""
        size = len(msgspec.json.encode([response, messages]))
        if size > self.max_bytes or self.max_count == 0:
            log.warning("response %s not stored: %d bytes, and the store keeps at most %d "
                        "responses / %d bytes (--responses-max, --responses-max-mib)",
                        response["id"], size, self.max_count, self.max_bytes)
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = Stored(response, messages, size)
        self.bytes += size
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        return True

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None

    def bounds(self) -> str:
        """The bounds as an error message says them."""
        return (f"the server keeps {self.max_count} responses / "
                f"{self.max_bytes / (1 << 20):g} MiB (--responses-max, --responses-max-mib)")
