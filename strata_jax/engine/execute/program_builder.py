"""The builder thread: programs compiled off the engine thread (ProgramCache.build_later).

One thread compiles the layouts handed to it in order; a window that waits for one moves it to the
front (`hurry`). It only compiles: what it finished waits in a queue until the engine thread takes
it into the program cache (ProgramCache.collect), so the LRU and the ledger keep one owner. A queued
layout that the engine thread needs before this thread began it is built there and skipped here
(`take`); one being compiled is waited for, never compiled twice.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import at_exit

# (layout, compiled or None, seconds, error or None)
Built = tuple[Any, Any, float, "BaseException | None"]


class BuilderThread:
    def __init__(self, compile: Callable[[Any], Any]):
        self._compile = compile
        self._todo: queue.Queue = queue.Queue()         # layouts, then None to stop
        self._built: queue.Queue[Built] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()                  # _current and _taken, shared with the thread
        self._current = None                           # the layout being compiled
        # queued ones the engine thread built itself: skipped
        self._taken: set = set()

    def put(self, layout) -> None:
        if self._thread is None:
            # a thread started now would outlive the exit hook (at_exit.py)
            if at_exit.exiting():
                # (ProgramCache.get builds a layout the engine thread needs there)
                return
            self._thread = threading.Thread(target=self._loop, name="strata-builder", daemon=True)
            self._thread.start()
            at_exit.builder_started(self)
        self._todo.put(layout)

    def hurry(self, layout) -> None:
        """Move a queued layout to the front of the queue."""
        with self._todo.mutex:
            todo = self._todo.queue
            if layout in todo:
                todo.remove(layout)
                todo.appendleft(layout)

    def take(self, layout) -> bool:
        """The engine thread builds a queued `layout` itself -> True (this thread will skip it), or
        False when this thread is compiling it already (wait for it: `wait`)."""
        with self._lock:
            if self._current == layout:
                return False
            self._taken.add(layout)
            return True

    def finished(self) -> Built | None:
        """One finished compile, or None (without waiting)."""
        try:
            return self._built.get_nowait()
        except queue.Empty:
            return None

    def wait(self) -> None:
        """Block until a compile has finished (it stays to be taken by `finished`)."""
        self._built.put(self._built.get())

    @property
    def waiting(self) -> int:
        """Finished compiles not yet taken."""
        return self._built.qsize()

    def close(self) -> None:
        """Stop after the compile in progress (a compile cut off at exit aborts the process:
        at_exit.py closes the ones still running then)."""
        at_exit.closed(self)
        if self._thread is None:
            return
        while True:                                      # drop what is queued but not begun
            try:
                self._todo.get_nowait()
            except queue.Empty:
                break
        self._todo.put(None)
        self._thread.join(timeout=120)
        self._thread = None

    def _loop(self) -> None:
        while True:
            layout = self._todo.get()
            if layout is None:
                return
            with self._lock:
                if layout in self._taken:    # the engine thread needed it first and built it
                    self._taken.discard(layout)
                    continue
                self._current = layout
            t0 = time.perf_counter()
            try:
                compiled, err = self._compile(layout), None
            # reported to the engine thread by ProgramCache.collect
            except Exception as e:  # noqa: BLE001
                compiled, err = None, e
            with self._lock:
                self._current = None
            self._built.put((layout, compiled, time.perf_counter() - t0, err))
