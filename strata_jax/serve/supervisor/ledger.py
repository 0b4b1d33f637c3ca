"""The fault ledger: one entry each time the engine process stopped unexpectedly (GET /faults).

Strata's users could not tell why their engine exited: the reason was an ERR line nobody read. Here
every exit keeps its exit code, its ERR line (else its last log line), its last lines, and the
requests it took down, for as long as the server runs (the newest `keep` entries).

Log text stays out of public answers: a log line can name the machine's folders (the compile
cache's, the model's), so /health and the errors requests get say only `Fault.public` (a fixed
phrase and the exit code), the server's own log has `Fault.message` whole, and /faults (behind the
API key) shows the lines with every absolute path replaced by `<path>` (`scrub`).
"""

from __future__ import annotations

import re
import signal
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from time import time as unix_now
from typing import Any


@dataclass
class Fault:
    generation: int                     # the engine process that stopped: 1, 2, ...
    exit_code: int | None               # None: it could not even be started
    reason: str                         # its ERR line, else its last log line
    error_line: str | None              # the ERR line, when there was one
    requests_in_flight: int
    request_ids: list[str]
    uptime_s: float                     # how long the process ran
    was_ready: bool                     # it had finished loading
    restart_in_s: float = 0.0
    last_lines: list[str] = field(default_factory=list)
    kind: str = "exit"                  # exit: it ended by itself | stall: the watchdog killed it
    stall: str | None = None            # what the watchdog saw
    time: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="milliseconds"))
    unix_time: float = field(default_factory=unix_now)

    @property
    def message(self) -> str:
        if self.kind == "stall":
            return ("the engine stalled and the watchdog stopped it "
                    f"({describe_exit(self.exit_code)}): {self.stall}")
        what = "Its last error" if self.error_line else "Its last log line"
        return (f"the engine stopped unexpectedly ({describe_exit(self.exit_code)}). {what}: "
                f"{self.reason}")

    @property
    def public(self) -> str:
        """What anyone may read (/health, a request's error): the fault's kind and exit code, no log
        text."""
        if self.kind == "stall":
            return ("the engine stalled and the watchdog stopped it "
                    f"({describe_exit(self.exit_code)}): {self.stall}")
        return f"the engine stopped unexpectedly ({describe_exit(self.exit_code)})"


# An absolute path (/a/b, ~/a) where a word starts: not a URL's (after ':' or '/'), nor a fraction
# (after a digit)
_PATH = re.compile(r"(?<![\w:/.~-])~?/[^\s'\"`,;()\[\]{}<>]+")


def scrub(text: str | None) -> str | None:
    """`text` with each absolute path replaced by <path>."""
    return None if text is None else _PATH.sub("<path>", text)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "it did not start"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}, exit code {code}"
    return f"exit code {code}"


class FaultLedger:
    def __init__(self, keep: int = 100):
        self.entries: deque[Fault] = deque(maxlen=keep)
        self.total = 0

    def add(self, fault: Fault) -> None:
        self.entries.append(fault)
        self.total += 1

    @property
    def last(self) -> Fault | None:
        return self.entries[-1] if self.entries else None

    def to_json(self) -> dict[str, Any]:
        """GET /faults: every entry, its log text without paths."""
        out = []
        for f in self.entries:
            entry = {**asdict(f), "message": f.message}
            for key in ("reason", "error_line", "message", "stall"):
                entry[key] = scrub(entry[key])
            entry["last_lines"] = [scrub(line) for line in f.last_lines]
            out.append(entry)
        return {"total": self.total, "faults": out}
