"""One engine replica of `strata-jax serve --replicas N`: a Ray Serve replica that runs our whole
server.

Each replica starts `python -m strata_jax serve MODEL ... --host 127.0.0.1 --port <free>` as a child
process and passes requests to it over HTTP, so a replica keeps everything one server has: its
engine supervisor (the engine restarted in seconds when it fails), fault ledger, queue limits,
deadlines and streaming. Ray Serve sees the replica as healthy while that server's `/health` answers
200 (check_health); a server that exited, or that has not been ready for `health_grace_s` (stuck, or
its engine failing to start again and again), makes the replica unhealthy, and Ray replaces it: a
new replica, a new server.

This class knows nothing of Ray (ray_app.py wraps it with serve.deployment), so the engine and this
module import without Ray. Ray calls `forward` as a streaming method: its first item says the
replica accepted the request (before that, the ingress may safely try another replica); then the
answer's head, then its body.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from ... import envs
from ..launch import free_port, stop_process

# /health answers at once when the server is alive; longer means stuck
HEALTH_TIMEOUT_S = 5.0


# The server's process starts with these lines, then runs `python -m strata_jax serve ...`: if the
# replica's actor process is killed (ray.kill, a crash), Linux sends the server SIGTERM
# (PR_SET_PDEATHSIG), and the server's engine, whose own death signal is the server's, goes with it.
# Set in the child itself, not in a preexec_fn: forking a Ray worker (many threads) and running
# Python before exec may deadlock. It also takes back SIGINT and SIGTERM, which a Ray worker's child
# may inherit blocked or ignored (then stop() could not stop the server gently).
_CHILD = """import ctypes, os, runpy, signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
sys.argv = ["strata-jax", *sys.argv[2:]]
runpy.run_module("strata_jax", run_name="__main__", alter_sys=True)
"""


class ReplicaServer:
    def __init__(self, name: str, server_args: Sequence[str], env: dict[str, str] | None = None,
                 start_timeout_s: float = 900.0, health_grace_s: float = 60.0):
        self.name = name
        self.health_grace_s = health_grace_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix=f"strata-{name}-", suffix=".log")[1])
        # (the constructor runs on Ray's long-lived user-code thread: PR_SET_PDEATHSIG watches the
        # forking thread)
        cmd = [sys.executable, "-c", _CHILD, str(os.getpid()), "serve", *server_args, "--host",
               "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=envs.environ_with(PYTHONUNBUFFERED="1", **(env or {})))
        self._wait_ready(start_timeout_s)
        self.last_ok = time.monotonic()
        self.started = time.time()
        # No read timeout: a long generation is the server's to bound (its deadlines), not the
        # proxy's.
        self._client: httpx.AsyncClient | None = None

    def _wait_ready(self, timeout: float) -> None:
        """Blocks the constructor until the server's /health says 200, so Ray routes nothing to a
        replica that is still loading; a server that exits or never gets ready fails the replica
        with its log's tail."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name}: its server exited with code "
                                   f"{self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"replica {self.name}: its server was not ready in {timeout:.0f} "
                           f"s:\n{self.log_tail()}")

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:        # made on the event loop that uses it
            self._client = httpx.AsyncClient(base_url=self.url,
                                             timeout=httpx.Timeout(None, connect=5.0))
        return self._client

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def health(self) -> dict[str, Any]:
        """What the ingress shows at its /health and routes by: this replica's server's /health, and
        its pid."""
        info: dict[str, Any] = {"name": self.name, "url": self.url, "pid": self.proc.pid,
                                "ok": False}
        code = self.proc.poll()
        if code is not None:
            return {**info, "status": "exited", "detail": f"its server exited with code {code}"}
        try:
            r = await self.client.get("/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            return {**info, "status": "unreachable", "detail": f"/health: {type(e).__name__}: {e}"}
        try:
            status = r.json().get("status", r.status_code)
        except ValueError:
            status = r.status_code
        if r.status_code == 200:
            self.last_ok = time.monotonic()
        return {**info, "ok": r.status_code == 200, "status": status}

    async def check_health(self) -> None:
        """Ray Serve's health check (every health_check_period_s): raising makes Ray replace this
        replica. A server restarting its engine answers 503 for a while and is left to do so, up to
        health_grace_s."""
        info = await self.health()
        if info["ok"]:
            return
        if info["status"] == "exited":
            raise RuntimeError(f"replica {self.name}: {info['detail']}; last "
                               f"lines:\n{self.log_tail(10)}")
        down = time.monotonic() - self.last_ok
        if down > self.health_grace_s:
            raise RuntimeError(f"replica {self.name}: its server has not been healthy for "
                               f"{down:.0f} s ({info['status']}: {info.get('detail', '')})")

    async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes) -> AsyncIterator[Any]:
        """Items: {"accepted"}, then {"status", "headers", "stream"} (the head) and bytes; or
        {"error"} at the point it failed. A stream (SSE) passes chunk by chunk; any other answer is
        read whole first, so that a server dying mid-answer is a clean error, never half a JSON
        body."""
        yield {"accepted": self.name}
        if self.proc.poll() is not None:
            yield {"error": f"its server had exited (code {self.proc.returncode})", "sent": False}
            return
        req = self.client.build_request(method, path + (f"?{query}" if query else ""),
                                        headers=headers, content=body)
        try:
            resp = await self.client.send(req, stream=True)
        # nothing reached the server: the ingress may try another
        except httpx.ConnectError as e:
            yield {"error": f"its server did not take the connection ({e})", "sent": False}
            return
        except httpx.HTTPError as e:
            yield {"error": f"its server failed before answering ({type(e).__name__}: {e})",
                   "sent": True}
            return
        try:
            stream = resp.headers.get("content-type", "").startswith("text/event-stream")
            head = {"status": resp.status_code, "headers": list(resp.headers.multi_items()),
                    "stream": stream}
            if not stream:
                data = await resp.aread()
                yield head
                yield data
                return
            yield head
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            yield {"error": f"its server stopped mid-answer ({type(e).__name__}: {e})",
                   "sent": True}
        finally:
            # also when the client went away: the server sees the disconnect and cancels
            await resp.aclose()

    def stop(self, timeout: float = 20.0) -> None:
        stop_process(self.proc, timeout)

    # Ray Serve's graceful shutdown of a replica (and a scale down) ends here
    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None:
            self.stop()
        log = getattr(self, "log_path", None)
        # at interpreter exit, pathlib may be half torn down
        with contextlib.suppress(Exception):
            log.unlink(missing_ok=True)
