"""What the server prints: progress bars while an engine loads and warms up, one `done:` line a
request."""

from __future__ import annotations

import logging
import sys
from typing import Any

from tqdm import tqdm

log = logging.getLogger("strata_jax.serve")

class Console:
    def __init__(self, stream=None, bars: bool = True):
        self.stream = stream or sys.stderr
        self.bars = bars
        self._bars: dict[str, tqdm] = {}
        # (engine generation, stage) whose bar is complete
        self._done: set[tuple[int, str]] = set()

    def progress(self, generation: int, stage: str, n: int, total: int) -> None:
        """The engine process's progress bars (loading weights, building programs), drawn here."""
        if not self.bars or (generation, stage) in self._done:
            return
        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(total=total or None,
                                           desc=f"engine {generation}: {stage}", file=self.stream,
                                           mininterval=0.5, leave=True, dynamic_ncols=True)
        bar.n = n
        bar.refresh()
        if total and n >= total:
            self._done.add((generation, stage))
            self._close(stage)

    def ready(self, generation: int, info: dict[str, Any]) -> None:
        for stage in list(self._bars):
            self._close(stage)
        log.info("engine %d ready in %.1f s: %s (%s), %d slots of %d tokens, %d programs built in "
                 "%.1f s",
                 generation, info.get("start_s", 0.0), info.get("name") or "model",
                 info.get("architecture"),
                 info.get("parallel", 0), info.get("n_ctx", 0), info.get("programs_built", 0),
                 info.get("build_s", 0.0))

    def _close(self, stage: str) -> None:
        bar = self._bars.pop(stage, None)
        if bar is not None:
            bar.close()


def done_line(n_tokens: int, seconds: float, outcome: str, detail: str | None = None) -> str:
    """Strata's request line: `done: 512 tokens in 9.0 s (56.9 tok/s)`, with what went wrong, if
    anything."""
    line = f"done: {n_tokens} tokens in {seconds:.1f} s ({n_tokens / max(seconds, 1e-9):.1f} tok/s)"
    if outcome != "ok":
        line += f" ({outcome}{': ' + detail if detail else ''})"
    return line
