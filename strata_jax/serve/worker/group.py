"""The serving side of one model over processes (engine/distributed/hosts.py,
engine/distributed/lockstep.py).

Process 0 is an ordinary server: its supervisor runs the engine process, which joins the group,
leads it and serves HTTP. Every other process (`strata-jax serve MODEL ... --process-id I`, I > 0)
serves no API: it runs `follower_loop`, which starts a follower engine process (`python -m
strata_jax.serve.worker.group`: join the group, load the same weights, replay the leader's calls)
and starts it again whenever it ends.

A process that dies breaks the group, and the group restarts as a whole: the leader's engine process
learns it first (its channel to the follower closes, or a collective fails), exits with an ERR line
naming the process (the supervisor's fault ledger, /faults, shows it; the requests in flight end
with that error), and its supervisor starts a new one, which hosts a new coordinator. The followers'
engine processes see the leader's channel close (or their collective fail), exit, and are started
again by their loop; they join the new coordinator at the same address (gloo and our channel bind
with SO_REUSEADDR, so the ports come back at once). A follower engine killed alone comes back the
same way, after its loop's pause.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ...config import EngineConfig
from ..protocol import Start, decode_start, pack, read_frame

log = logging.getLogger("strata_jax.serve")

# a follower engine that ran this long and stopped is restarted after the first pause
STABLE_S = 60.0


def exit_group_lost(why: str) -> None:
    """The leader's engine process, when its group breaks: the ERR line names the process, then it
    ends and the supervisor records the fault and restarts it (a new coordinator, which the
    followers rejoin)."""
    print(f"ERR the group of processes broke: {why}", file=sys.stderr, flush=True)
    os._exit(1)


def follower_loop(model: str, cfg: EngineConfig, backoff_s: float = 1.0,
                  max_backoff_s: float = 30.0) -> int:
    """`strata-jax serve` for process I > 0: its follower engine process, started again whenever it
    stops, until Ctrl-C or SIGTERM (which stop it too)."""
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # even where the shell started it ignoring SIGINT (a background job)
    signal.signal(signal.SIGINT, stop)
    log.info("process %d of %d: following process 0 (coordinator %s); this process serves no HTTP",
             cfg.process_id, cfg.num_processes, cfg.coordinator)
    generation, fails = 0, 0
    proc: subprocess.Popen | None = None
    try:
        while not stopping:
            generation += 1
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "strata_jax.serve.worker.group"],
                                    stdin=subprocess.PIPE, start_new_session=True)
            log.info("follower engine process %d started (pid %d)", generation, proc.pid)
            proc.stdin.write(pack(Start(model, cfg.to_dict())))
            proc.stdin.flush()
            rc = proc.wait()
            fails = 1 if time.monotonic() - t0 >= STABLE_S else fails + 1
            delay = min(max_backoff_s, backoff_s * 2.0 ** (fails - 1))
            log.error("follower engine process %d (pid %d) stopped (exit code %s); starting it "
                      "again in %g s", generation, proc.pid, rc, delay)
            time.sleep(delay)
    except KeyboardInterrupt:
        pass
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    return 0


def follower_main() -> int:
    """The follower engine process: join the group, load the weights (this process's part of the
    experts), build the decode programs as the leader does, then replay the leader's calls until its
    channel closes."""
    from .worker_process import die_with_parent, one_line

    die_with_parent()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    start = read_frame(sys.stdin.buffer, decode_start)
    if start is None:
        return 0
    try:
        from strata_jax import compile_cache
        from strata_jax.engine.distributed.hosts import digest, join
        from strata_jax.engine.distributed.lockstep import follow, hello
        from strata_jax.engine.runner import ModelRunner
        from strata_jax.gguf import GGUFModel

        cfg = EngineConfig.from_dict(start.engine)
        join(cfg)
        compile_cache.enable(cfg.compile_cache)
        model = GGUFModel.open(start.model)
        # before loading: see Leader.accept
        conn = hello(cfg, digest(cfg, model.spec), socket.gethostname())
        runner = ModelRunner(model, cfg)
        if cfg.warmup:
            runner.warmup(progress=False)
        log.info("process %d: %s loaded", cfg.process_id, Path(start.model).name)
        why = follow(runner, conn, cfg)
    # said on one line, then the process ends (its loop restarts it)
    except BaseException as e:  # noqa: BLE001
        print(f"ERR follower engine: {type(e).__name__}: {one_line(e)}", file=sys.stderr,
              flush=True)
        os._exit(1)
    print(f"ERR follower engine: {why}", file=sys.stderr, flush=True)
    os._exit(1)     # not sys.exit: jax.distributed's exit hooks would wait for the gone leader


if __name__ == "__main__":
    sys.exit(follower_main())
