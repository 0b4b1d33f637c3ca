"""Requests, their sampling parameters, and the handle a caller reads events from."""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# (MAX_TEMPERATURE: schemas.py reads it here)
from ..config import MAX_TEMPERATURE, sampling_problem  # noqa: F401


class RequestError(ValueError):
    """A request that cannot run: names the field and the value."""


class ContextOverflowError(RequestError):
    """Prompt plus max_tokens beyond a slot's context (the server answers 400
    exceed_context_size_error)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, n_ctx: int):
        self.prompt_tokens, self.max_tokens, self.n_ctx = prompt_tokens, max_tokens, n_ctx
        super().__init__(f"the request needs {prompt_tokens} prompt tokens + {max_tokens} to "
                         f"generate = {prompt_tokens + max_tokens} tokens, but a slot holds "
                         f"{n_ctx} (--max-context)")


# Bounds a request's values must keep, so that no value can break the arrays it goes into (int32
# top_k, uint32 seeds) or make stop-string matching expensive. The server checks them before the
# engine sees a request; Engine.submit checks them again for Python callers.
MAX_STOPS = 16                  # stop strings a request (OpenAI allows 4; llama.cpp any)
MAX_STOP_CHARS = 512            # characters of one stop string
# a temperature below this is greedy (dividing logits by it overflows float32)
GREEDY_BELOW = 1e-5
MAX_LOGIT_BIAS = 1024           # logit_bias entries a request
MAX_LOGPROBS = 20               # top_logprobs / completions' logprobs (OpenAI's limit)
# a JSON schema's or grammar's text (compiling is bounded by llguidance's limits too)
MAX_GRAMMAR_CHARS = 1 << 17
MAX_CACHE_SALT_CHARS = 256      # a request's cache_salt (prefix_cache.py)
MAX_MARK_TOKENS = 16            # token ids of a reasoning mark (<think>, </think>)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias -100..100): OpenAI's meaning
    presence_penalty: float = 0.0      # -2..2, subtracted once from each token generated so far
    # -2..2, subtracted per occurrence among the tokens generated so far
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0        # llama.cpp's: 1 is off
    # llama.cpp's: the tokens of prompt + output it looks at (-1: all, 0: off)
    repeat_last_n: int = 64
    # None: no logprobs; N: the chosen token's and the top N alternatives'
    logprobs: int | None = None
    # structured output: (kind, text, request field): engine/grammar/constrain.py
    grammar: tuple[str, ...] | None = None
    # the reasoning section (engine/schedule/thinking.py): its marks' token ids (none: not
    # followed), whether the prompt opened it, and the most tokens it may take (-1: no limit)
    reasoning_open: tuple[int, ...] = ()
    reasoning_close: tuple[int, ...] = ()
    reasoning_inside: bool = False
    reasoning_budget: int = -1
    # single tokens that also end it, unforced and uncounted (a tool call's mark: <tool_call>)
    reasoning_ends: tuple[int, ...] = ()

    def validate(self, vocab_size: int | None = None) -> None:
        """RequestError naming the field and the value, for anything the engine cannot hold or
        use."""
        def need(cond, name, what):
            if not cond:
                raise RequestError(f"{name} = {_shown(getattr(self, name))}: {what}")

        need(_whole(self.max_tokens) and 1 <= self.max_tokens < 2**31, "max_tokens",
             "must be a whole number >= 1")
        # the rule server defaults meet too (config.py)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            what = sampling_problem(name, getattr(self, name), vocab_size)
            need(what is None, name, what)
        need(self.seed is None or (_whole(self.seed) and 0 <= self.seed < 2**32), "seed",
             "must be a whole number from 0 to 4294967295")
        need(isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOPS, "stop",
             f"must be at most {MAX_STOPS} strings")
        need(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             f"each stop string must be 1 to {MAX_STOP_CHARS} characters")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
        for name in ("presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n"):
            what = sampling_problem(name, getattr(self, name), vocab_size)
            need(what is None, name, what)
        need(self.logprobs is None or (_whole(self.logprobs)
                                       and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"must be a whole number from 0 to {MAX_LOGPROBS} (the alternatives shown a token)")
        need(isinstance(self.logit_bias, tuple) and len(self.logit_bias) <= MAX_LOGIT_BIAS,
             "logit_bias", f"must hold at most {MAX_LOGIT_BIAS} tokens")
        vocab = vocab_size or 2**31
        need(_whole(self.reasoning_budget) and -1 <= self.reasoning_budget < 2**31,
             "reasoning_budget", "must be a whole number >= -1 (-1: no limit)")
        need(isinstance(self.reasoning_inside, bool), "reasoning_inside", "must be true or false")
        for name in ("reasoning_open", "reasoning_close", "reasoning_ends"):
            marks = getattr(self, name)
            need(isinstance(marks, tuple) and len(marks) <= MAX_MARK_TOKENS
                 and all(_whole(t) and 0 <= t < vocab for t in marks), name,
                 f"must be at most {MAX_MARK_TOKENS} token ids of the vocabulary")
        need(bool(self.reasoning_close) or (self.reasoning_budget == -1
                                            and not self.reasoning_inside),
             "reasoning_budget", "a budget needs the section's close mark (reasoning_close)")
        for tok, bias in self.logit_bias:
            if not (_whole(tok) and 0 <= tok < vocab):
                raise RequestError(f"logit_bias = {_shown(dict(self.logit_bias))}: token id "
                                   f"{_shown(tok)} is outside the vocabulary (0..{vocab - 1})")
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool)
                    and math.isfinite(bias)
                    and -100 <= bias <= 100):
                raise RequestError(f"logit_bias = {_shown(dict(self.logit_bias))}: the bias of "
                                   f"token {tok} is {_shown(bias)}; a bias is a number from -100 "
                                   "to 100")

    @property
    def sampled_temperature(self) -> float:
        """The temperature the sampler uses: 0 (greedy) below GREEDY_BELOW."""
        return 0.0 if self.temperature < GREEDY_BELOW else float(self.temperature)


def make_params(max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, seed: int | None = None, stop: Any = None,
                ignore_eos: bool = False, logit_bias: Any = None, presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                repeat_last_n: int = 64, logprobs: int | None = None,
                grammar: Any = None, reasoning_open: Any = (), reasoning_close: Any = (),
                reasoning_inside: bool = False, reasoning_budget: int = -1,
                reasoning_ends: Any = ()) -> SamplingParams:
    """SamplingParams from Engine.submit's keywords (stop: a string or a list; logit_bias: {token
    id: bias}; grammar: (kind, text[, request field]), constrain.py; the reasoning marks as token
    ids, schedule/thinking.py), not yet validated."""
    stop = [stop] if isinstance(stop, str) else stop
    return SamplingParams(max_tokens, temperature, top_k, top_p, min_p, seed, tuple(stop or ()),
                          ignore_eos,
                          logit_bias_pairs(logit_bias), presence_penalty, frequency_penalty,
                          repeat_penalty,
                          repeat_last_n, logprobs,
                          tuple(grammar) if isinstance(grammar, list) else grammar,
                          _mark_ids(reasoning_open), _mark_ids(reasoning_close), reasoning_inside,
                          reasoning_budget, _mark_ids(reasoning_ends))


def _mark_ids(marks: Any) -> Any:
    """A mark's token ids as a tuple (a list from JSON or msgpack); other values are left for
    validate to name."""
    return tuple(marks) if isinstance(marks, list) else marks


def logit_bias_pairs(bias: Any) -> tuple:
    """A logit_bias mapping ({token id: bias}; JSON's keys are strings of digits) -> sorted (id,
    bias) pairs; RequestError naming the key that is not a token id."""
    if not bias:
        return ()
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias = {_shown(bias)}: must map token ids to biases, e.g. "
                           "{\"50256\": -100}")
    pairs = []
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().isdigit() and len(key) <= 10:
            key = int(key)
        if not _whole(key):
            raise RequestError(f"logit_bias = {_shown(bias)}: the key {_shown(key)} is not a token "
                               "id (a whole number, as a string in JSON)")
        pairs.append((key, value))
    return tuple(sorted(pairs, key=lambda kv: kv[0]))


def check_cache_salt(salt: Any) -> None:
    """RequestError unless salt is None or a string of 1 to MAX_CACHE_SALT_CHARS characters."""
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise RequestError(f"cache_salt = {_shown(salt)}: must be a string of 1 to "
                           f"{MAX_CACHE_SALT_CHARS} characters")


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    """A value for an error message, cut short: a request may send a megabyte of it."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class Event:
    """What a handle yields: "token" events (text may be empty while a character or a possible stop
    string is incomplete), then one "final" (with stats) or one "error"; before them, for a request
    that asks, "progress" events (stats: llama.cpp's prompt_progress) as its prompt is read."""
    kind: str                         # "token" | "final" | "error" | "progress" (Request.progress)
    text: str = ""
    token: int | None = None
    stats: dict[str, Any] | None = None
    finish_reason: str | None = None  # final: "stop" | "length" | "cancelled"
    error: str | None = None
    # token events of a request with logprobs: the token's (raw model) logprob and its top
    # alternatives (token id, logprob)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # the id of the request it belongs to (set by the engine: Engine.step())
    request: int | None = None
    # The server's side of the same event (serve/supervisor/supervisor.py: _on_frame), made by the
    # worker off the engine thread:
    # [token bytes, logprob, [[bytes, logprob], ...]] (serve/http/logprobs.py)
    logprobs: list | None = None
    # [token id, [alternatives' ids]] (llama.cpp's n_probs: serve/llama/native.py)
    logprob_ids: list | None = None


