"""llama-server's `/cors-proxy?url=...` (its --ui-mcp-proxy): a browser page on this server reaches another
server (an MCP server, for llama.cpp's web UI) through it, without that server's CORS headers.

Off by default: then GET and POST answer 403, as llama-server's. On, it is a request made on the caller's
behalf to any http(s) URL the caller names (the server's own network, too): so it sits behind the API key like
every API route, and it forwards only what the caller marks for the target: headers named
`x-llama-server-proxy-header-NAME` go as `NAME`; the caller's own `Authorization`, `X-Api-Key`, cookies and
proxy credentials never leave. The target's status, content type and body come back as they are.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
from litestar import Request, Response, route

from .errors import ApiError

PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600.0              # llama-server's read and write timeouts


def handlers(enabled: bool) -> list:
    @route("/cors-proxy", http_method=["GET", "POST"])
    async def cors_proxy(request: Request) -> Response:
        if not enabled:
            raise ApiError(403, "the CORS proxy is off: start the server with --ui-mcp-proxy to enable it",
                           "permission_error")
        url = request.query_params.get("url", "")
        target = urlsplit(url)
        if target.scheme not in ("http", "https"):
            raise ApiError(400, f"url = {url!r}: the CORS proxy reaches http:// and https:// URLs only",
                           "invalid_request_error", "url")
        if not target.hostname:
            raise ApiError(400, f"url = {url!r}: the target URL has no host", "invalid_request_error", "url")
        if target.password is not None or target.username is not None:
            raise ApiError(400, "url: credentials in the target URL are not supported", "invalid_request_error", "url")
        headers = {k[len(PREFIX):]: v for k, v in request.headers.items() if k.lower().startswith(PREFIX) and
                   len(k) > len(PREFIX)}
        body = await request.body() if request.method == "POST" else None
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False) as client:
                got = await client.request(request.method, url, headers=headers, content=body)
        except httpx.HTTPError as e:
            raise ApiError(502, f"the CORS proxy could not reach {target.scheme}://{target.netloc}: "
                                f"{type(e).__name__}", "server_error") from None
        return Response(got.content, status_code=got.status_code,
                        media_type=got.headers.get("content-type", "application/octet-stream"))

    return [cors_proxy]
