"""Every thread the engine starts ends before the interpreter finalizes (issue 32, finding 7).

The engine thread and the builder threads are daemon threads (a program that forgets close() must
still exit), but a daemon thread still running at finalization is ended by glibc's forced unwind
when it next takes the GIL. A builder thread is then inside jaxlib's C++ (compiling, or loading a
program from the compile cache: PyClient::DeserializeExecutable), whose noexcept frames turn that
unwind into std::terminate: "terminate called after throwing an instance of '' / FATAL: exception
not rethrown", SIGABRT, exit 134, after the program had its answers. jax's own exit hook (clearing
the backends) must not run under them either.

So at exit, before jax's hooks: every Engine not closed is closed (its loop stops after the window
it is in, then its runner: builder threads, expert readers, drafter), then every builder thread
still alive (EngineCores stepped by hand, runners of their own) stops after the compile it is in.
Registered once, after jax is imported, so that it runs first (atexit runs hooks last registered
first). A builder thread is not started again once the hook ran (`exiting`).
"""

from __future__ import annotations

import atexit
import logging
import weakref

# its exit hooks must be registered before ours, so that ours run before them
import jax  # noqa: F401

log = logging.getLogger("strata_jax.engine")

# Engines whose thread started, until closed or collected
_engines: weakref.WeakSet = weakref.WeakSet()
_builders: weakref.WeakSet = weakref.WeakSet()     # BuilderThreads whose thread started
_exiting = False


def engine_started(engine) -> None:
    _engines.add(engine)


def builder_started(builder) -> None:
    _builders.add(builder)


def closed(obj) -> None:
    """Closed by its owner: nothing to do at exit."""
    _engines.discard(obj)
    _builders.discard(obj)


def exiting() -> bool:
    """The interpreter is exiting: no new thread may start (it would outlive the hook below)."""
    return _exiting


def _stop_all() -> None:
    global _exiting
    _exiting = True
    # engines first: a running window may still queue a build
    for group in (_engines, _builders):
        for obj in list(group):
            try:
                obj.close()
            except Exception as e:  # noqa: BLE001 - one failure must not leave the others running
                log.warning("closing %s at exit failed: %s: %s", type(obj).__name__,
                            type(e).__name__, e)


atexit.register(_stop_all)
