"""Which replica a request goes to (`serve --replicas N`): pure functions, no Ray, so they are
tested alone.

A conversation's key is the part of its request that stays the same from turn to turn: the messages
up to and including the first user message (a chat grows by appending), or the start of a prompt.
The same key always ranks the replicas in the same order (rendezvous hashing: sha256 of key +
replica name, highest first), so a conversation keeps reaching the replica whose prefix cache holds
it; when that replica is down the next one in its order takes it, and only the down replica's
conversations move (a modulo hash would move most of them).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import error_body

# A client may name its conversation itself (e.g. an agent whose first message changes between
# sessions).
CONVERSATION_HEADER = "x-strata-conversation"
# Every answer says which replica gave it (so a client, a load test or a test can see the spread).
REPLICA_HEADER = "x-strata-replica"
# a prompt's first characters are its key: past that, two prompts are two conversations
PROMPT_KEY_CHARS = 512
# The routes a replica's server answers without the API key (app.py's /health, webui.py's page): the
# ingress passes them without it too; every other route needs the key before the ingress reads a
# byte of the body.
PUBLIC_GETS = frozenset({"/health", "/v1/health", "/", "/sw.js", "/manifest.webmanifest",
                         "/_app/version.json"})
# Hop-by-hop headers, and those the next hop sets itself from the body it sends.
_NOT_FORWARDED = frozenset({"host", "content-length", "connection", "keep-alive",
                            "transfer-encoding", "upgrade", "proxy-connection", "te", "trailer"})


class BodyError(ValueError):
    """A body the ingress refuses itself (400): the message names the problem."""


def authorized(headers: Mapping[str, str], key: str | None) -> bool:
    """The server's own check (app.py): 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'; no key:
    everyone."""
    if key is None:
        return True
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        given = headers.get("x-api-key", "")
    return secrets.compare_digest(given.strip().encode(), key.encode())


def conversation_key(body: bytes, headers: Mapping[str, str] | None = None) -> str | None:
    """The request's conversation key, or None (no conversation: GET routes, bodies that are not
    JSON). BodyError: JSON nested past Python's recursion limit (its parser raises
    RecursionError)."""
    try:
        return _conversation_key(body, headers)
    except RecursionError:
        raise BodyError("the JSON body is nested too deeply to read") from None


def _conversation_key(body: bytes, headers: Mapping[str, str] | None) -> str | None:
    if headers is not None and headers.get(CONVERSATION_HEADER):
        return "h:" + headers[CONVERSATION_HEADER]
    if not body:
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    model = req.get("model") if isinstance(req.get("model"), str) else ""
    messages = req.get("messages")
    if isinstance(messages, list) and messages:
        head = []
        for m in messages:
            head.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        return ("m:" + model + "\0"
                + json.dumps(head, sort_keys=True, separators=(",", ":"), default=str))
    # /v1/completions, embeddings, llama.cpp's /completion
    for field in ("prompt", "input", "content"):
        value = req.get(field)
        # a batch of prompts, or token ids: the first one's start
        while isinstance(value, list) and value:
            value = (value[0] if isinstance(value[0], (str, list))
                     else json.dumps(value[:PROMPT_KEY_CHARS]))
        if isinstance(value, str) and value:
            return "p:" + model + "\0" + value[:PROMPT_KEY_CHARS]
    return None


def rank(key: str | None, names: Sequence[str], turn: int = 0) -> list[str]:
    """The replicas in the order a request tries them: by rendezvous hash of `key`; with no key, a
    rotation starting at `turn` (round robin: requests without a conversation spread evenly)."""
    if key is None:
        k = turn % len(names) if names else 0
        return list(names[k:]) + list(names[:k])
    return sorted(names, key=lambda n: hashlib.sha256(f"{key}\0{n}".encode()).digest(),
                  reverse=True)


def healthy_first(order: Sequence[str], healthy: Mapping[str, bool]) -> list[str]:
    """The replicas believed healthy first, in `order`; those believed down after them, as a last
    resort (the belief is up to a poll old, and trying a down replica costs only the time it takes
    to not accept)."""
    return ([n for n in order if healthy.get(n, True)]
            + [n for n in order if not healthy.get(n, True)])


def forward_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _NOT_FORWARDED]


def answer_headers(headers: Iterable[tuple[str, str]], replica: str) -> dict[str, str]:
    out = {k: v for k, v in headers if k.lower() not in _NOT_FORWARDED}
    out[REPLICA_HEADER] = replica
    return out


def replica_error(replica: str | None, message: str, status: int = 503) -> dict[str, Any]:
    """OpenAI's error shape, naming the replica (None: no replica took the request)."""
    extra = {"replica": replica} if replica else {}
    return error_body(status, message, **extra)


def sse_error(replica: str, message: str) -> bytes:
    """How a stream whose replica failed ends: an error event then [DONE], as the server ends a
    stream whose engine failed (the openai client raises APIError on it)."""
    return (b"data: " + json.dumps(replica_error(replica, message)).encode()
            + b"\n\ndata: [DONE]\n\n")
