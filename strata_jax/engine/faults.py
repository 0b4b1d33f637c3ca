"""Fault injection for tests (STRATA_FAULT; test-only, documented in docs/LIMITS.md).

    STRATA_FAULT="build_oom:3"      the 3rd program build raises RESOURCE_EXHAUSTED
    STRATA_FAULT="build_oom:3+"     every build from the 3rd on raises it
    STRATA_FAULT="run_oom:5"        the 5th window run raises RESOURCE_EXHAUSTED (before it touches
                                    the device)
    STRATA_FAULT="exit:7"           the process prints an error line and exits with code 1 at the
                                    7th window
    STRATA_FAULT="oom_rows:2"       building any window of more than 2 rows raises
                                    RESOURCE_EXHAUSTED (a layout too big for the device whatever
                                    else is freed)
    STRATA_FAULT="block:4"          the 4th window blocks the engine loop for good (the process
                                    stays alive and keeps its heartbeat: the watchdog must see that
                                    it makes no progress)
    STRATA_FAULT="plan_error:3"     the 3rd planned window raises a RuntimeError before it runs (a
                                    bug in the loop)
    STRATA_FAULT="loop_death:3"     the 3rd window ends the engine loop's thread (a BaseException no
                                    handler takes)
    STRATA_FAULT="slow:20"          every window takes 20 ms longer (a slow device: tests that need
                                    a request to be in flight for a while, whatever the machine's
                                    speed)
    several, comma-separated: "build_oom:2,exit:40"

Counts are per engine process, so a restarted engine (a new process) starts again from zero unless
the variable says `exit:7@1` (only the first engine process, the server's first start, fails).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from .. import envs

ENV = envs.FAULT


class InjectedLoopDeath(BaseException):
    """Not an Exception: nothing in the engine loop catches it, so the loop's thread ends."""


def resource_exhausted(what: str) -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {what}")


class Faults:
    def __init__(self, spec: str | None = None, generation: int | None = None):
        if generation is None:  # the server numbers its engine processes 1, 2, ... in this variable
            generation = envs.engine_generation()
        self.rules: dict[str, tuple[int, bool]] = {}
        self.counts = {"build_oom": 0, "run_oom": 0, "exit": 0, "oom_rows": 0, "block": 0,
                       "plan_error": 0, "loop_death": 0, "slow": 0}
        spec = envs.fault_spec() if spec is None else spec
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, rest = part.partition(":")
            rest, _, only = rest.partition("@")
            if kind not in self.counts or not rest.rstrip("+").isdigit():
                raise ValueError(f"{ENV}: cannot read {part!r}; use build_oom:N, run_oom:N, "
                                 "exit:N, oom_rows:N, block:N, plan_error:N, loop_death:N or "
                                 "slow:MS (N+ for every time from the N-th, @G for engine "
                                 "generation G only)")
            if only and int(only) != generation:
                continue
            self.rules[kind] = (int(rest.rstrip("+")), rest.endswith("+"))

    def _hit(self, kind: str) -> bool:
        if kind not in self.rules:
            return False
        self.counts[kind] += 1
        n, onwards = self.rules[kind]
        return self.counts[kind] == n or (onwards and self.counts[kind] >= n)

    def on_build(self, rows: int) -> None:
        if self._hit("build_oom"):
            raise resource_exhausted(f"injected by {ENV} at program build "
                                     f"{self.counts['build_oom']}")
        if "oom_rows" in self.rules and rows > self.rules["oom_rows"][0]:
            raise resource_exhausted(f"injected by {ENV}: a window of {rows} rows does not fit")

    def on_window(self) -> None:
        if "slow" in self.rules:
            time.sleep(self.rules["slow"][0] / 1000)
        if self._hit("exit"):
            print(f"ERR window {self.counts['exit']}: injected engine exit ({ENV})",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        if self._hit("run_oom"):
            raise resource_exhausted(f"injected by {ENV} at window {self.counts['run_oom']}")
        if self._hit("loop_death"):
            raise InjectedLoopDeath(f"injected by {ENV} at window {self.counts['loop_death']}")
        if self._hit("block"):
            print(f"injected by {ENV}: window {self.counts['block']} blocks the engine loop",
                  file=sys.stderr, flush=True)
            threading.Event().wait()

    def on_plan(self) -> None:
        if self._hit("plan_error"):
            raise RuntimeError(f"injected by {ENV} while planning window "
                               f"{self.counts['plan_error']}")
