"""One engine child process as the supervisor sees it: started, its frames read and handed on, its
stderr kept, its heartbeat watched, and killed by the watchdog when it holds requests and makes no
progress.

The supervisor (supervisor.py) owns what outlives a process: the queue, the seats, restarts and the
fault ledger. This module owns what dies with one: the pipe, the stderr tail, the last heartbeat.
Everything runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from ... import envs
from ..protocol import (
    AnyReply,
    Beat,
    Cancel,
    Command,
    GetStats,
    SaveExpertProfile,
    Shutdown,
    Start,
    decode_reply,
    length,
    pack,
)
from .tickets import EngineBusy

log = logging.getLogger("strata_jax.serve")

STDERR_LINES = 200
SILENT_S = 5.0                      # no frame (not even a heartbeat) this long: /health says 503
WATCH_S = 0.5                       # how often the watchdog looks
# requests' commands written to the engine and not read by it yet
MAX_UNREAD_BYTES = 32 << 20
# sent whatever the engine has not read
_ALWAYS = (Start, Cancel, GetStats, Shutdown, SaveExpertProfile)


class StderrTail:
    """The engine's last log lines and its last ERR line."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=STDERR_LINES)
        self.error_line: str | None = None
        self.last_line: str | None = None

    def add(self, line: str) -> None:
        line = line.rstrip()
        if not line.strip():
            return
        self.lines.append(line)
        if line.startswith("ERR"):
            self.error_line = line
        self.last_line = _strip_level(line)


class EngineProcess:
    """Engine process `generation`: run() starts it, writes `hello` (its start-up frame), hands each
    frame it sends (a protocol.Reply) to `on_frame`, and returns its exit code (None: it could not
    start) when it ends. `busy()` says how many requests are in it: the watchdog kills it only then
    (stall_s without progress)."""

    def __init__(self, command: list[str], generation: int, on_frame: Callable[[AnyReply], None],
                 busy: Callable[[], int], stall_s: float):
        self.command = command
        self.generation = generation
        self.on_frame = on_frame
        self.busy = busy
        self.stall_s = stall_s
        self.tail = StderrTail()
        self.stall: str | None = None               # why the watchdog killed it
        self.proc: asyncio.subprocess.Process | None = None
        self.heard_at = time.monotonic()            # its last frame of any kind
        self.beat: Beat | None = None               # its last heartbeat
        self.beat_at = 0.0                          # and when it came

    async def run(self, hello: Start) -> int | None:
        env = {**envs.environ_without(envs.API_KEY),      # the engine needs no key
               envs.ENGINE_GENERATION: str(self.generation), "PYTHONUNBUFFERED": "1"}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
                limit=1 << 22,
                # its own session: a Ctrl-C at the terminal reaches the server, which stops the
                # engine itself
                start_new_session=True)
        except OSError as e:
            self.tail.add(f"ERR engine start: {e}")
            return None
        self.proc = proc
        log.info("engine process %d started (pid %d)", self.generation, proc.pid)
        self.send(hello)
        self.heard_at = time.monotonic()
        errs = asyncio.create_task(self._read_stderr(proc.stderr))
        watchdog = asyncio.create_task(self._watch(proc))
        await self._read_frames(proc)
        watchdog.cancel()
        rc = await proc.wait()
        try:
            await asyncio.wait_for(errs, 2.0)       # the last lines, the ERR line among them
        except TimeoutError:
            errs.cancel()
        self.proc = None
        return rc

    async def stop(self, timeout: float, reading: bool) -> None:
        """Ask it to close its engine (`reading`: it reads its commands), else end it; kill it after
        `timeout`."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        try:
            if reading:
                self.send(Shutdown())
                proc.stdin.close()
            # still loading, not reading: no need to wait for it
            else:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), timeout)
        except (TimeoutError, OSError, RuntimeError, ProcessLookupError):
            proc.kill()

    # ---- writing ---------------------------------------------------------------------------------

    def send(self, cmd: Start | Command) -> bool:
        """Write a frame; False when the process is gone or going. A request's command (a prompt, a
        question: tokenize, embed, ...) beyond MAX_UNREAD_BYTES unread raises EngineBusy: nothing
        more is sent until it reads. Cancels, stats, the expert profile and the shutdown always go
        (they free things, or are small and one at a time)."""
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return False
        if not isinstance(cmd, _ALWAYS) and self.unread() > MAX_UNREAD_BYTES:
            raise EngineBusy(f"the engine has not read the last {self.unread()} bytes sent to it")
        try:
            proc.stdin.write(pack(cmd))
        except (ConnectionError, RuntimeError, OSError):
            # it is ending: the supervisor hears of its exit next
            return False
        return True

    def unread(self) -> int:
        """Bytes written to its stdin that it has not read yet (the transport's buffer)."""
        proc = self.proc
        transport = (getattr(proc.stdin, "transport", None) if proc is not None and proc.stdin
                     else None)
        return transport.get_write_buffer_size() if transport is not None else 0

    # ---- reading ---------------------------------------------------------------------------------

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:                      # a line beyond the limit: take what there is
                raw = await stream.read(1 << 16)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.add(line)
            if line.startswith("INFO "):
                # the request lines: the server prints them with `done`
                log.debug("engine: %s", line)
            elif line.strip():
                log.info("engine: %s", line)

    async def _read_frames(self, proc: asyncio.subprocess.Process) -> None:
        while True:
            try:
                n = length(await proc.stdout.readexactly(4))
                frame = decode_reply(await proc.stdout.readexactly(n))
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            # a corrupt stream or a FrameError: the process cannot be trusted
            except Exception as e:  # noqa: BLE001
                self.tail.add(f"ERR the engine's answers could not be read: {e}")
                proc.kill()
                return
            self.heard_at = time.monotonic()
            if isinstance(frame, Beat):
                self.beat, self.beat_at = frame, self.heard_at
            try:
                self.on_frame(frame)
            except Exception:  # one bad frame must not stop the reader
                log.exception("could not handle the engine's %r frame", type(frame).__name__)

    # ---- the watchdog ----------------------------------------------------------------------------

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Kill an engine that has requests and makes no progress (supervisor.py's docstring)."""
        while proc.returncode is None:
            await asyncio.sleep(WATCH_S)
            busy = self.busy()
            stall = self.stalled() if busy else None
            if stall is not None and stall[1] >= self.stall_s:
                self.stall = (f"{stall[0]} for {stall[1]:.1f} s with {busy} request(s) in it "
                              f"(--engine-stall-s {self.stall_s:g})")
                log.error("watchdog: the engine %s; killing process %d", self.stall, proc.pid)
                proc.kill()
                return

    def stalled(self) -> tuple[str, float] | None:
        """(what is wrong, for how many seconds) when the engine is silent or its loop does not
        move."""
        now = time.monotonic()
        silent = now - self.heard_at
        if silent >= SILENT_S:
            return "sent nothing, not even its heartbeat", silent
        beat = self.beat
        if beat is None:
            return None
        if beat.loop == "ended":
            return "has no engine loop (its thread ended)", now - self.beat_at
        stuck = beat.stuck_s + (now - self.beat_at)
        if stuck >= SILENT_S:
            return "loop has not moved", stuck
        return None


def _strip_level(line: str) -> str:
    for level in ("INFO ", "WARNING ", "ERROR ", "CRITICAL ", "DEBUG "):
        if line.startswith(level):
            return line[len(level):]
    return line
