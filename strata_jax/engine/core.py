"""The engine's core: `step()`, one window from plan to events.

    step():  admit        requests from the inbox onto free slots (admission.py), the ended ones out
             plan         a window over the slots with work (scheduler.py), with drafts (spec/),
                          narrowed to one whose programs are built while its own are built off this
                          thread
             run          its program (runner.py, programs.py); out of device memory: its rows in
                          halves
             postprocess  the sampled tokens into each request's events (output.py)

Everything here runs on one thread, the engine thread (Engine's loop calls step(), and nothing else
does while it runs), so the device, the slots and the KV cache have one owner. A test may call
step() itself, without the thread, to drive the engine window by window.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from .. import compile_cache
from ..config import EngineConfig
from ..experts import ExpertCounters
from ..gguf import GGUFModel, load_tokenizer
from . import research
from .execute import embeddings
from .execute.controls import wants_controls
from .execute.memory import is_resource_exhausted
from .families import family_config, is_hybrid, keeps_state
from .grammar.constrain import Grammars
from .prompt import fit_context, prompt_ids, turn_end
from .request import (
    Event,
    Request,
    RequestError,
    SamplingParams,
    check_cache_salt,
    make_params,
)
from .runner import ModelRunner
from .schedule.admission import Admission
from .schedule.output import Output, first_line
from .schedule.prefix_cache import PrefixCache
from .schedule.scheduler import Scheduler, Window
from .schedule.slots import Slot
from .schedule.state_checkpoints import StateCheckpoints
from .schedule.thinking import Thinking
from .spec import make_speculator

log = logging.getLogger("strata_jax.engine")

# the inbox's jobs other than requests, run between windows: (kind, ..., answer queue)
_JOBS = {
    "profile": lambda core: core.runner.expert_profile().copy(),
    "logits": research.logits_on_scratch,
    "logits_reusing": research.logits_reusing,
    "call": lambda core, fn: fn(),                 # Engine.between_windows
}


@dataclass
class WindowCounts:
    """Requests taken in and windows run, since the start (the core's own; Output counts how
    requests end)."""
    requests: int = 0
    windows: int = 0
    window_rows: int = 0
    prompt_rows: int = 0
    multi_prompt_windows: int = 0
    narrowed_windows: int = 0
    split_windows: int = 0
    max_window_tokens: int = 0      # the most real tokens a window held (llama.cpp's n_tokens_max)

    def add_window(self, rows: list, prompts: list, real_tokens: int) -> None:
        self.windows += 1
        self.window_rows += len(rows)
        self.prompt_rows += len(prompts)
        self.multi_prompt_windows += len(prompts) > 1
        self.max_window_tokens = max(self.max_window_tokens, real_tokens)


class EngineCore:
    def __init__(self, model: GGUFModel, config: EngineConfig | None = None, progress: bool = False,
                 expert_policy: str | None = None):
        """expert_policy: overrides config.expert_policy ("freq" or "lru"), the device expert
        cache's eviction policy; it matters only when the experts do not all sit on the device."""
        self.config = config or EngineConfig()
        if expert_policy is not None:
            self.config = replace(self.config, expert_policy=expert_policy)     # validated again
        self.model = model
        self.spec = model.spec
        self.spec.check_runnable(model.paths[0])
        # what the family needs (families.py)
        self.config = family_config(self.config, self.spec)
        self.tokenizer = load_tokenizer(model.metadata)
        # structured output (constrain.py)
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size,
                                 self.config.max_grammar_rules, self.config.max_grammar_depth)
        # before the first program: serve, generate, bench, Python
        compile_cache.enable(self.config.compile_cache)
        self.runner = ModelRunner(model, self.config, progress)
        if self.config.warmup:
            self.runner.warmup(progress=progress)
        self.slots = [Slot(i) for i in range(self.config.parallel)]
        states = None
        # a slot's state (a recurrent one, gpt-oss's rings) resumes only where one was kept
        # (state_checkpoints.py)
        if keeps_state(self.spec):
            states = StateCheckpoints(self.runner.kv, self.config.parallel,
                                      self.config.ctx_checkpoints, self.config.checkpoint_every)
        # which slot a request takes, what it reuses
        self.prefix = PrefixCache(self.runner.kv, self.config, states=states)
        self.scheduler = Scheduler(self.runner.choices["prefill"], self.runner.min_rows,
                                   self.runner.choices["batch_tokens"], self.runner.packed)
        # None without --spec
        self.speculator = make_speculator(self.config, model, self.runner)
        # requests taken in and windows run (Output counts the ends)
        self.counts = WindowCounts()
        self.output = Output(self.tokenizer, self.runner, self.speculator)
        self.admission = Admission(self.prefix, self.tokenizer, self.speculator, self.output,
                                   self.runner.cache_lost, self.lose_cache,
                                   self.config.request_timeout_s)
        self.inbox: queue.Queue = queue.Queue()          # requests and jobs, from any thread
        # a piece a step (embeddings.py)
        self.embeds = embeddings.Embeddings(self.runner, self.config.max_context)
        self.stepped = False                             # whether the last step() ran a window
        # it ran none: its window's programs are being built
        self.waiting_for_programs = False

    @property
    def counters(self) -> dict[str, int]:
        """Every count as one flat dict (stats, /metrics): the core's, Output's, and each embeddings
        piece as a window of one row (llama.cpp counts it as a decode)."""
        out = {**asdict(self.counts), **asdict(self.output.counts)}
        out["window_rows"] += self.embeds.pieces
        return out

    def step(self) -> list[Event]:
        """Take in new requests, plan one window, run it and apply its tokens -> the events it
        produced, in order (each also put on its request's queue); `stepped` says whether a window
        ran. A failure anywhere here ends the requests it concerns with an error (all busy slots
        when it cannot tell which), and the engine goes on: no request can stop it."""
        stage, self.stepped = "admitting requests", False
        try:
            self.runner.programs.collect()             # programs the builder thread finished
            self._take_inbox()
            self.admission.expire(self.slots)
            # a piece of an embed job (its failures are its own)
            self.stepped = self.embeds.step()
            stage = "planning a window"
            window = self._plan()
            if window is not None:
                self.runner.faults.on_plan()
                stage = "running a window"
                self._run(window)
                self.stepped = True
        except Exception as e:
            log.exception("the engine failed while %s", stage)
            if self.runner.ahead is not None:          # a window run ahead of a failed one
                self.runner.ahead.drop()
            for s in self.slots:
                if not s.free:
                    self.output.fail(s, f"the engine failed while {stage}: {type(e).__name__}: "
                                        f"{first_line(e)}")
            if self.runner.cache_lost():
                self.lose_cache(e)
            self.stepped = True
        return self.output.take_events()

    # ---- requests --------------------------------------------------------------------------------

    def make_request(self, prompt: str | list[dict] | list[int], *, max_tokens: int = 256,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0, seed: int | None = None,
                     stop: list[str] | tuple[str, ...] | str | None = None,
                     ignore_eos: bool = False, chat_template_kwargs: dict | None = None,
                     logit_bias: dict | None = None, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                     repeat_last_n: int = 64, logprobs: int | None = None,
                     grammar: tuple | None = None, progress: bool = False,
                     cache_salt: str | None = None, checkpoint_at: int | None = None,
                     **reasoning: Any) -> Request:
        """A checked request, for add() (the Python API's: the server prepares its own requests,
        serve/prompts.py, and hands them to prepared_request): text (a plain completion), a list of
        chat messages, or token ids. The sampling controls and logprobs are controls.py's (token
        events then carry `logprob` and `top_logprobs`); grammar: (kind, text) constrains the output
        (constrain.py: a JSON schema's text, "json_object", a GBNF, Lark or regex grammar);
        RequestError when it cannot be compiled. progress: "progress" events as the prompt is read
        (one when it gets a slot, one a prompt chunk). cache_salt: the request shares prefix-cache
        KV only with requests of the same salt (prefix_cache.py). checkpoint_at: a hybrid family
        keeps its state after this many prompt tokens (turn_end; a chat's is found here).
        reasoning: reasoning_open, reasoning_close (the marks' token ids), reasoning_inside,
        reasoning_budget (make_params; schedule/thinking.py)."""
        params = make_params(max_tokens, temperature, top_k, top_p, min_p, seed, stop, ignore_eos,
                             logit_bias, presence_penalty, frequency_penalty, repeat_penalty,
                             repeat_last_n, logprobs, grammar, **reasoning)
        params.validate(self.spec.vocab_size)
        check_cache_salt(cache_salt)
        ids = self.prompt_ids(prompt, chat_template_kwargs)
        fit_context(len(ids), max_tokens, self.config.max_context)
        if (checkpoint_at is None and isinstance(prompt, list) and prompt
                and isinstance(prompt[0], dict)):
            checkpoint_at = self.turn_end(prompt, chat_template_kwargs or {}, ids)
        return self.prepared_request(ids, params, progress, cache_salt, checkpoint_at)

    def prepared_request(self, ids: list[int], params: SamplingParams, progress: bool = False,
                         cache_salt: str | None = None,
                         checkpoint_at: int | None = None) -> Request:
        """A request from ids and sampling parameters already checked (by make_request, or by the
        server: serve/prompts.py), its grammar compiled here, in the caller's thread, not on the
        engine's (RequestError when it cannot be)."""
        if checkpoint_at is None and self.prefix.states is not None and len(ids) > 1:
            # the same prompt again resumes there (its last token is read again)
            checkpoint_at = len(ids) - 1
        if checkpoint_at is not None and not 0 < checkpoint_at < len(ids):
            raise RequestError(f"checkpoint_at = {checkpoint_at}: must be a position inside the "
                               f"prompt (1..{len(ids) - 1})")
        req = Request(ids, params, progress=progress, cache_salt=cache_salt,
                      checkpoint_at=checkpoint_at)
        if params.grammar is not None:
            req.constraint = self.grammars.constraint(params.grammar)
        req.thinking = Thinking.of(params)
        req.deadline = req.arrived + self.config.request_timeout_s
        return req

    def add(self, req: Request) -> None:
        """Queue a request for the next step() (from any thread)."""
        self.inbox.put(req)

    def prompt_ids(self, prompt, chat_template_kwargs: dict | None = None) -> list[int]:
        """engine/prompt.py's, with this engine's tokenizer."""
        return prompt_ids(self.tokenizer, prompt, chat_template_kwargs)

    def turn_end(self, messages: list[dict], kwargs: dict, ids: list[int]) -> int | None:
        """A hybrid family's chat: where its turn ends (engine/prompt.py); None for the other
        families."""
        return None if self.prefix.states is None else turn_end(self.tokenizer, messages, kwargs,
                                                                 ids)

    # ---- admit -----------------------------------------------------------------------------------

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Request):
                self.admission.wait(item)
                self.counts.requests += 1
                continue
            kind, *args, done = item
            # not all at once: a piece a step (embeddings.py)
            if kind == "embed":
                self.embeds.add(*args, done)
                continue
            try:
                done.put(_JOBS[kind](self, *args))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                done.put(e)
        self.admission.admit(self.slots)

    # ---- plan ------------------------------------------------------------------------------------

    def _plan(self) -> Window | None:
        self.waiting_for_programs = False
        w = self._plan_full()
        return None if w is None else self._ready_window(w)

    def _ready_window(self, w: Window) -> Window | None:
        """A window whose programs are built: w, or while w's are built off this thread (so that a
        layout met for the first time stalls no one), the largest smaller one that is: w's decode
        rows with its first prompt chunk (as it is, then padded to a whole chunk), then its decode
        rows alone. With none of them built, no window (None) while the builder thread builds w's
        first, so that the engine thread still takes in cancels; w itself when its build failed
        there (the engine thread meets the error). Without the warm-up (--no-warmup: tests, quick
        starts) every layout is built when first met, on this thread, as the window waits: the same
        windows run whatever the timing."""
        layout = self.runner.layout_of(w.groups, w.kv_needed)
        if not self.config.warmup or self.runner.ready(layout) or self.runner.refused(layout):
            # refused: its run is refused at once, and the window split
            return w
        self.runner.build_later(layout)
        # a window wants it: ahead of the warm-up's queued guesses (finding 6)
        self.runner.building(layout)
        tries = [(1, False, True), (1, True, True), (0, False, True), (1, True, False),
                 (0, False, False)]
        for prompts, pad, drafts in tries:
            if (prompts and not w.prefills) or (not drafts and w.drafts is None):
                continue
            small = self.scheduler.narrow(w, prompts, pad, drafts)
            if (small is not None
                    and self.runner.ready(self.runner.layout_of(small.groups, small.kv_needed))):
                self.scheduler.took(w, small)
                if w.drafts is not None and small.drafts is None:
                    for s in w.decode:                    # their drafts were not verified
                        self.speculator.reset(s)
                self.counts.narrowed_windows += 1
                return small
        # nothing smaller is built: no window until the builder thread has built w's (the loop takes
        # in cancels and requests meanwhile)
        if self.runner.building(layout):
            self.scheduler.skipped(w)
            if w.drafts is not None:
                for s in w.decode:
                    self.speculator.reset(s)
            self.waiting_for_programs = True
            return None
        return w

    def _plan_full(self) -> Window | None:
        if self.speculator is None:
            return self.scheduler.plan(self.slots)
        decoding = [s for s in self.slots if s.decoding]
        limit = self.config.spec_max_rows
        # a verify window of many rows costs more than it saves; a row with sampling controls or
        # logprobs (controls.py) is sampled by the controlled program, which verify windows do not
        # run
        if ((limit and len(decoding) > limit)
                or any(wants_controls(s.request.params) for s in decoding)):
            return self.scheduler.plan(self.slots)
        try:
            drafts = self.speculator.propose(decoding)
        # a drafter's failure costs drafts, never the requests
        except Exception as e:  # noqa: BLE001
            log.warning("the drafter failed (%s): this window runs without drafts", first_line(e))
            if self._drafter_failed(decoding, e):
                return None
            drafts = {}
        return self.scheduler.plan(self.slots, drafts, self.speculator.verify_len)

    # ---- run -------------------------------------------------------------------------------------

    def _run(self, w: Window) -> None:
        """Run a window; if it runs out of device memory even after the program cache freed half its
        programs, run its rows in smaller windows. Only a row that fails alone ends with an
        error."""
        try:
            outs = self.runner.run(w.groups, w.kv_needed, ahead=self._may_run_ahead(w))
            hiddens = self.runner.take_hiddens()          # the mtp drafter's input, None without it
        # every failure is reported to the requests, never lost
        except Exception as e:  # noqa: BLE001
            self._recover(w, e)
            return
        self.counts.add_window(w.rows, w.prefills, sum(int((g.pos >= 0).sum()) for g in w.groups))
        if self.runner.stepper is not None:               # expert-tier counters, per request too
            for s in w.rows:
                if not s.free:
                    if s.request.experts is None:
                        s.request.experts = ExpertCounters()
                    s.request.experts.add(self.runner.stepper.last)
        starts = ([int(p) for p in w.groups[0].pos[:len(w.decode), 0]] if w.drafts is not None
                  else None)
        self.output.apply(w, outs)
        self.prefix.after_window(w)
        if starts is not None and is_hybrid(self.spec):
            self._keep_accepted_states(w, starts)
        if self.speculator is not None and hiddens is not None:
            self._after_window(w, hiddens)

    def _may_run_ahead(self, w: Window) -> bool:
        """Whether the next window will most likely be w's rows again one position on, so the
        runner may dispatch it before w's tokens are applied (run_ahead.py; a guess that misses
        costs that window's work, never a result): decode rows alone, no drafter, no sampling
        controls (another program samples them), no row ending by length in w, nothing waiting
        to come in."""
        if (self.runner.ahead is None or self.speculator is not None or not w.packed
                or w.prefills or not w.decode or not self.inbox.empty()
                or (self.admission.waiting and any(s.free for s in self.slots))):
            return False
        for s in w.decode:
            req = s.request
            if req is None or wants_controls(req.params):
                return False
            generated = len(s.tokens) - len(req.prompt) + 1      # after w
            if generated >= req.params.max_tokens or s.n_past + 2 >= self.runner.cache_len:
                return False
        return True

    def _keep_accepted_states(self, w: Window, starts: list[int]) -> None:
        """A hybrid family's verify window read every draft into its slots' DeltaNet state: each
        slot keeps the state after the tokens it accepted (s.n_past - start of them: its drafts up
        to the first rejected, the last token emitted excluded, as every window leaves it), chosen
        from the window's steps."""
        rows = [(s.index, s.n_past - start - 1) for s, start in zip(w.decode, starts)
                if s.n_past > start]
        if rows:
            slots, steps = zip(*rows)
            self.runner.kv.keep_steps(np.asarray(slots), np.asarray(steps))

    def _after_window(self, w: Window, hiddens) -> None:
        """Hand the window's hidden states to the drafter (mtp). A failure there costs drafts, not
        requests."""
        try:
            self.speculator.after_window(w, hiddens)
        # the window's tokens are out; only drafting is affected
        except Exception as e:  # noqa: BLE001
            log.warning("the drafter failed after window %s (%s): no drafts for its slots until "
                        "their next window", self._describe(w), first_line(e))
            self._drafter_failed(w.rows, e)

    def _drafter_failed(self, slots: list[Slot], e: Exception) -> bool:
        """Forget the slots' pending drafts; if the failure took the KV cache, end the requests in
        flight (-> True)."""
        for s in slots:
            self.speculator.reset(s)
        if self.runner.cache_lost():
            self.lose_cache(e)
            return True
        return False

    def _recover(self, w: Window, e: Exception) -> None:
        if self.runner.cache_lost():
            log.error("a window failed and took the KV cache with it (%s); ending the requests in "
                      "flight", e)
            self.lose_cache(e)
            return
        rows = w.rows
        if not is_resource_exhausted(e) or len(rows) <= 1:
            for s in rows:
                self.output.fail(s, f"window {self._describe(w)} failed: {e}")
            return
        self.counts.split_windows += 1
        log.warning("window %s failed (%s): running its rows in smaller windows", self._describe(w),
                    first_line(e))
        parts = ([w.decode[: len(w.decode) // 2], w.decode[len(w.decode) // 2:]]
                 if len(w.decode) > 1 else [w.decode])
        for part in parts:
            if part:
                self._run(self.scheduler.window_of(part, [], []))
        for p, c in zip(w.prefills, w.chunks):              # each prompt chunk alone
            if not p.free:
                self._run(self.scheduler.window_of([], [p], [c]))

    def lose_cache(self, e: Exception) -> None:
        """The KV cache is gone (a failed window consumed it): a new one, and every request in
        flight ended."""
        self.runner.kv.reset()
        if self.runner.ahead is not None:
            self.runner.ahead.drop()
        for s in self.slots:
            if not s.free:
                self.output.fail(s, f"the engine's KV cache was lost in a failed window: {e}")
            s.forget()                                  # the kept KV of free slots went with it

    def _describe(self, w: Window) -> str:
        return str(self.runner.layout_of(w.groups, w.kv_needed))
