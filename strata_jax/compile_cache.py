"""JAX's persistent compilation cache, kept in the cache folder, so that a restarted engine (after a
fault) and a second start of the same model load their compiled programs instead of compiling them
again.

    <cache folder>/jax-compile/      ($STRATA_JAX_CACHE, else ~/.cache/strata-jax; see fetch.py)
    STRATA_JAX_COMPILE_CACHE=DIR     use DIR instead;  =off (or 0, no, false, none): no cache
    EngineConfig(compile_cache=False) / --no-compile-cache: no cache

The folder is trusted code: a cached executable is loaded and run as it is, so anyone who can write
to the folder can run code in the engine (JAX's own warning on `set_cache_dir`). It is created
private (0o700); one that already exists and is not ours, or that its group or others may write to,
is not used (a warning says why and what to do). `jax_persistent_cache_min_compile_time_secs` is 0,
so the small programs (the layer-stepped stages, the sampler) are cached too. A directory set by the
user for JAX itself (JAX_COMPILATION_CACHE_DIR, or `jax.config.update("jax_compilation_cache_dir",
...)` before the first engine) is left as it is.

The setting is process-wide (JAX has one cache a process): every Engine calls `enable` (engine.py),
and the first one that asks for the cache decides where it is. JAX does not store programs that hold
a host callback (the KV offload's pure_callback), so those are compiled at every start; everything
else is loaded. `counters()` says how many compiles the cache answered (hits) and how many it did
not (misses).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

from . import envs

log = logging.getLogger("strata_jax.engine")

ENV = envs.COMPILE_CACHE
OFF = ("0", "off", "no", "false", "none")

_lock = threading.Lock()
_state: dict = {"decided": False, "dir": None, "hits": 0, "misses": 0}


def cache_path() -> Path | None:
    """Where the cache lives: $STRATA_JAX_COMPILE_CACHE, else <cache folder>/jax-compile; None when
    the variable turns it off."""
    raw = envs.compile_cache()
    if raw.lower() in OFF:
        return None
    if raw:
        return Path(raw).expanduser()
    return envs.cache_dir() / "jax-compile"


def private_dir(path: Path) -> str | None:
    """Create `path` 0o700 if it is missing; None (and why, in the log) when it exists and is not
    private."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        log.warning("compilation cache %s cannot be created (%s): programs are compiled at every "
                    "start", path, e.strerror or e)
        return None
    if not stat.S_ISDIR(st.st_mode):
        log.warning("compilation cache %s is not a directory: not used; programs are compiled at "
                    "every start", path)
        return None
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        log.warning("compilation cache %s belongs to another user (uid %d): not used, since "
                    "whoever can write to it can run code in this engine; remove it or set %s to a "
                    "folder of your own", path, st.st_uid, ENV)
        return None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("compilation cache %s can be written by its group or others (mode %o): not "
                    "used, since whoever can write to it can run code in this engine; `chmod 700 "
                    "%s` to use it", path, stat.S_IMODE(st.st_mode), path)
        return None
    return str(path)


def enable(on: bool = True) -> str | None:
    """Turn the cache on for this process (once; later calls return what the first one decided) ->
    the directory in use, or None."""
    with _lock:
        # off: this engine does not turn it on (a later one may)
        if _state["decided"] or not on:
            return _state["dir"]
        _state["decided"] = True
        import jax

        user_dir = jax.config.jax_compilation_cache_dir
        if user_dir:                                    # the user's own JAX setting: theirs to keep
            directory = str(user_dir)
        else:
            path = cache_path()
            directory = private_dir(path) if path is not None else None
            if directory is None:
                return None
            jax.config.update("jax_compilation_cache_dir", directory)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        _listen()
        _state["dir"] = directory
        log.info("compiled programs are kept in %s (JAX's persistent compilation cache)", directory)
        return directory


def directory() -> str | None:
    """The cache directory in use in this process (None: no cache)."""
    return _state["dir"]


def counters() -> dict:
    """{"on", "hits", "misses"}: JAX's cache lookups in this process since `enable` (a hit: an
    executable loaded, not compiled)."""
    return {"on": _state["dir"] is not None, "hits": _state["hits"], "misses": _state["misses"]}


def _listen() -> None:
    import jax.monitoring

    def on_event(event: str, **_kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _state["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            _state["misses"] += 1

    jax.monitoring.register_event_listener(on_event)
