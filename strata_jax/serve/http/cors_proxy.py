"""llama-server's `/cors-proxy?url=...` (its --ui-mcp-proxy): a browser page on this server reaches
another server (an MCP server, for llama.cpp's web UI) through it, without that server's CORS
headers.

Off by default: then GET and POST answer 403, as llama-server's. On, it is a request made on the
caller's behalf to any http(s) URL the caller names (the server's own network, too), so:

- it serves the server's own pages only: a request a browser marks as another site's (an Origin that
  is not this server's, `Origin: null`, `Sec-Fetch-Site: cross-site` or `same-site`) is a 403, and
  serve/http/cors.py gives this route no CORS allowance, so no other site's page can read the
  loopback or the LAN through it. A caller that is not a browser (no Origin, no Sec-Fetch-Site) is
  served; the API key applies as on every API route.
- it forwards only what the caller marks for the target: headers named
  `x-llama-server-proxy-header-NAME` go as `NAME`; the caller's own `Authorization`, `X-Api-Key`,
  cookies and proxy credentials never leave.
- the target's body is streamed, never held whole: one that declares more than
  --cors-proxy-max-bytes is a 502 before any of it is read; one that turns out longer is cut there
  (the connection ends without the body's end, so the client sees an error, and the log says why).
- the target's active content never runs on this origin (where the web UI keeps its key): only the
  types an MCP client reads (JSON, event streams, plain text, bytes) keep their Content-Type; any
  other text (HTML, SVG, XML, scripts) comes back as text/plain, anything else as an attachment;
  every answer carries nosniff and a sandboxing Content-Security-Policy.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from litestar import Request, route
from litestar.response import Stream

from ..errors import ApiError

log = logging.getLogger("strata_jax.serve")

PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600.0              # llama-server's read and write timeouts
PATH = "/cors-proxy"
MAX_BYTES = 16 << 20           # ServerConfig.cors_proxy_max_bytes' default (--cors-proxy-max-bytes)
# Content types passed on as they are: what an MCP client reads, none of which a browser runs.
PASSED = {"application/json", "text/event-stream", "text/plain", "application/octet-stream",
          "application/x-ndjson"}
SAFETY = {"x-content-type-options": "nosniff",
          "content-security-policy": "sandbox; default-src 'none'; frame-ancestors 'none'"}


class CutOff(Exception):
    """A target's body went past the byte cap mid-stream: raised to end the connection without the
    body's end."""


def handlers(enabled: bool, max_bytes: int = MAX_BYTES) -> list:
    @route(PATH, http_method=["GET", "POST"])
    async def cors_proxy(request: Request) -> Stream:
        if not enabled:
            raise ApiError(403, "the CORS proxy is off: start the server with --ui-mcp-proxy to "
                                "enable it",
                           "permission_error")
        why = cross_site(request.headers)
        if why:
            raise ApiError(403, "the CORS proxy serves this server's own pages only, and this "
                                f"request is cross-site ({why}): another site's page may not reach "
                                "this machine's network through it",
                           "permission_error")
        url = request.query_params.get("url", "")
        target = _target(url)
        # a compressed body would be passed on as it came anyway
        headers = {"accept-encoding": "identity"}
        headers.update({k[len(PREFIX):]: v for k, v in request.headers.items()
                                         if k.lower().startswith(PREFIX) and
                        len(k) > len(PREFIX)})
        body = await request.body() if request.method == "POST" else None
        client = httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False)
        try:
            got = await client.send(client.build_request(request.method, url, headers=headers,
                                                         content=body),
                                    stream=True)
        except httpx.HTTPError as e:
            await client.aclose()
            raise ApiError(502, f"the CORS proxy could not reach {target.scheme}://{target.netloc}"
                                f": {type(e).__name__}", "server_error") from None
        declared = got.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            await got.aclose()
            await client.aclose()
            raise ApiError(502, f"the target's answer is {int(declared)} bytes, over the CORS "
                                f"proxy's limit of {max_bytes} bytes (--cors-proxy-max-bytes)",
                                "server_error")
        out = {**SAFETY,
               **_content_type(got.headers.get("content-type", "application/octet-stream"))}
        if got.headers.get("content-encoding", "identity").lower() != "identity":
            out["content-encoding"] = got.headers["content-encoding"]
        return Stream(_body(got, client, max_bytes, target.netloc), status_code=got.status_code,
                      media_type=out.pop("content-type"), headers=out)

    return [cors_proxy]


