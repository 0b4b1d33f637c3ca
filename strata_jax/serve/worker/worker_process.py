"""The engine process's own plumbing, apart from what it does with commands (worker.py): the one
writer of its stdout, dying with the server, the engine's progress bars as frames, telling a program
build from a stuck loop (the heartbeat's question), and the ERR line a fatal error ends the process
with."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import BinaryIO

from ..protocol import Progress, Reply, pack


class Writer:
    """stdout, reserved for frames: every thread writes through this one lock, a frame at a time."""

    def __init__(self, out: BinaryIO):
        self._out = out
        self._lock = threading.Lock()

    def send(self, frame: Reply) -> None:
        data = pack(frame)
        with self._lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, OSError):   # the server is gone: nothing left to do
                os._exit(0)


def exit_with_error(reason: str) -> None:
    """The engine loop's thread ended: say why on the ERR line and end the process (the server
    restarts it)."""
    print(f"ERR the engine loop stopped: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


def in_build(thread: threading.Thread) -> bool:
    """Whether `thread` is building a program now: a frame of our ProgramCache._build_one (or
    _wait_built, the same build on the builder thread), or of JAX lowering
    or compiling (a jit's first call, e.g. the sampler's for a new row count), is on its stack.
    Running a program is not building one: its frames (pxla's ExecuteReplicated) match neither."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        code = frame.f_code
        if (code.co_name in ("_build_one", "_wait_built")
                and code.co_filename.endswith("programs.py")):
            # _wait_built: waiting for the builder thread's compile of it
            return True
        if (f"jax{os.sep}_src{os.sep}" in code.co_filename
                and ("compil" in code.co_name or "lower" in code.co_name)):
            return True
        frame = frame.f_back
    return False


def storage_reads() -> int | None:
    """Bytes this process has had read from storage so far (/proc/self/io's read_bytes: the file
    tier's preads that missed the page cache) plus its major page faults as pages (the model's
    memory map paged in from disk), or None where /proc cannot say. It grows while a window waits
    on the model file, which is progress however slow (issue 36: a model larger than RAM)."""
    try:
        with open("/proc/self/io") as f:
            read = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
        with open("/proc/self/stat") as f:
            majflt = int(f.read().rsplit(")", 1)[1].split()[9])
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return read + majflt * 4096


def stuck_seconds(now: float, loop_turn_at: float, reading_at: float, building: bool) -> float:
    """The heartbeat's stuck_s: seconds since the loop last began a turn or the process last read
    from storage, 0 while a program builds."""
    return 0.0 if building else max(now - max(loop_turn_at, reading_at), 0.0)


def die_with_parent() -> None:
    """The server stops this process at shutdown; if the server is killed instead, Linux ends it too
    (the process has its own session, so terminal signals do not reach it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                  # not Linux: stdin closing still ends the process
    if os.getppid() == 1:                     # the server died before prctl
        os._exit(0)


@contextlib.contextmanager
def progress_as_frames(writer: Writer):
    """The engine draws its progress (loading weights, building programs) with tqdm; here, in the
    engine process, each bar's updates become progress frames instead, and the server draws them."""
    import tqdm as tqdm_module

    devnull = open(os.devnull, "w")  # noqa: SIM115 - closed below

    class FrameBar(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": devnull, "mininterval": 0.25})

        def display(self, msg=None, pos=None):
            writer.send(Progress(self.desc or "working", int(self.n), int(self.total or 0)))
            return True

        def close(self):
            if not self.disable and not getattr(self, "_frame_closed", False):
                self._frame_closed = True
                self.display()
            super().close()

    saved = tqdm_module.tqdm
    tqdm_module.tqdm = FrameBar
    try:
        yield
    finally:
        tqdm_module.tqdm = saved
        devnull.close()


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
