"""The engine supervisor: runs the engine in a child process, talks to it, and starts it again when
it stops.

Everything here runs on the server's event loop; no locks (a request's prepare runs on a thread,
over the prompt maker alone, which nothing writes after its load). A request goes:

    prepare   the server renders, tokenizes and checks it with its own tokenizer (serve/prompts.py,
              on a thread; a 4xx answer comes at once, even when every slot is busy)
    enqueue   it waits in *our* queue, first come first served (seats.py)
    dispatch  at most `parallel` requests are in the engine at once, one a seat (an engine slot):
              one Submit frame each, the only time a request crosses the pipe to the engine
    events    token events, then one final or error event, into the request's own asyncio.Queue
              (a Submit the engine refuses, a grammar it cannot compile: an error event, and the
              ticket's `refused` says why)

The supervisor owns what outlives one engine process: the queue and the seats (seats.Seats), the
answers awaited by id, restarts and the fault ledger; engine_process.EngineProcess owns what dies
with one. When the process ends, the supervisor logs `the engine stopped unexpectedly (exit code N).
Its last error: ...` (its ERR line from stderr, else its last log line), records it in the fault
ledger, ends each request in flight with an error event, waits (1, 2, 4 ... up to 30 s when it keeps
stopping), starts the next engine process (STRATA_ENGINE_GENERATION=1, 2, ...), and dispatches the
waiting requests to it. Requests that arrive meanwhile wait for it, each until its deadline; no wait
here is unbounded.

Bounds (docs/LIMITS.md):
- the watchdog: the engine sends a heartbeat every second saying how long ago its loop last moved (a
  program build counts as moving). While requests are in the engine, an engine that is silent
  (stopped, SIGSTOP) or whose loop has not moved for `stall_s` (--engine-stall-s) is killed: the
  stall goes in the fault ledger, the requests in flight end with an error, the queued ones go to
  the next engine. /health is 503 as soon as the engine is silent for SILENT_S or its loop is stuck.
- the queue: at most `max_queue` (--max-queue) requests wait here (being prepared or queued for a
  seat); one more is answered 503 with Retry-After at once.
- the pipe: at most MAX_UNREAD_BYTES written to the engine and not yet read by it; beyond that new
  prompts wait in the queue (and questions are answered 503), so a stopped engine cannot make the
  server's memory grow.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config import EngineConfig
from ...engine.request import Event
from ..errors import ApiError
from ..params import RequestParams
from ..prompts import Prepared, Prompts
from ..protocol import (
    Answer,
    AnyReply,
    Beat,
    Cancel,
    Command,
    EventFrame,
    GetStats,
    Progress,
    Ready,
    Rejected,
    Saved,
    SaveExpertProfile,
    Start,
    Stats,
    Submit,
)
from . import questions
from .answers import Answers, expect
from .engine_process import MAX_UNREAD_BYTES, EngineProcess, StderrTail
from .ledger import Fault, FaultLedger
from .seats import Seats
from .tickets import EngineGone, Ticket, rejection

__all__ = ["MAX_UNREAD_BYTES", "Prepared", "StderrTail", "Supervisor", "Ticket"]

log = logging.getLogger("strata_jax.serve")


class Supervisor:
    def __init__(self, model: str | Path, config: EngineConfig, *, console: Any = None,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, stable_after_s: float = 60.0,
                 on_fault: Callable[[Fault], None] | None = None, command: list[str] | None = None,
                 max_queue: int = 256, stall_s: float = 60.0, chat_template: str | None = None,
                 template_vars: dict | None = None, prefill_assistant: bool = False,
                 template_dates: bool = False, reasoning_budget: int = -1,
                 prompts: Prompts | None = None):
        self.model = str(model)
        self.config = config
        self.console = console
        # the wait after a first stop; doubled each stop in a row
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.on_fault = on_fault
        # the watchdog's patience with an engine that has work
        self.stall_s = stall_s
        # the engine process; tests may put a mock engine that speaks the same frames here
        self.command = command or [sys.executable, "-m", "strata_jax.serve.worker.worker"]
        # --chat-template(-file)'s text, or None: the model's
        self.chat_template = chat_template
        # the server's own prompt maker (serve/prompts.py): loaded from the model's file when the
        # first engine is ready (the engine has read the file by then), kept across restarts; the
        # options are --reasoning's template variables, --prefill-assistant, --llama-conventions'
        # dates, --reasoning-budget. Tests of the mock engine give their own.
        self.prompts = prompts
        self._prompt_options = {"template_vars": template_vars or {},
                                "prefill": prefill_assistant, "dates": template_dates,
                                "reasoning_budget": reasoning_budget}
        self.ledger = FaultLedger()
        self.state = "loading"                  # loading | ready | restarting | stopping
        # why it is not ready, as /health and requests' errors say it: fixed phrases, no log text
        # (ledger.py)
        self.reason = "loading the model"
        self.generation = 0
        self.restarts = 0
        self.info: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self.tail = StderrTail()                    # the current (or last) engine process's stderr
        self.seats = Seats(config.parallel, max_queue)
        self._engine: EngineProcess | None = None
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loading: asyncio.Task | None = None       # the prompt maker's load (_load_prompts)
        self.answers = Answers(self._send)         # commands waiting for the engine's reply, by id
        self._ids = itertools.count(1)
        self._crashes = 0
        self._ready_at = 0.0

    # ---- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="strata-supervisor")

    async def stop(self, timeout: float = 10.0) -> None:
        self.state, self.reason = "stopping", "the server is shutting down"
        self._stopped.set()
        if self._engine is not None:
            await self._engine.stop(timeout, reading=self._ready.is_set())
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        for t in self.running + list(self.seats.queue):
            self._end(t, Event("error", error="the server is shutting down"))

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def running(self) -> list[Ticket]:
        return self.seats.running

    @property
    def queued(self) -> int:
        return len(self.seats.queue)

    async def _run(self) -> None:
        while not self._stopped.is_set():
            self.generation += 1
            gen, t0 = self.generation, time.monotonic()
            if self.state != "restarting":
                self.state, self.reason = "loading", "loading the model"
            engine = EngineProcess(self.command, gen, self._on_frame, lambda: len(self.running),
                                   self.stall_s)
            self._engine, self.tail = engine, engine.tail
            rc = await engine.run(Start(self.model, self.config.to_dict(), self.chat_template))
            if self._stopped.is_set():
                break
            self._on_exit(gen, rc, time.monotonic() - t0, engine.stall)
            try:
                await asyncio.wait_for(self._stopped.wait(), self.ledger.last.restart_in_s)
            except TimeoutError:
                pass

    def _on_exit(self, gen: int, rc: int | None, uptime: float, stall: str | None) -> None:
        was_ready = self.state == "ready"
        # first: nothing may be dispatched to the dead process
        self.state = "restarting"
        self._ready.clear()
        stable = was_ready and time.monotonic() - self._ready_at >= self.stable_after_s
        self._crashes = 1 if stable else self._crashes + 1
        delay = min(self.max_backoff_s, self.backoff_s * 2.0 ** (self._crashes - 1))
        tail = self.tail
        running = self.running
        fault = Fault(gen, rc, tail.error_line or tail.last_line or "(it printed nothing)",
                      tail.error_line,
                      len(running), [t.id for t in running], round(uptime, 3), was_ready, delay,
                      list(tail.lines)[-20:], "stall" if stall else "exit", stall)
        self.ledger.add(fault)
        self.restarts += 1
        log.error("%s", fault.message)             # the log has the line; answers have fault.public
        message = f"{fault.public}. This request was in flight and did not finish; please retry it"
        for t in running:
            self._end(t, Event("error", error=message))
        self.answers.fail_all(fault.public)
        again = (f"starting engine process {gen + 1} in {delay:g} s "
                 f"({self._crashes} stop{'s' if self._crashes > 1 else ''} in a row)")
        self.reason = (f"{fault.public}. {again[0].upper()}{again[1:]}; GET /faults has its last "
                       "lines")
        log.warning("%s", again)
        if self.on_fault is not None:
            self.on_fault(fault)

    # ---- the engine's frames ---------------------------------------------------------------------

    def stalled(self) -> tuple[str, float] | None:
        """(what is wrong, for how many seconds) when the engine is silent or its loop does not
        move."""
        return self._engine.stalled() if self._engine is not None else None

    def _on_frame(self, frame: AnyReply) -> None:
        match frame:
            case Beat():
                self._dispatch()                    # prompts held back by a full pipe go now
            case EventFrame(id=rid, event=ev):
                t = self.seats.seat_of(rid)
                if t is None:
                    return
                if ev.kind == "token":
                    t.n_tokens += 1
                    t.token_came(time.monotonic())
                    t.put(ev)
                elif ev.kind == "progress":         # the prompt read so far (return_progress)
                    t.put(ev)
                else:
                    self._end(t, ev)
            case Rejected(id=rid) if self.seats.seat_of(rid) is not None:
                self._refused(self.seats.seat_of(rid), frame)
            case Rejected() | Stats() | Saved() | Answer():
                self.answers.came(frame)
            case Progress(stage=stage, n=n, total=total):
                self.reason = f"loading the model: {stage} {n}/{total}"
                if self.state == "restarting":
                    self.reason = f"restarting after an engine fault; {self.reason}"
                if self.console is not None:
                    self.console.progress(self.generation, stage, n, total)
            case Ready(info=info):
                self.info = info
                if self.prompts is None:
                    # (held: the loop keeps only a weak reference to a task)
                    self._loading = asyncio.create_task(self._load_prompts(self.generation))
                else:
                    self._now_ready()

    async def _load_prompts(self, gen: int) -> None:
        """The server's tokenizer and template, read from the model's file off the event loop (a
        large vocabulary takes a second); the engine is ready once they are."""
        try:
            self.prompts = await asyncio.to_thread(Prompts.load, self.model,
                                                   self.config.max_context, self.chat_template,
                                                   **self._prompt_options)
        except Exception as e:      # (the engine read the same file) said, and tried at the next
            log.exception("the server could not read the model's tokenizer")
            self.reason = f"the server could not read the model's tokenizer: {type(e).__name__}"
            return
        if gen == self.generation and self.state != "stopping":
            self._now_ready()

    def _now_ready(self) -> None:
        self.state, self.reason = "ready", "ready"
        self._ready_at = time.monotonic()
        self._ready.set()
        if self.console is not None:
            self.console.ready(self.generation, self.info)
        self._dispatch()

    # ---- writing to the engine -------------------------------------------------------------------

    def _send(self, cmd: Command) -> bool:
        return self._engine.send(cmd) if self._engine is not None else False

    def _unread(self) -> int:
        return self._engine.unread() if self._engine is not None else 0

    # ---- requests --------------------------------------------------------------------------------

    async def wait_ready(self, deadline: float) -> None:
        if self.ready:
            return
        try:
            await asyncio.wait_for(self._ready.wait(), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise ApiError(503, f"the engine is not ready ({self.state}: {self.reason}), and the "
                                f"request's deadline ({self.config.request_timeout_s:g} s, "
                                "--request-timeout-s) has passed",
                           "unavailable_error") from None

    async def prepare(self, rid: str, prompt: Any, params: RequestParams,
                      chat_template_kwargs: dict | None, deadline: float, text: bool = False,
                      places: int = 1) -> Prepared:
        """Render, tokenize and check a request (serve/prompts.py, on a thread) -> Prepared, or
        ApiError (4xx for bad requests, 503 when no engine is ready before the deadline). text: the
        prompt's text comes back too. places: its n choices, each a place in the queue (enqueue's
        `holds` keeps them)."""
        return await self._with_prompts(places, "prepare", prompt, params, chat_template_kwargs,
                                        text, deadline=deadline)

    async def apply_template(self, messages: list, params: RequestParams,
                             chat_template_kwargs: dict | None, deadline: float) -> str:
        """llama.cpp's /apply-template: the text a chat renders to, as prepare renders it (a place
        in the queue while it does, as a request's prepare)."""
        return await self._with_prompts(1, "apply_template", messages, params,
                                        chat_template_kwargs, deadline=deadline)

    async def _with_prompts(self, places: int, method: str, *args: Any, deadline: float) -> Any:
        """The prompt maker's `method` on a thread, once an engine is ready to take what it makes (a
        request that comes while the engine starts or restarts waits, and is told why at its
        deadline), holding `places` in the queue meanwhile (503 at once beyond --max-queue:
        seats.py)."""
        self.seats.admit(places)
        with self.seats.preparing(places):
            await self.wait_ready(deadline)
            assert self.prompts is not None
            return await asyncio.to_thread(getattr(self.prompts, method), *args)

    def enqueue(self, rid: str, prepared: Prepared, params: RequestParams, deadline: float,
                holds: int = 0) -> Ticket:
        """A prepared request into the queue -> its ticket; holds: queue places the ticket keeps for
        its request's later choices (seats.py). params: the request's, for what the engine gets
        beside the prepared ids and sampling (progress, cache_salt)."""
        submit = Submit(rid, prepared.ids, prepared.sampling, params.progress, params.cache_salt,
                        prepared.checkpoint_at)
        t = Ticket(rid, submit, deadline, holds=holds)
        self.seats.enqueue(t)
        self._dispatch()
        return t

    def cancel(self, t: Ticket) -> None:
        """The caller is gone (or out of time): free its place. The engine frees a slot at its next
        window, and says so with a final "cancelled" event, which frees the seat."""
        if self.seats.withdraw(t) and t.generation == self.generation:
            self._send(Cancel(t.id))

    def _dispatch(self) -> None:
        if self.ready:
            self.seats.dispatch(self._submit, self.generation)

    def _submit(self, t: Ticket) -> None:
        self._send(t.submit)                # EngineBusy: the pipe is full (Seats.dispatch)

    def _end(self, t: Ticket, ev: Event) -> None:
        self.seats.end(t, ev)
        self._dispatch()

    def _refused(self, t: Ticket, reply: Rejected) -> None:
        """The engine refused a submit (a grammar it cannot compile): the ticket ends with an error
        event, and keeps the refusal as the API's error (generate.start answers it)."""
        t.refuse(rejection(reply))
        self._end(t, Event("error", error=reply.message))

    # ---- what the routes show --------------------------------------------------------------------

    async def stats(self, timeout: float = 2.0) -> dict[str, Any]:
        """The engine's stats (programs, memory, counters); the last known ones when it does not
        answer."""
        if self.ready:
            try:
                reply = await self.answers.ask(GetStats(f"stats-{next(self._ids)}"),
                                               time.monotonic() + timeout)
                if isinstance(reply, Stats):
                    self.last_stats = reply.stats
            except (TimeoutError, EngineGone):
                pass
        return self.last_stats

    async def ask(self, kind: type[Command], timeout: float = 30.0, **fields: Any) -> Answer:
        """A question for the engine (serve/supervisor/questions.py: admitted as a request is, 503s
        when it cannot be answered): `kind` (Tokenize, Detokenize, SlotAction, Embed)
        made with `fields` and an id of its own -> its Answer; the engine's refusal as its
        ApiError."""
        cmd = kind(id=f"{kind.__struct_config__.tag}-{next(self._ids)}", **fields)
        return await questions.ask(self, cmd, timeout, self._send)

    async def save_expert_profile(self, path: str, timeout: float = 30.0) -> Saved:
        """Have the engine process write its expert profile to `path` (a file in the server's own
        --expert-profile-dir, made by the app from a checked name; never a path a request named)
        -> Saved (path, routed)."""
        if not self.ready:
            raise ApiError(503, f"the engine is not ready ({self.state}: {self.reason})",
                           "unavailable_error")
        cmd = SaveExpertProfile(f"profile-{next(self._ids)}", path)
        try:
            reply = await self.answers.ask(cmd, time.monotonic() + timeout)
        except (TimeoutError, EngineGone):
            raise ApiError(503, "the engine did not write the expert profile in time",
                           "unavailable_error") from None
        return expect(reply, Saved)

    def slots(self) -> list[dict[str, Any]]:
        return self.seats.slots(self.config.max_context)

    def health(self) -> tuple[bool, dict[str, Any]]:
        stall = self.stalled() if self.ready else None
        ok = self.ready and stall is None
        body: dict[str, Any] = {"status": "ok" if ok else ("stalled" if stall else self.state),
                                "generation": self.generation, "restarts": self.restarts,
                                "slots_idle": self.seats.free,
                                "slots_processing": len(self.running), "queued": self.queued}
        if not ok:
            reason = f"the engine {stall[0]} for {stall[1]:.1f} s" if stall else self.reason
            body["reason"] = reason
            body["error"] = {"message": reason, "type": "unavailable_error", "code": 503}
        return ok, body