def quiet(app: Any) -> Any:
    """The ASGI app, with a body cut at the cap (CutOff, logged where it happened) ending its
    connection without the traceback Litestar and uvicorn would print for an exception after the
    answer started."""

    async def app_quietly(scope, receive, send):
        try:
            return await app(scope, receive, send)
        except Exception as e:
            if scope.get("path", "").rstrip("/") != PATH or not _caused_by_cut(e):
                raise
            return None

    return app_quietly


def _caused_by_cut(e: BaseException | None, depth: int = 0) -> bool:
    if e is None or depth > 8:
        return False
    if isinstance(e, CutOff):
        return True
    inner = e.exceptions if isinstance(e, BaseExceptionGroup) else ()
    return any(_caused_by_cut(x, depth + 1) for x in (e.__cause__, e.__context__, *inner))


def cross_site(headers) -> str | None:
    """Why a browser marks this request as another site's (None: it does not, or it is not a
    browser's)."""
    site = (headers.get("sec-fetch-site") or "").strip().lower()
    # same-site: another port or subdomain, another origin still
    if site in ("cross-site", "same-site"):
        return f"Sec-Fetch-Site: {site}"
    origin = headers.get("origin")
    if origin is None:
        return None
    try:
        netloc = urlsplit(origin.strip()).netloc.lower()
    except ValueError:
        netloc = ""
    if not netloc or netloc != (headers.get("host") or "").strip().lower():
        return f"Origin: {origin[:100]}"
    return None


def _target(url: str):
    target = urlsplit(url)
    if target.scheme not in ("http", "https"):
        raise ApiError(400, f"url = {url!r}: the CORS proxy reaches http:// and https:// URLs only",
                       "invalid_request_error", "url")
    if not target.hostname:
        raise ApiError(400, f"url = {url!r}: the target URL has no host",
                       "invalid_request_error", "url")
    if target.password is not None or target.username is not None:
        raise ApiError(400, "url: credentials in the target URL are not supported",
                       "invalid_request_error", "url")
    return target


def _content_type(given: str) -> dict[str, str]:
    """The answer's Content-Type (and Content-Disposition): the target's when it is one of PASSED,
    else text/plain for any text a browser could run (HTML, SVG, XML, scripts), else an
    attachment."""
    kind = given.split(";", 1)[0].strip().lower()
    if kind in PASSED or (kind.startswith("application/") and kind.endswith("+json")):
        return {"content-type": given}
    charset = next((p.strip() for p in given.split(";")[1:]
                    if p.strip().lower().startswith("charset=")), None)
    if kind.startswith("text/") or "xml" in kind or "script" in kind or "html" in kind:
        return {"content-type": "text/plain" + (f"; {charset}" if charset else "")}
    return {"content-type": "application/octet-stream", "content-disposition": "attachment"}


async def _body(got: httpx.Response, client: httpx.AsyncClient, max_bytes: int,
                where: str) -> AsyncIterator[bytes]:
    """The target's body as it comes, up to max_bytes; past them the answer is cut (CutOff)."""
    sent = 0
    try:
        async for chunk in got.aiter_raw():
            if sent + len(chunk) > max_bytes:
                log.warning("/cors-proxy: the answer from %s went past %d bytes "
                            "(--cors-proxy-max-bytes): cut there", where, max_bytes)
                raise CutOff(f"the target's answer went past {max_bytes} bytes "
                             "(--cors-proxy-max-bytes)")
            sent += len(chunk)
            yield chunk
    finally:
        await got.aclose()
        await client.aclose()
