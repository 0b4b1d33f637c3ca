"""CORS as llama.cpp's server does it, around every route (and a 404): a browser page may call the
API. Every answer's header names are written as llama.cpp writes them (`canonical`).

    --cors-origins "*"            (default) any origin: the request's Origin is echoed, with
                                  credentials
    --cors-origins localhost      only pages on localhost / 127.0.0.1 / [::1], any port
    --cors-origins A,B            only these origins (each compared whole: scheme, host and port)

A preflight (OPTIONS) is answered here, 200 and empty, before routing and before the API key is
asked for (a browser sends no Authorization header in a preflight); an origin that is not allowed
gets no Access-Control-Allow-Origin header, so the browser refuses the page its answer. /cors-proxy
(cors_proxy.py) gets no allowance for any origin: it reaches the server's network, and only the
server's own pages may use it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

METHODS = b"GET, POST, DELETE, OPTIONS"
# routes no other origin may read, whatever --cors-origins says
NO_ALLOWANCE = ("/cors-proxy",)


def allowed(origins: str, origin: str) -> bool:
    if not origin:
        return False
    if origins.strip() == "*":
        return True
    if origins.strip() == "localhost":
        try:
            host = urlsplit(origin).hostname
        except ValueError:
            return False
        return host in ("localhost", "127.0.0.1", "::1")
    return origin.rstrip("/") in {o.strip().rstrip("/") for o in origins.split(",") if o.strip()}


def canonical(headers: list) -> list:
    """Header names as llama.cpp's server writes them (`Access-Control-Allow-Origin`,
    `Content-Type`): names are case-insensitive in HTTP/1.1, but clients that copy the headers into
    a plain dict (llama.cpp's own tests do) look them up in that case."""
    return [(b"-".join(w[:1].upper() + w[1:] for w in bytes(k).lower().split(b"-")), v)
            for k, v in headers]


def wrap(app: Any, origins: str) -> Any:
    """The ASGI app with CORS headers on its answers and preflights answered."""

    async def cors(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers") or ()}
        origin = headers.get(b"origin", b"").decode("latin-1")
        extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")] \
            if allowed(origins, origin) and scope.get("path",
                                                      "").rstrip("/") not in NO_ALLOWANCE else []
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 200, "headers": canonical(extra + [
                (b"access-control-allow-credentials", b"true"),
                (b"access-control-allow-methods", METHODS),
                (b"access-control-allow-headers", b"*"), (b"access-control-max-age", b"600"),
                (b"content-type", b"text/html"), (b"content-length", b"0")])})
            await send({"type": "http.response.body", "body": b""})
            return None

        async def with_headers(message):
            if message["type"] == "http.response.start":
                more = [*extra, (b"access-control-allow-credentials", b"true")] if extra else []
                message = {**message, "headers": canonical([*message.get("headers", ()), *more])}
            await send(message)

        return await app(scope, receive, with_headers)

    return cors