_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    # a "progress" event as each prompt chunk is read (llama.cpp's return_progress)
    progress: bool = False
    # vLLM's: only requests of the same salt share prefix-cache KV (prefix_cache.py)
    cache_salt: str | None = None
    # a hybrid family: a prompt position to keep the state at (state_checkpoints.py)
    checkpoint_at: int | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # filled in by the engine
    output: list[int] = field(default_factory=list)
    reused: int = 0
    draft_n: int = 0                   # speculative decoding: draft tokens verified for it
    draft_n_accepted: int = 0          # and accepted
    # ExpertCounters of the windows it took part in (expert tiers)
    experts: Any = None
    # its grammar's matcher (constrain.Constraint), made at submit
    constraint: Any = None
    # its reasoning section (schedule/thinking.py), when the params give its marks
    thinking: Any = None
    t_start: float = 0.0               # got a slot
    t_first: float = 0.0               # prompt read, first token out
    t_end: float = 0.0


class Handle:
    """A submitted request: iterate for its events; `cancel()` frees its slot at the next window."""

    def __init__(self, request: Request, wakeup=None):
        self.request = request
        self._wakeup = wakeup
        self.done = False

    @property
    def id(self) -> int:
        return self.request.id

    def cancel(self) -> None:
        self.request.cancelled.set()
        if self._wakeup:
            self._wakeup()

    def __iter__(self) -> Iterator[Event]:
        while not self.done:
            timeout = (max(0.1, self.request.deadline - time.monotonic() + 5.0)
                       if self.request.deadline else None)
            try:
                ev = self.request.events.get(timeout=timeout)
            except queue.Empty:
                self.done = True
                yield Event("error",
                            error="the engine did not answer before the request's deadline")
                return
            if ev.kind in ("final", "error"):
                self.done = True
            yield ev
