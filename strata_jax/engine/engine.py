"""The Engine: requests in, tokens out, slots decoding together in batch windows.

Threads and queues: callers (any thread) `submit` requests into `inbox` and read events from their
request's own queue. One engine thread owns everything else (slots, runner, programs): it moves requests
from the inbox to free slots first come first served, plans a window over the slots that have work,
runs it, and turns the sampled tokens into events. So the device is only ever touched from one thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import compile_cache
from ..config import EngineConfig
from ..experts import ExpertCounters, resident_line
from ..gguf import GGUFModel, load_tokenizer
from .constrain import Grammars
from .controls import wants_controls
from .memory import is_resource_exhausted
from .prefix_cache import PrefixCache
from .request import (
    ContextOverflowError,
    Event,
    Handle,
    Request,
    RequestError,
    make_params,
)
from .runner import GroupInput, ModelRunner
from .sampler import SamplingRows
from .scheduler import Scheduler, Window, bucket
from .slots import Slot
from .spec import make_speculator

log = logging.getLogger("strata_jax.engine")


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, model: GGUFModel, config: EngineConfig | None = None, progress: bool = False,
                 expert_policy: str | None = None):
        """expert_policy: overrides config.expert_policy ("freq" or "lru"), the device expert cache's
        eviction policy; it matters only when the experts do not all sit on the device."""
        self.config = config or EngineConfig()
        if expert_policy is not None:
            self.config = replace(self.config, expert_policy=expert_policy)     # validated again
        self.model = model
        self.spec = model.spec
        self.tokenizer = load_tokenizer(model.metadata)
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size)     # structured output (constrain.py)
        compile_cache.enable(self.config.compile_cache)     # before the first program: serve, generate, bench, Python
        self.runner = ModelRunner(model, self.config, progress)
        if self.config.warmup:
            self.runner.warmup(progress=progress)
        self.slots = [Slot(i) for i in range(self.config.parallel)]
        self.prefix = PrefixCache(self.runner, self.config)      # which slot a request takes, and what it reuses
        self.scheduler = Scheduler(self.runner.choices["prefill"], self.runner.min_rows,
                                   self.runner.choices["batch_tokens"], self.runner.packed)
        self.speculator = make_speculator(self.config, model, self.runner)      # None without --spec
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.waiting: deque[Request] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.progress_at = time.monotonic()     # last sign of life of the loop (heartbeat)
        self.loop_error: str | None = None       # why the loop thread ended, if it did
        self.on_loop_death = None                # called with that reason (the worker exits the process)
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "cancelled": 0, "prompt_tokens": 0,
                         "generated_tokens": 0, "windows": 0, "window_rows": 0, "prompt_rows": 0,
                         "multi_prompt_windows": 0, "narrowed_windows": 0, "split_windows": 0}

    @classmethod
    def from_gguf(cls, path: str | Path, config: EngineConfig | None = None, progress: bool = False,
                  expert_policy: str | None = None) -> Engine:
        return cls(GGUFModel.open(path), config, progress, expert_policy)

    # ---- the caller's side ----------------------------------------------------------------------------

    def submit(self, prompt: str | list[dict] | list[int], *, max_tokens: int = 256, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: list[str] | tuple[str, ...] | str | None = None, ignore_eos: bool = False,
               chat_template_kwargs: dict | None = None, logit_bias: dict | None = None,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
               repeat_last_n: int = 64, logprobs: int | None = None, grammar: tuple | None = None) -> Handle:
        """Queue a request: text (a plain completion), a list of chat messages, or token ids. The sampling
        controls and logprobs are controls.py's (token events then carry `logprob` and `top_logprobs`);
        grammar: (kind, text) constrains the output (constrain.py: a JSON schema's text, "json_object", a GBNF,
        Lark or regex grammar); RequestError when it cannot be compiled."""
        params = make_params(max_tokens, temperature, top_k, top_p, min_p, seed, stop, ignore_eos, logit_bias,
                             presence_penalty, frequency_penalty, repeat_penalty, repeat_last_n, logprobs, grammar)
        params.validate(self.spec.vocab_size)
        ids = self.prompt_ids(prompt, chat_template_kwargs)
        n_ctx = self.config.max_context
        if len(ids) + max_tokens > n_ctx:
            raise ContextOverflowError(len(ids), max_tokens, n_ctx)
        req = Request(ids, params)
        if params.grammar is not None:        # compiled here, in the caller's thread, not on the engine's
            req.constraint = self.grammars.constraint(params.grammar)
        req.deadline = req.arrived + self.config.request_timeout_s
        self._ensure_thread()
        self.inbox.put(req)
        self._wake.set()
        return Handle(req, self._wake.set)

    def prompt_ids(self, prompt, chat_template_kwargs: dict | None = None) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.spec.vocab_size - 1})")
        elif isinstance(prompt, list) and prompt:
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **(chat_template_kwargs or {}))
            bos = self.tokenizer.bos_token
            ids = self.tokenizer.encode(text, add_special=not (bos and text.startswith(bos)))
        else:
            raise RequestError("prompt must be a non-empty string, list of chat messages, or list of token ids")
        if not ids:
            raise RequestError("the prompt is empty after tokenization")
        return ids

    def chat_text_ids(self, text: str) -> list[int]:
        """The ids of a chat already rendered to `text` (the server renders once, and reads the text too):
        as prompt_ids does for a chat, BOS is added unless the template wrote it."""
        bos = self.tokenizer.bos_token
        ids = self.tokenizer.encode(text, add_special=not (bos and text.startswith(bos)))
        if not ids:
            raise RequestError("the prompt is empty after tokenization")
        return ids

    def stream(self, prompt, **kwargs) -> Iterator[Event]:
        handle = self.submit(prompt, **kwargs)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()

    def wait_for_programs(self, timeout: float = 600.0) -> bool:
        """Wait until the builder thread has built every queued program (benchmarks: no compile beside
        what they time) -> whether it did within the timeout."""
        self._ensure_thread()
        end = time.monotonic() + timeout
        while self.runner.programs.pending:           # queued, or compiled and not yet taken in by the loop
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
        """float32 [T, vocab] for the given tokens, no sampling (research and checks). Runs on a slot of
        its own between windows, so it never disturbs requests in flight."""
        return self._ask_engine_thread("logits", token_ids)

    def logits_reusing(self, token_ids: list[int]) -> tuple[int, np.ndarray]:
        """Like logits, but on a free slot through the prefix cache, as a request would read the prompt:
        -> (tokens reused, float32 [T - reused, vocab] for the tokens read). The slot keeps the KV."""
        return self._ask_engine_thread("logits_reusing", token_ids)

    def _ask_engine_thread(self, kind: str, token_ids: list[int]):
        """Run a logits job on the engine thread (which alone touches the device) and wait for its answer."""
        ids = self.prompt_ids([int(t) for t in token_ids])
        if len(ids) > self.config.max_context:
            raise ContextOverflowError(len(ids), 0, self.config.max_context)
        done: queue.Queue = queue.Queue()
        self._ensure_thread()
        self.inbox.put((kind, ids, done))       # type: ignore[arg-type]
        self._wake.set()
        out = done.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def save_expert_profile(self, path: str | Path, private_dir: bool = False) -> dict[str, Any]:
        """Write the expert profile (how often live traffic routed to each (MoE layer, expert) since start;
        see experts/profile.py) to `path`, for `--expert-profile` to preload and pin at a later start.
        Returns {"path", "routed"}. The file is written in the caller's thread (atomically, mode 0o600),
        never on the engine thread; private_dir: create its directory 0o700 if missing."""
        prof = self.expert_profile()
        prof.save(path, private_dir=private_dir)
        routed = int(prof.counts.sum())
        log.info("expert profile: %d routed token-expert pairs since start written to %s", routed, path)
        return {"path": str(path), "routed": routed}

    def expert_profile(self):
        """A copy of the expert profile's counts (an ExpertProfile), taken on the engine thread between
        windows; ValueError for a model without experts."""
        done: queue.Queue = queue.Queue()
        self._ensure_thread()
        self.inbox.put(("profile", done))       # type: ignore[arg-type]
        self._wake.set()
        out = done.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def between_windows(self, fn):
        """fn() run on the engine thread between windows (slots and the KV cache hold still) -> its result."""
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
        out = {**dict(self.counters), **self.runner.stats(), "slots": self.config.parallel, "busy_slots": busy,
               "queued": self.inbox.qsize() + len(self.waiting), "prefix_cache": self.prefix.stats(),
               "kv_used_positions": sum(s.n_past for s in self.slots if not s.free)}     # KV usage (/metrics)
        if self.speculator is not None:
            out["spec"] = self.speculator.stats()
        return out

    def close(self) -> None:
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

    # ---- the engine thread ----------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.beat()
                if not self._iteration():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:
            log.critical("the engine loop ended: %s: %s", type(e).__name__, _first_line(e), exc_info=True)
            self.loop_error = f"{type(e).__name__}: {_first_line(e)}"
            if self.on_loop_death is not None:
                self.on_loop_death(self.loop_error)
            raise
        for s in self.slots:
            if not s.free:
                self._fail(s, "the engine was closed")

    def beat(self) -> None:
        """The loop is alive and moving (the worker's heartbeat reads `progress_at`)."""
        self.progress_at = time.monotonic()

    def _iteration(self) -> bool:
        """Take new requests, plan one window and run it -> whether there was a window. A failure anywhere
        here ends the requests it concerns with an error (all busy slots when it cannot tell which), and the
        loop goes on: no request can stop the engine."""
        stage = "admitting requests"
        try:
            self.runner.programs.collect()             # programs the builder thread finished
            self._take_new()
            self._check_cancelled()
            stage = "planning a window"
            window = self._plan()
            if window is None:
                return False
            self.runner.faults.on_plan()
            stage = "running a window"
            self._run(window)
            return True
        except Exception as e:
            log.exception("the engine failed while %s", stage)
            for s in self.slots:
                if not s.free:
                    self._fail(s, f"the engine failed while {stage}: {type(e).__name__}: {_first_line(e)}")
            if self.runner.cache_lost():
                self._lose_cache(e)
            return True

    def _plan(self) -> Window | None:
        w = self._plan_full()
        return None if w is None else self._ready_window(w)

    def _ready_window(self, w: Window) -> Window:
        """A window whose programs are built: w, or while w's are built off this thread (so that a layout met
        for the first time stalls no one), the largest smaller one that is: w's decode rows with its first
        prompt chunk (as it is, then padded to a whole chunk), then its decode rows alone. With none of them
        built, w waits for its programs. Without the warm-up (--no-warmup: tests, quick starts) every layout is
        built when first met, on this thread, as the window waits: the same windows run whatever the timing."""
        layout = self.runner.layout_of(w.groups, w.kv_needed)
        if not self.config.warmup or self.runner.ready(layout) or self.runner.refused(layout):
            return w                      # refused: its run is refused at once, and the window split
        self.runner.build_later(layout)
        tries = [(1, False, True), (1, True, True), (0, False, True), (1, True, False), (0, False, False)]
        for prompts, pad, drafts in tries:
            if (prompts and not w.prefills) or (not drafts and w.drafts is None):
                continue
            small = self.scheduler.narrow(w, prompts, pad, drafts)
            if small is not None and self.runner.ready(self.runner.layout_of(small.groups, small.kv_needed)):
                self.scheduler.took(w, small)
                if w.drafts is not None and small.drafts is None:
                    for s in w.decode:                    # their drafts were not verified
                        self.speculator.reset(s)
                self.counters["narrowed_windows"] += 1
                return small
        return w

    def _plan_full(self) -> Window | None:
        if self.speculator is None:
            return self.scheduler.plan(self.slots)
        decoding = [s for s in self.slots if s.decoding]
        limit = self.config.spec_max_rows
        # a verify window of many rows costs more than it saves; a row with sampling controls or logprobs
        # (controls.py) is sampled by the controlled program, which verify windows do not run
        if (limit and len(decoding) > limit) or any(wants_controls(s.request.params) for s in decoding):
            return self.scheduler.plan(self.slots)
        try:
            drafts = self.speculator.propose(decoding)
        except Exception as e:  # noqa: BLE001 - a drafter's failure costs drafts, never the requests
            log.warning("the drafter failed (%s): this window runs without drafts", _first_line(e))
            if self._drafter_failed(decoding, e):
                return None
            drafts = {}
        return self.scheduler.plan(self.slots, drafts, self.speculator.verify_len)

    def _take_new(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple) and item[0] == "profile":
                self._save_profile(*item[1:])
            elif isinstance(item, tuple) and item[0] == "call":       # between_windows: fn(), answered to `done`
                try:
                    item[2].put(item[1]())
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    item[2].put(e)
            elif isinstance(item, tuple):
                (self._run_logits if item[0] == "logits" else self._run_logits_reusing)(*item[1:])
            else:
                self.waiting.append(item)
                self.counters["requests"] += 1
        while self.waiting:
            free = [s for s in self.slots if s.free]
            if not free:
                break
            req = self.waiting.popleft()
            if req.cancelled.is_set():
                self._finish_unslotted(req, "cancelled")
                continue
            req.t_start = time.monotonic()
            placed = self._place(req.prompt, free, [s for s in self.slots if not s.free])
            if placed is None:
                req.events.put(Event("error", error="the prefix cache failed to place the request (see the log)"))
                continue
            slot, req.reused = placed
            try:
                slot.assign(req, self.tokenizer.stream_decoder(), req.reused)
                if self.speculator is not None:
                    self.speculator.reset(slot)
            except Exception as e:
                log.exception("request %d could not start", req.id)
                slot.release(keep=False)
                self.counters["failed"] += 1
                req.events.put(Event("error", error=f"the engine could not start the request: "
                                                    f"{type(e).__name__}: {_first_line(e)}"))

    def _place(self, prompt: list[int], free: list[Slot], busy: list[Slot] = ()) -> tuple[Slot, int] | None:
        """The prefix cache's choice of slot (and its stores, restores and forks); None if that failed."""
        try:
            return self.prefix.place(prompt, free, busy)
        except Exception as e:  # noqa: BLE001 - a failed copy must not take the engine down
            log.error("the prefix cache failed to place a request: %s", e)
            if self.runner.cache_lost():
                self._lose_cache(e)
            for s in free:
                s.forget()
            return None

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        for s in self.slots:
            if s.free:
                continue
            if s.request.cancelled.is_set():
                self._finish(s, "cancelled")
            elif now > s.request.deadline:
                self._fail(s, f"the request passed its deadline ({self.config.request_timeout_s:.0f} s)")
        for req in list(self.waiting):
            if req.cancelled.is_set():
                self.waiting.remove(req)
                self._finish_unslotted(req, "cancelled")
            elif now > req.deadline:
                self.waiting.remove(req)
                req.events.put(Event("error", error="the request waited for a slot past its deadline"))

    def _run(self, w: Window) -> None:
        """Run a window; if it runs out of device memory even after the program cache freed half its
        programs, run its rows in smaller windows. Only a row that fails alone ends with an error."""
        try:
            outs = self.runner.run(w.groups, w.kv_needed)
        except Exception as e:  # noqa: BLE001 - every failure is reported to the requests, never lost
            self._recover(w, e)
            return
        self.counters["windows"] += 1
        self.counters["window_rows"] += len(w.rows)
        self.counters["prompt_rows"] += len(w.prefills)
        self.counters["multi_prompt_windows"] += len(w.prefills) > 1
        if self.runner.stepper is not None:               # expert-tier counters, per request too
            for s in w.rows:
                if not s.free:
                    if s.request.experts is None:
                        s.request.experts = ExpertCounters()
                    s.request.experts.add(self.runner.stepper.last)
        self._apply(w, outs)
        if self.speculator is not None and self.runner.last_hiddens is not None:
            self._after_window(w)

    def _after_window(self, w: Window) -> None:
        """Hand the window's hidden states to the drafter (mtp). A failure there costs drafts, not requests."""
        try:
            self.speculator.after_window(w, self.runner.last_hiddens)
        except Exception as e:  # noqa: BLE001 - the window's tokens are out; only drafting is affected
            log.warning("the drafter failed after window %s (%s): no drafts for its slots until their next window",
                        self._describe(w), _first_line(e))
            self._drafter_failed(w.rows, e)
        finally:
            self.runner.last_hiddens = None

    def _drafter_failed(self, slots: list[Slot], e: Exception) -> bool:
        """Forget the slots' pending drafts; if the failure took the KV cache, end the requests in flight
        (-> True)."""
        for s in slots:
            self.speculator.reset(s)
        if self.runner.cache_lost():
            self._lose_cache(e)
            return True
        return False

    def _recover(self, w: Window, e: Exception) -> None:
        if self.runner.cache_lost():
            log.error("a window failed and took the KV cache with it (%s); ending the requests in flight", e)
            self._lose_cache(e)
            return
        rows = w.rows
        if not is_resource_exhausted(e) or len(rows) <= 1:
            for s in rows:
                self._fail(s, f"window {self._describe(w)} failed: {e}")
            return
        self.counters["split_windows"] += 1
        log.warning("window %s failed (%s): running its rows in smaller windows", self._describe(w), _first_line(e))
        parts = [w.decode[: len(w.decode) // 2], w.decode[len(w.decode) // 2:]] if len(w.decode) > 1 else [w.decode]
        for part in parts:
            if part:
                self._run(self.scheduler.window_of(part, [], []))
        for p, c in zip(w.prefills, w.chunks):              # each prompt chunk alone
            if not p.free:
                self._run(self.scheduler.window_of([], [p], [c]))

    def _lose_cache(self, e: Exception) -> None:
        self.runner.reset_cache()
        for s in self.slots:
            if not s.free:
                self._fail(s, f"the engine's KV cache was lost in a failed window: {e}")
            s.forget()                                  # the kept KV of free slots went with it

    def _describe(self, w: Window) -> str:
        return str(self.runner.layout_of(w.groups, w.kv_needed))

    def _apply(self, w: Window, outs: list[np.ndarray]) -> None:
        if w.packed:
            self._apply_packed(w, outs[0])
            return
        k = 0
        if w.drafts is not None:
            k += 1
            self._apply_verify(w, *outs[0])
        elif w.decode:
            toks = outs[k]
            k += 1
            for i, s in enumerate(w.decode):
                if s.free:
                    continue
                s.n_past += 1
                self._emit(s, int(toks[i]), self._logprobs(k - 1, i))
        for i, (s, c) in enumerate(zip(w.prefills, w.chunks)):
            if s.free:
                continue
            s.n_past += c
            if not s.reading:                          # the prompt is read: its last logits gave a token
                s.request.t_first = time.monotonic()
                self._emit(s, int(outs[k][i]), self._logprobs(k, i))

    def _apply_packed(self, w: Window, toks: np.ndarray) -> None:
        """A packed window's tokens: the decode rows' in order, then each ending prompt's (scheduler.packed_group)."""
        for i, s in enumerate(w.decode):
            if not s.free:
                s.n_past += 1
                self._emit(s, int(toks[i]), self._logprobs(0, i))
        j = len(w.decode)
        for s, c, end in zip(w.prefills, w.chunks, w.ends):
            if not s.free:
                s.n_past += c
                if end:                                # the prompt is read: its last logits gave a token
                    s.request.t_first = time.monotonic()
                    self._emit(s, int(toks[j]), self._logprobs(0, j))
            j += end

    def _apply_verify(self, w: Window, toks: np.ndarray, n_acc: np.ndarray) -> None:
        """Each slot emits its accepted drafts and the token after them (toks [R, 1+N], n_acc [R]), one by
        one: a finish inside the run (stop string, EOS, max_tokens) ends it there. The KV written for the
        rejected drafts stays behind n_past, where the next window overwrites it."""
        self.speculator.counters.verify_windows += 1
        for i, (s, d) in enumerate(zip(w.decode, w.drafts)):
            if s.free:
                continue
            self.speculator.record(s.request, len(d), int(n_acc[i]))
            for t in toks[i, :int(n_acc[i]) + 1]:
                s.n_past += 1
                self._emit(s, int(t))
                if s.free:
                    break

    def _logprobs(self, group: int, row: int):
        """The window's logprobs of a group's row (the controlled program's), or None."""
        lp = self.runner.last_logprobs
        got = lp[group] if group < len(lp) else None
        return None if got is None else tuple(a[row] for a in got)

    def _emit(self, s: Slot, token: int, logprobs=None) -> None:
        """Hand a sampled token to its request; a failure here ends that request alone."""
        if token < 0:                                   # the sampler's mark for NaN or inf logits
            self._fail(s, "the model's logits were NaN or inf at this position (the weights or the activations "
                          "overflowed): the request cannot go on")
            return
        try:
            self._emit_token(s, token, logprobs)
        except Exception as e:
            log.exception("request %d: its token %d could not be handled", s.request.id, token)
            self._fail(s, f"the engine could not handle token {token}: {type(e).__name__}: {_first_line(e)}")

    def _emit_token(self, s: Slot, token: int, logprobs=None) -> None:
        req = s.request
        s.tokens.append(token)
        refused = req.constraint.advance(token) if req.constraint is not None else None
        if refused:
            self._fail(s, f"the grammar cannot go on after token {token}: {refused}")
            return
        n_gen = len(s.tokens) - len(req.prompt)
        eos = self.tokenizer.is_eos(token) and not req.params.ignore_eos
        if not eos:
            s.text += s.decoder.add(token)
        stop_at = s.stops.find(s.text)
        if stop_at is not None:
            s.stopping_word = next((w for w in req.params.stop if s.text.startswith(w, stop_at)), "")
            s.text = s.text[:stop_at]
            self._send_text(s, token, len(s.text), logprobs)
            self._finish(s, "stop")
            return
        if eos:
            self._finish(s, "stop")
            return
        if req.constraint is not None and req.constraint.done:    # the grammar is complete
            self._send_text(s, token, len(s.text), logprobs)
            self._finish(s, "stop")
            return
        self._send_text(s, token, len(s.text) - s.stops.held(s.text), logprobs)
        if n_gen >= req.params.max_tokens or s.n_past + 1 >= self.runner.cache_len:
            self._finish(s, "length")

    def _send_text(self, s: Slot, token: int, upto: int, logprobs=None) -> None:
        upto = max(upto, s.emitted)
        ev = Event("token", text=s.text[s.emitted:upto], token=token)
        n = s.request.params.logprobs
        if logprobs is not None and n is not None:     # (logprob, top ids, top logprobs): controls.py
            ev.logprob = float(logprobs[0])
            ev.top_logprobs = [(int(t), float(v)) for t, v in zip(logprobs[1][:n], logprobs[2][:n])]
        s.request.events.put(ev)
        s.emitted = upto

    def _finish(self, s: Slot, reason: str) -> None:
        req = s.request
        if reason != "cancelled" and s.decoder is not None:
            s.text += s.decoder.flush() if reason == "length" else ""
        tail = s.text[s.emitted:] if reason != "cancelled" else ""
        req.t_end = time.monotonic()
        stats = self._request_stats(s)
        self.counters["finished" if reason != "cancelled" else "cancelled"] += 1
        self.counters["prompt_tokens"] += len(req.prompt)
        self.counters["generated_tokens"] += stats["generated_tokens"]
        log.info("%s", stats["log_line"])
        for line in stats.get("expert_lines", ()):
            log.info("%s", line)
        req.events.put(Event("final", text=tail, stats=stats, finish_reason=reason))
        s.release()

    def _fail(self, s: Slot, message: str) -> None:
        self.counters["failed"] += 1
        log.error("request %d failed: %s", s.request.id, message)
        s.request.events.put(Event("error", error=message))
        s.release(keep=False)

    def _finish_unslotted(self, req: Request, reason: str) -> None:
        self.counters["cancelled"] += 1
        req.events.put(Event("final", stats={"prompt_tokens": len(req.prompt), "generated_tokens": 0},
                             finish_reason=reason))

    def _request_stats(self, s: Slot) -> dict[str, Any]:
        req = s.request
        n_prompt, n_gen = len(req.prompt), len(s.tokens) - len(req.prompt)
        t_first = req.t_first or req.t_end
        read_s = max(t_first - req.t_start, 1e-9)
        gen_s = max(req.t_end - t_first, 1e-9)
        read = n_prompt - req.reused
        line = (f"prompt {n_prompt} tokens = {req.reused} reused + {read} read in {read_s * 1000:.0f} ms "
                f"({read / read_s:.1f} tok/s), {n_gen} generated in {gen_s * 1000:.0f} ms "
                f"({max(n_gen - 1, 0) / gen_s:.1f} tok/s)")
        out = {"prompt_tokens": n_prompt, "reused_tokens": req.reused, "generated_tokens": n_gen,
               "queue_ms": (req.t_start - req.arrived) * 1000, "prompt_ms": read_s * 1000,
               "generate_ms": gen_s * 1000, "prompt_per_second": read / read_s,
               "predicted_per_second": max(n_gen - 1, 0) / gen_s, "log_line": line,
               "draft_n": req.draft_n, "draft_n_accepted": req.draft_n_accepted,
               # llama.cpp's stop_type for a "stop": a stop string (word) or the end of text / grammar (eos)
               "stop_type": "word" if s.stopping_word else "eos", "stopping_word": s.stopping_word}
        if self.speculator is not None:
            out["log_line"] += f", drafts accepted {req.draft_n_accepted} of {req.draft_n}"
        if self.runner.stepper is not None:
            c = req.experts or ExpertCounters()
            st = self.runner.stepper.stats()
            out["experts"] = c.as_dict()
            out["expert_lines"] = [c.hit_line(), resident_line(st["resident_bytes"], st["exchanged"], st["file_reads"])]
        return out

    def _save_profile(self, done: queue.Queue) -> None:
        """Hand a copy of the counts to the caller, who writes the file (no file I/O on this thread)."""
        try:
            done.put(self.runner.expert_profile().copy())
        except Exception as e:  # noqa: BLE001 - handed to the caller
            done.put(e)

    def _run_logits(self, ids: list[int], done: queue.Queue) -> None:
        """All-token logits for `ids` on a scratch copy of the cache: the slots' KV is untouched."""
        try:
            chunk = self.scheduler.max_chunk
            out = []
            with self.runner.scratch_kv():
                for start in range(0, len(ids), chunk):
                    part = ids[start:start + chunk]
                    length = min(max(16, 1 << (len(part) - 1).bit_length()), chunk)
                    tokens = np.zeros((1, length), np.int32)
                    pos = np.full((1, length), -1, np.int32)
                    tokens[0, :len(part)] = part
                    pos[0, :len(part)] = np.arange(start, start + len(part))
                    g = GroupInput(tokens, pos, np.zeros(1, np.int32), SamplingRows.greedy(1), all_logits=True)
                    out.append(self.runner.run([g], start + len(part))[0][0, :len(part)])
            done.put(np.concatenate(out, axis=0))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            done.put(e)

    def _run_logits_reusing(self, ids: list[int], done: queue.Queue) -> None:
        """All-token logits of the tokens a request with prompt `ids` would read, on the slot the prefix
        cache picks, cut at the scheduler's chunk boundaries."""
        try:
            free = [s for s in self.slots if s.free]
            if not free:
                raise RuntimeError("logits_reusing needs a free slot; every slot is busy")
            placed = self._place(ids, free)
            if placed is None:
                raise RuntimeError("the prefix cache failed to place the tokens (see the log)")
            slot, n = placed
            slot.tokens, slot.n_past = list(ids), n
            chunk, out = self.scheduler.max_chunk, []
            try:
                while slot.n_past < len(ids):
                    start = slot.n_past
                    part = min(chunk - start % chunk, len(ids) - start)     # the scheduler's boundaries
                    length = min(bucket(part, 16), chunk)
                    tokens = np.zeros((1, length), np.int32)
                    pos = np.full((1, length), -1, np.int32)
                    tokens[0, :part] = ids[start:start + part]
                    pos[0, :part] = np.arange(start, start + part)
                    g = GroupInput(tokens, pos, np.array([slot.index], np.int32), SamplingRows.greedy(1),
                                   all_logits=True)
                    out.append(self.runner.run([g], start + part)[0][0, :part])
                    slot.n_past += part
            except Exception:
                slot.forget()
                if self.runner.cache_lost():
                    self._lose_cache(RuntimeError("logits_reusing failed"))
                raise
            slot.last_used = time.monotonic()
            done.put((n, np.concatenate(out, axis=0)))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            done.put(e)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
