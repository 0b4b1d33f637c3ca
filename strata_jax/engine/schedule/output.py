"""A window's results turned into each request's events: the postprocess half of Engine.step().

`Output` decides everything between a sampled token and what a caller reads: the slot's sequence and
position (moved by Slot's own methods), detokenizing (a character may need several tokens), stop
strings (text is held back while it may be the start of one), EOS, the grammar's end, max_tokens and
the end of the context; and the end of a request, finished with its stats or failed with its reason.
Every event is put on its request's queue and kept in `events`, which Engine.step() hands back, so a
test can read a window's exact events.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...experts import ExpertCounters, resident_line
from ..request import Event, Request
from .scheduler import Window
from .slots import Slot

log = logging.getLogger("strata_jax.engine")


@dataclass
class RequestCounts:
    """How requests ended, since the start (Output's own: it ends them)."""
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class Output:
    def __init__(self, tokenizer, runner, speculator):
        self.tokenizer = tokenizer
        self.runner = runner              # reads: cache_len, last_logprobs, stepper (request stats)
        self.speculator = speculator      # None without --spec
        self.counts = RequestCounts()
        self.events: list[Event] = []     # since the last take_events()

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def put(self, req: Request, ev: Event) -> None:
        ev.request = req.id
        self.events.append(ev)
        req.events.put(ev)

    # ---- a window's tokens -----------------------------------------------------------------------

    def apply(self, w: Window, outs: list[np.ndarray]) -> None:
        """The tokens a window sampled (runner.run's outputs), to its rows' requests."""
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
                s.advance()
                self.emit(s, int(toks[i]), self._logprobs(k - 1, i))
        for i, (s, c) in enumerate(zip(w.prefills, w.chunks)):
            if s.free:
                continue
            s.advance(c)
            if s.request.progress:
                self.progress(s)
            # the prompt is read: its last logits gave a token
            if not s.reading:
                s.request.t_first = time.monotonic()
                self.emit(s, int(outs[k][i]), self._logprobs(k, i))

    def _apply_packed(self, w: Window, toks: np.ndarray) -> None:
        """A packed window's tokens: the decode rows' in order, then each ending prompt's
        (scheduler.packed_group)."""
        for i, s in enumerate(w.decode):
            if not s.free:
                s.advance()
                self.emit(s, int(toks[i]), self._logprobs(0, i))
        j = len(w.decode)
        for s, c, end in zip(w.prefills, w.chunks, w.ends):
            if not s.free:
                s.advance(c)
                if s.request.progress:
                    self.progress(s)
                # the prompt is read: its last logits gave a token
                if end:
                    s.request.t_first = time.monotonic()
                    self.emit(s, int(toks[j]), self._logprobs(0, j))
            j += end

    def _apply_verify(self, w: Window, toks: np.ndarray, n_acc: np.ndarray) -> None:
        """Each slot emits its accepted drafts and the token after them (toks [R, 1+N], n_acc [R]),
        one by one: a finish inside the run (stop string, EOS, max_tokens) ends it there. The KV
        written for the rejected drafts stays behind n_past, where the next window overwrites it."""
        self.speculator.count_verify_window()
        for i, (s, d) in enumerate(zip(w.decode, w.drafts)):
            if s.free:
                continue
            self.speculator.record(s.request, len(d), int(n_acc[i]))
            for t in toks[i, :int(n_acc[i]) + 1]:
                s.advance()
                # a forced token (thinking.py) replaces the one the drafts after it followed
                if not self.emit(s, int(t)) or s.free:
                    break

    def _logprobs(self, group: int, row: int):
        """The window's logprobs of a group's row (the controlled program's), or None."""
        lp = self.runner.last_logprobs
        got = lp[group] if group < len(lp) else None
        return None if got is None else tuple(a[row] for a in got)

    def progress(self, s: Slot) -> None:
        """How much of the slot's prompt is read (llama.cpp's prompt_progress: its total, what the
        slot's kept KV already held, what is read including that, and the time since the request got
        its slot)."""
        req = s.request
        self.put(req, Event("progress", stats={"total": len(req.prompt), "cache": req.reused,
                                               "processed": min(s.n_past, len(req.prompt)),
                                               "time_ms": round((time.monotonic()
                                                                 - req.t_start) * 1000, 3)}))

    # ---- one token -------------------------------------------------------------------------------

    def emit(self, s: Slot, token: int, logprobs=None) -> bool:
        """Hand a sampled token to its request; a failure here ends that request alone. -> False
        when another token was committed in its place (a reasoning budget's forced close mark:
        schedule/thinking.py)."""
        if token < 0:                                   # the sampler's mark for NaN or inf logits
            self.fail(s, "the model's logits were NaN or inf at this position (the weights or the "
                         "activations overflowed): the request cannot go on")
            return True
        thinking = s.request.thinking
        chosen = token if thinking is None else thinking.choose(token)
        if chosen != token and logprobs is not None:
            logprobs = forced_logprobs(chosen, logprobs)
        try:
            if thinking is not None:
                thinking.commit(chosen)
            self._emit_token(s, chosen, logprobs)
        except Exception as e:
            log.exception("request %d: its token %d could not be handled", s.request.id, chosen)
            self.fail(s, f"the engine could not handle token {chosen}: {type(e).__name__}: "
                         f"{first_line(e)}")
        return chosen == token

    def _emit_token(self, s: Slot, token: int, logprobs=None) -> None:
        req = s.request
        s.add_token(token)
        refused = req.constraint.advance(token) if req.constraint is not None else None
        if refused:
            self.fail(s, f"the grammar cannot go on after token {token}: {refused}")
            return
        n_gen = len(s.tokens) - len(req.prompt)
        eos = self.tokenizer.is_eos(token) and not req.params.ignore_eos
        if not eos:
            s.add_text(s.decoder.add(token))
        if s.cut_at_stop():
            self._send_text(s, token, len(s.text), logprobs)
            self.finish(s, "stop")
            return
        if eos:
            self.finish(s, "stop")
            return
        if req.constraint is not None and req.constraint.done:    # the grammar is complete
            self._send_text(s, token, len(s.text), logprobs)
            self.finish(s, "stop")
            return
        self._send_text(s, token, len(s.text) - s.stops.held(s.text), logprobs)
        if n_gen >= req.params.max_tokens or s.n_past + 1 >= self.runner.cache_len:
            self.finish(s, "length")

    def _send_text(self, s: Slot, token: int, upto: int, logprobs=None) -> None:
        ev = Event("token", text=s.take_text(upto), token=token)
        n = s.request.params.logprobs
        # (logprob, top ids, top logprobs): controls.py
        if logprobs is not None and n is not None:
            ev.logprob = float(logprobs[0])
            ev.top_logprobs = [(int(t), float(v)) for t, v in zip(logprobs[1][:n], logprobs[2][:n])]
        self.put(s.request, ev)

    # ---- the end of a request --------------------------------------------------------------------

    def finish(self, s: Slot, reason: str) -> None:
        req = s.request
        if reason != "cancelled" and s.decoder is not None:
            s.add_text(s.decoder.flush() if reason == "length" else "")
        tail = s.text[s.emitted:] if reason != "cancelled" else ""
        req.t_end = time.monotonic()
        stats = self._request_stats(s)
        if reason == "cancelled":
            self.counts.cancelled += 1
        else:
            self.counts.finished += 1
        self.counts.prompt_tokens += len(req.prompt)
        self.counts.generated_tokens += stats["generated_tokens"]
        log.info("%s", stats["log_line"])
        for line in stats.get("expert_lines", ()):
            log.info("%s", line)
        self.put(req, Event("final", text=tail, stats=stats, finish_reason=reason))
        s.release()

    def fail(self, s: Slot, message: str) -> None:
        self.counts.failed += 1
        log.error("request %d failed: %s", s.request.id, message)
        self.put(s.request, Event("error", error=message))
        s.release(keep=False)

    def fail_unslotted(self, req: Request, message: str, count: bool = False) -> None:
        """A request that never got a slot (or could not start on one: count, it is counted as
        failed)."""
        self.counts.failed += count
        self.put(req, Event("error", error=message))

    def finish_unslotted(self, req: Request, reason: str) -> None:
        self.counts.cancelled += 1
        self.put(req,
                 Event("final", stats={"prompt_tokens": len(req.prompt), "generated_tokens": 0},
                            finish_reason=reason))

    def _request_stats(self, s: Slot) -> dict[str, Any]:
        req = s.request
        n_prompt, n_gen = len(req.prompt), len(s.tokens) - len(req.prompt)
        t_first = req.t_first or req.t_end
        read_s = max(t_first - req.t_start, 1e-9)
        gen_s = max(req.t_end - t_first, 1e-9)
        read = n_prompt - req.reused
        line = (f"prompt {n_prompt} tokens = {req.reused} reused + {read} read in "
                f"{read_s * 1000:.0f} ms ({read / read_s:.1f} tok/s), {n_gen} generated in "
                f"{gen_s * 1000:.0f} ms ({max(n_gen - 1, 0) / gen_s:.1f} tok/s)")
        out = {"prompt_tokens": n_prompt, "reused_tokens": req.reused, "generated_tokens": n_gen,
               "queue_ms": (req.t_start - req.arrived) * 1000, "prompt_ms": read_s * 1000,
               "generate_ms": gen_s * 1000, "prompt_per_second": read / read_s,
               "predicted_per_second": max(n_gen - 1, 0) / gen_s, "log_line": line,
               "draft_n": req.draft_n, "draft_n_accepted": req.draft_n_accepted,
               # llama.cpp's stop_type for a "stop": a stop string (word) or the end of text /
               # grammar (eos)
               "stop_type": "word" if s.stopping_word else "eos", "stopping_word": s.stopping_word}
        if req.thinking is not None:
            out["reasoning_tokens"] = req.thinking.tokens
        if self.speculator is not None:
            out["log_line"] += f", drafts accepted {req.draft_n_accepted} of {req.draft_n}"
        if self.runner.stepper is not None:
            c = req.experts or ExpertCounters()
            st = self.runner.stepper.stats()
            out["experts"] = c.as_dict()
            out["expert_lines"] = [c.hit_line(), c.tier_line(n_prompt - req.reused + n_gen),
                                   resident_line(st["resident_bytes"], st["exchanged"],
                                                 st["file_reads"], st["file_bytes"])]
        return out


def forced_logprobs(token: int, logprobs: tuple) -> tuple:
    """The window's (logprob, top ids, top logprobs) for a forced token in place of the sampled
    one: its own logprob when it is among the top alternatives, else the least of them and the
    sampled token's (the distribution at that position is the model's either way; a token outside
    the top N has at most the N-th's logprob when the sampler took the most likely)."""
    lp, ids, values = logprobs
    found = [float(v) for t, v in zip(ids, values) if int(t) == token]
    return (found[0] if found else min([float(lp), *map(float, values)]), ids, values)


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
