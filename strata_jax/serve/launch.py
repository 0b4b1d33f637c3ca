"""Run `strata-jax serve` as a process on a free port and wait for it: for tests and load scripts.

    with ServerProcess(["model.gguf", "--parallel", "2"], env={"STRATA_FAULT": "exit:30@1"}) as srv:
        httpx.get(srv.url + "/health")
        srv.log()          # what the server printed so far (stdout and stderr)
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import httpx

from .. import envs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None,
                 command: Sequence[str] | None = None,
                 port: int | None = None, api_key: str | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._logfile = Path(tempfile.mkstemp(prefix="strata-serve-", suffix=".log")[1])
        cmd = (list(command or [sys.executable, "-m", "strata_jax"])
               + ["serve", *args, "--port", str(self.port)])
        if api_key:
            cmd += ["--api-key", api_key]
        with open(self._logfile, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=envs.environ_with(PYTHONUNBUFFERED="1", **(env or {})))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self._logfile.read_text(errors="replace")

    def engine_pids(self) -> list[int]:
        """The engine processes the server started so far, oldest first (from its `started (pid N)`
        lines)."""
        return [int(p) for p in re.findall(r"engine process \d+ started \(pid (\d+)\)", self.log())]

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=5.0)

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        """Until GET /health says 200; raises with the server's output if it does not come."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited with code "
                                   f"{self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready in {timeout:.0f} s:\n{self.log()}")

    def wait_built(self, timeout: float = 180.0) -> ServerProcess:
        """Until the engine's builder thread has compiled the programs the warm-up queued
        (strata_programs_building 0 in /metrics): tests whose timing the background compiles would
        disturb."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
            line = next((ln for ln in text.splitlines()
                         if ln.startswith("strata_programs_building")), None)
            if line is not None and float(line.split()[-1]) == 0:
                return self
            time.sleep(0.2)
        raise TimeoutError(f"the engine's background builds did not finish in {timeout:.0f} "
                           f"s:\n{self.log()}")

    def wait_up(self, timeout: float = 60.0) -> ServerProcess:
        """Until the server answers HTTP at all (ready or not)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited with code "
                                   f"{self.proc.returncode}:\n{self.log()}")
            try:
                httpx.get(self.url + "/health", timeout=2.0)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"the server did not answer in {timeout:.0f} s:\n{self.log()}")

    def stop(self, timeout: float = 20.0) -> int:
        return stop_process(self.proc, timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._logfile.unlink(missing_ok=True)


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """A server process stopped as Ctrl-C stops it (SIGINT: it ends its engine and requests), killed
    after `timeout` seconds; -> its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
