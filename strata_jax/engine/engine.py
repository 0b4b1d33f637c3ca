"""The Engine: requests in, tokens out, slots decoding together in batch windows.

Threads and queues: callers (any thread) `submit` requests into `inbox` and read events from their
request's own queue. One engine thread owns everything else (slots, runner, programs): its loop
calls `step()` (core.py: admit, plan a window, run it, turn its tokens into events) until the engine
is closed. So the device is only ever touched from one thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import EngineConfig
from ..gguf import GGUFModel
from . import at_exit, slot_files
from .core import EngineCore
from .execute.embeddings import POOLINGS
from .prompt import fit_context
from .request import Event, Handle, Request
from .schedule.output import first_line

log = logging.getLogger("strata_jax.engine")


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class Engine(EngineCore):
    """EngineCore's step() on a thread of its own, and the API callers use from any thread."""

    def __init__(self, model: GGUFModel, config: EngineConfig | None = None, progress: bool = False,
                 expert_policy: str | None = None):
        super().__init__(model, config, progress, expert_policy)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.progress_at = time.monotonic()     # last sign of life of the loop (heartbeat)
        self.loop_error: str | None = None       # why the loop thread ended, if it did
        # called with that reason (the worker exits the process)
        self.on_loop_death = None

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The thread that steps the engine (None before the first request): the heartbeat watches
        it."""
        return self._thread

    def when_lost(self, on_loop_death: Callable[[str], None],
                  on_group_lost: Callable[[str], None] | None = None) -> None:
        """What the engine process does when the engine cannot go on: its loop thread died (with the
        reason), or, for one model over processes, a process of the group is gone (called at once if
        it is already)."""
        self.on_loop_death = on_loop_death
        if self.runner.group is not None and on_group_lost is not None:
            self.runner.group.when_lost(on_group_lost)

    @classmethod
    def from_gguf(cls, path: str | Path, config: EngineConfig | None = None, progress: bool = False,
                  expert_policy: str | None = None) -> Engine:
        return cls(GGUFModel.open(path), config, progress, expert_policy)

    # ---- the caller's side -----------------------------------------------------------------------

    def submit(self, prompt: str | list[dict] | list[int], **kwargs) -> Handle:
        """Queue a request (make_request's arguments: the prompt as text, chat messages or token
        ids, and its sampling fields) for the engine thread -> the handle its events are read from.
        RequestError names a bad field and its value."""
        return self.enqueue(self.make_request(prompt, **kwargs))

    def enqueue(self, req: Request) -> Handle:
        """Queue a request made by make_request or prepared_request (the server's: its prompt
        tokenized and checked by serve/prompts.py) -> its handle."""
        self._ensure_thread()
        self.add(req)
        self._wake.set()
        return Handle(req, self._wake.set)

    def stream(self, prompt, **kwargs) -> Iterator[Event]:
        handle = self.submit(prompt, **kwargs)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()

    def wait_for_programs(self, timeout: float = 600.0) -> bool:
        """Wait until the builder thread has built every queued program (benchmarks: no compile
        beside what they time) -> whether it did within the timeout."""
        self._ensure_thread()
        end = time.monotonic() + timeout
        # queued, or compiled and not yet taken in by the loop
        while self.runner.programs.pending:
            if time.monotonic() > end:
                return False
            self._wake.set()
            time.sleep(0.05)
        return True

    def generate(self, prompt, **kwargs) -> Completion:
        text, tokens = [], []
        for ev in self.stream(prompt, **kwargs):
            if ev.kind == "token":
                text.append(ev.text)
                tokens.append(ev.token)
            elif ev.kind == "final":
                text.append(ev.text)
                return Completion("".join(text), tokens, ev.finish_reason or "stop", ev.stats or {})
            else:
                raise RuntimeError(f"generation failed: {ev.error}")
        raise RuntimeError("generation ended without a final event")

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 [T, vocab] for the given tokens, no sampling (research and checks). Runs on a
        slot of its own between windows, so it never disturbs requests in flight."""
        return self._ask_engine_thread("logits", token_ids)

    def logits_reusing(self, token_ids: list[int]) -> tuple[int, np.ndarray]:
        """Like logits, but on a free slot through the prefix cache, as a request would read the
        prompt: -> (tokens reused, float32 [T - reused, vocab] for the tokens read). The slot keeps
        the KV."""
        return self._ask_engine_thread("logits_reusing", token_ids)

    def embed(self, inputs: list[list[int]], pooling: str = "last", normalize: int = 2,
              cancel: threading.Event | None = None) -> list[np.ndarray]:
        """Each token list's embedding (engine/execute/embeddings.py): its final hidden states
        pooled (last, mean, cls: float32 [hidden]; none: every token's, [T, hidden]) and normalized
        as llama.cpp's embd_normalize (2: Euclidean; -1: none). Read a piece a step between windows
        on a scratch KV cache: requests in flight go on. cancel: set, the job ends (RuntimeError)
        before its next piece."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling = {pooling!r}: must be one of {', '.join(POOLINGS)}")
        checked = []
        for ids in inputs:
            ids = self.prompt_ids([int(t) for t in ids])
            fit_context(len(ids), 0, self.config.max_context)
            checked.append(ids)
        return self._ask("embed", checked, pooling, int(normalize), cancel)

    def _ask_engine_thread(self, kind: str, token_ids: list[int]):
        """Run a logits job on the engine thread (which alone touches the device) and wait for its
        answer."""
        ids = self.prompt_ids([int(t) for t in token_ids])
        fit_context(len(ids), 0, self.config.max_context)
        return self._ask(kind, ids)

    def _ask(self, kind: str, *args):
        """Put a job in the engine thread's inbox (core.py's _JOBS) and wait for its answer."""
        done: queue.Queue = queue.Queue()
        self._ensure_thread()
        self.inbox.put((kind, *args, done))     # type: ignore[arg-type]
        self._wake.set()
        out = done.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def save_expert_profile(self, path: str | Path, private_dir: bool = False) -> dict[str, Any]:
        """Write the expert profile (how often live traffic routed to each (MoE layer, expert) since
        start; see experts/profile.py) to `path`, for `--expert-profile` to preload and pin at a
        later start. Returns {"path", "routed"}. The file is written in the caller's thread
        (atomically, mode 0o600), never on the engine thread; private_dir: create its directory
        0o700 if missing."""
        prof = self.expert_profile()
        prof.save(path, private_dir=private_dir)
        routed = int(prof.counts.sum())
        log.info("expert profile: %d routed token-expert pairs since start written to %s",
                 routed, path)
        return {"path": str(path), "routed": routed}

    def expert_profile(self):
        """A copy of the expert profile's counts (an ExpertProfile), taken on the engine thread
        between windows; ValueError for a model without experts."""
        done: queue.Queue = queue.Queue()
        self._ensure_thread()
        self.inbox.put(("profile", done))       # type: ignore[arg-type]
        self._wake.set()
        out = done.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def slot_action(self, action: str, slot: int, path: str | None = None) -> dict[str, Any]:
        """llama.cpp's slot files (POST /slots/N?action=save|restore|erase, engine/slot_files.py):
        slot `slot`'s kept KV and tokens written to the file at `path`, read back from it, or
        forgotten -> the action's llama.cpp answer. Raises slot_files.SlotFileError for what a
        client must mend (a busy slot, a file of another model)."""
        return slot_files.run(self, action, slot, path)

    def between_windows(self, fn):
        """fn() run on the engine thread between windows (slots and the KV cache hold still) -> its
        result."""
        done: queue.Queue = queue.Queue()
        self._ensure_thread()
        self.inbox.put(("call", fn, done))      # type: ignore[arg-type]
        self._wake.set()
        out = done.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def stats(self) -> dict[str, Any]:
        busy = sum(not s.free for s in self.slots)
        out = {**self.counters, **self.runner.stats(), "slots": self.config.parallel,
               "busy_slots": busy,
               "queued": self.inbox.qsize() + len(self.admission.waiting),
               "prefix_cache": self.prefix.stats(),
               # KV usage (/metrics)
               "kv_used_positions": sum(s.n_past for s in self.slots if not s.free)}
        # the runner's windows and the embeddings' pieces
        out["windows"] += self.embeds.pieces
        if self.speculator is not None:
            out["spec"] = self.speculator.stats()
        return out

    def close(self) -> None:
        at_exit.closed(self)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.runner.close()
        if self.speculator is not None:
            self.speculator.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the engine thread -----------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="strata-engine",
                                                daemon=True)
                self._thread.start()
                at_exit.engine_started(self)      # closed at interpreter exit if the caller did not

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.beat()
                self.step()
                if not self.stepped:
                    # a build ends unannounced
                    self._wake.wait(timeout=0.02 if self.waiting_for_programs else 0.5)
                    self._wake.clear()
        except BaseException as e:
            log.critical("the engine loop ended: %s: %s", type(e).__name__, first_line(e),
                         exc_info=True)
            self.loop_error = f"{type(e).__name__}: {first_line(e)}"
            if self.on_loop_death is not None:
                self.on_loop_death(self.loop_error)
            raise
        for s in self.slots:
            if not s.free:
                self.output.fail(s, "the engine was closed")
        self.embeds.fail_all("the engine was closed")

    def beat(self) -> None:
        """The loop is alive and moving (the worker's heartbeat reads `progress_at`)."""
        self.progress_at = time.monotonic()
