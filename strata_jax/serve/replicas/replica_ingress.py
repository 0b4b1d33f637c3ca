"""The front of `strata-jax serve --replicas N`: a Ray Serve ingress that sends each request to one
replica.

Ray Serve's HTTP proxy hands every request to this deployment. It ranks the replicas for the
request's conversation (replica_routing.py: rendezvous hash, so a conversation keeps its replica and
prefix cache), puts those last seen unhealthy last, and calls the first one's `forward` through its
deployment handle:

- no "accepted" item within accept_timeout_s, or the replica's actor gone before accepting: nothing
  reached an engine, so the next replica is tried (Ray queues calls to a deployment whose replica is
  being replaced: the timeout keeps a request from waiting out a restart);
- the replica fails after accepting (its server died mid-answer, its actor was killed): the request
  is not retried, since it may have run in part. A whole answer becomes a 503 JSON error naming the
  replica; a stream that already began ends with an SSE error event naming it, then [DONE]. Nothing
  hangs.

Every answer carries `x-strata-replica`. `GET /health` is answered here: 200 while any replica is
healthy, with each replica's state; its url, pid and why it is down only to a caller with the API
key (or when there is no key), since the route is public. A poller keeps that view a second fresh.

Before it reads a byte of a body, the ingress checks the API key (the replicas' servers check it
again) on every route the servers do not leave public, and a body past max_body_bytes (the servers'
--max-body-bytes) is a 413 whether its Content-Length says so or its stream runs past it: a stranger
cannot make the ingress hold more. JSON nested too deeply to read is a 400 here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import error_body
from . import replica_routing as routing

PROBE_TIMEOUT_S = 3.0           # a replica that does not say how it is in 3 s is routed around
FIRST_PROBE_TIMEOUT_S = 30.0


class ReplicaIngress:
    def __init__(self, replicas: Sequence[Any], names: Sequence[str],
                 accept_timeout_s: float = 10.0, poll_s: float = 1.0, api_key: str | None = None,
                 max_body_bytes: int = 8 << 20):
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        # DeploymentHandles (Ray resolves the binds)
        self.handles = dict(zip(names, replicas, strict=True))
        self.names = list(names)
        self.accept_timeout_s = accept_timeout_s
        self.poll_s = poll_s
        self.info: dict[str, dict[str, Any]] = {n: {"name": n, "ok": True, "status": "unknown"}
                                                for n in names}
        self.turn = itertools.count()
        self._poller: asyncio.Task | None = None

    # -- health ------------------------------------------------------------------------------------
    def healthy(self) -> dict[str, bool]:
        return {n: bool(i.get("ok")) for n, i in self.info.items()}

    async def _probe(self, name: str, timeout: float = PROBE_TIMEOUT_S) -> None:
        call = self.handles[name].health.remote()
        try:
            self.info[name] = await asyncio.wait_for(_awaited(call), timeout)
        # a replica being replaced (Ray queues the call), or its actor gone
        except Exception as e:  # noqa: BLE001
            call.cancel()
            self.info[name] = {"name": name, "ok": False, "status": "unavailable",
                               "detail": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__}

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(n) for n in self.names))
            await asyncio.sleep(self.poll_s)

    async def _start_poller(self) -> None:
        """At the first request: a first look at every replica, given time (a handle's first call
        waits for Ray to tell it where the replicas are: seconds), then the poller."""
        if self._poller is None or self._poller.done():
            if self._poller is None:
                await asyncio.gather(*(self._probe(n, FIRST_PROBE_TIMEOUT_S) for n in self.names))
            if self._poller is None or self._poller.done():
                self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _health(self, detailed: bool) -> Response:
        """Public: each replica's name, ok and status; `detailed` (the key, or none is set): its
        url, pid and why it is down too (exception text, which a public answer must not carry)."""
        await asyncio.gather(*(self._probe(n) for n in self.names))
        replicas = [self.info[n] for n in self.names]
        ok = sum(1 for r in replicas if r.get("ok"))
        shown = (replicas if detailed
                 else [{k: r.get(k) for k in ("name", "ok", "status")} for r in replicas])
        body = {"status": "ok" if ok else "unavailable", "replicas_ok": ok, "replicas": shown}
        if not ok:
            body.update(routing.replica_error(None,
                                              f"no replica is healthy (0 of {len(replicas)})"))
        return JSONResponse(body, status_code=200 if ok else 503)

    # -- requests ----------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        await self._start_poller()
        path = request.url.path
        allowed = routing.authorized(request.headers, self.api_key)
        if path == "/health" and request.method in ("GET", "HEAD"):
            return await self._health(allowed)
        public = (request.method == "OPTIONS"
                  or (request.method in ("GET", "HEAD") and path in routing.PUBLIC_GETS))
        if not (allowed or public):     # before the body: a stranger's bytes are not read
            return _error(401, "invalid or missing API key: send the header 'Authorization: Bearer "
                               "KEY' (or 'X-Api-Key: KEY') with the key given to --api-key or "
                               "--api-key-file",
                          {"WWW-Authenticate": "Bearer"})
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        headers = routing.forward_headers(request.headers.items())
        try:
            key = routing.conversation_key(body, request.headers)
        except routing.BodyError as e:
            return _error(400, str(e))
        order = routing.healthy_first(routing.rank(key, self.names, next(self.turn)),
                                      self.healthy())
        refused = []
        for name in order:
            gen = self.handles[name].options(stream=True).forward.remote(
                request.method, path, request.url.query, headers, body)
            try:
                first = await asyncio.wait_for(gen.__anext__(), self.accept_timeout_s)
            # timed out, or its actor died: nothing reached an engine
            except Exception as e:  # noqa: BLE001
                gen.cancel()
                self.info[name] = {**self.info[name], "ok": False, "status": "unavailable"}
                refused.append(f"{name}: {_why(e)}")
                continue
            if "accepted" not in first:
                gen.cancel()
                refused.append(f"{name}: {first}")
                continue
            answer = await self._answer(name, gen)
            if answer is not None:
                return answer
            refused.append(f"{name}: its server did not take the connection")
        message = f"no replica could take the request ({'; '.join(refused) or 'no replicas'})"
        return JSONResponse(routing.replica_error(None, message), status_code=503,
                            headers={"Retry-After": "5"})

    async def _body(self, request: Request) -> bytes | Response:
        """The body, or a 413 as soon as it is known to be past max_body_bytes (before reading it
        when its Content-Length says so)."""
        too_big = _error(413, f"the request body is larger than {self.max_body_bytes} bytes (the "
                              "servers' --max-body-bytes)")
        length = request.headers.get("content-length", "")
        if length and (not length.isdigit() or int(length) > self.max_body_bytes):
            return (too_big if length.isdigit()
                    else _error(400, f"Content-Length {length[:40]!r} is not a number"))
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return too_big
            parts.append(chunk)
        return b"".join(parts)

    async def _answer(self, name: str, gen) -> Response | None:
        """The replica's answer as a response; None when its server refused the connection (not
        sent: the caller tries the next replica)."""
        try:
            head = await gen.__anext__()
        except Exception as e:  # noqa: BLE001 - its actor died (Ray's errors): said to the client
            return self._failed(name, f"replica {name} failed before answering ({_why(e)})")
        if "error" in head:
            gen.cancel()
            if not head.get("sent", True):
                self.info[name] = {**self.info[name], "ok": False, "status": "unavailable"}
                return None
            return self._failed(name, f"replica {name} failed before answering: {head['error']}; "
                                      "the request was not retried (it may have run in part)")
        headers = routing.answer_headers(head["headers"], name)
        if not head["stream"]:
            parts = []
            try:
                async for item in gen:
                    if isinstance(item, dict):
                        return self._failed(name, f"replica {name} failed while answering: "
                                                  f"{item['error']}")
                    parts.append(item)
            except Exception as e:  # noqa: BLE001 - as above
                return self._failed(name, f"replica {name} failed while answering ({_why(e)})")
            return Response(b"".join(parts), status_code=head["status"], headers=headers)
        return StreamingResponse(self._relay(name, gen), status_code=head["status"],
                                 headers=headers)

    async def _relay(self, name: str, gen) -> AsyncIterator[bytes]:
        """An SSE stream chunk by chunk; a replica failing mid-stream ends it with an error event
        naming it."""
        try:
            async for item in gen:
                if isinstance(item, dict):
                    yield routing.sse_error(name,
                                            f"replica {name} failed mid-stream: {item['error']}")
                    return
                yield item
        except Exception as e:  # noqa: BLE001 - as above, in the stream
            self.info[name] = {**self.info[name], "ok": False, "status": "unavailable"}
            yield routing.sse_error(name, f"replica {name} failed mid-stream ({_why(e)})")
        finally:
            # the client went away, or we are done: stop the replica's side too
            gen.cancel()

    def _failed(self, name: str, message: str) -> Response:
        self.info[name] = {**self.info[name], "ok": False, "status": "unavailable",
                           "since": time.time()}
        return JSONResponse(routing.replica_error(name, message), status_code=503,
                            headers={routing.REPLICA_HEADER: name})


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


async def _awaited(response):
    return await response


def _why(e: BaseException) -> str:
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "it did not accept the request in time (starting or being replaced)"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
