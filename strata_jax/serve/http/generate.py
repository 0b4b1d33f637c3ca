"""One generation request, from its job to its answer: OpenAI chat and text completions, whole or
streamed.

    job = parse_chat(body, names)       # parse.py: msgspec decoding + the checks it cannot express
    prepared = await sup.prepare(...)   # serve/prompts.py renders, tokenizes, checks: 4xx at once
    ticket = sup.enqueue(...)           # one Submit to the engine when a seat is free
    stream(...) / whole(...)            # SSE chunks, or one JSON body (n choices: choices.py)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec

from ..._version import __version__
from ...engine.request import Event
from ..errors import ApiError, error_body
from ..supervisor.supervisor import Supervisor
from ..supervisor.tickets import Prepared, Ticket
from ..tool_formats import call_mark
from ..tools import HeldCalls, finish_reason, parse_calls
from .choices import Choices
from .console import done_line
from .harmony import HarmonySplit, HarmonyTokens
from .logprobs import LogprobsOf
from .parse import Job, ModelNames, parse_chat, parse_completion
from .reasoning import CONTENT, REASONING, ReasoningParser

log = logging.getLogger("strata_jax.serve")

SYSTEM_FINGERPRINT = "strata-jax"
# llama.cpp's shape, b<build>-<commit>: no llama.cpp build here
LLAMA_FINGERPRINT = f"b0-strata-jax-{__version__}"
_json = msgspec.json.Encoder()


# ---- running -------------------------------------------------------------------------------------


async def start(sup: Supervisor, job: Job) -> tuple[Prepared, Ticket]:
    deadline = job.arrived + sup.config.request_timeout_s
    prepared = await sup.prepare(job.id, job.prompt, job.params, job.chat_template_kwargs, deadline,
                                 text=job.verbose, places=job.n)
    ticket = sup.enqueue(job.id, prepared, job.params, deadline, holds=job.n - 1)
    if prepared.sampling.grammar is not None:
        # the engine compiles the grammar when the request reaches it: one it cannot compile is a
        # 400, answered before anything is written
        try:
            await ticket.verdict()
        except BaseException:       # refused (it has ended), or the client went away
            sup.cancel(ticket)
            raise
    return prepared, ticket


class Outcome:
    """What happened to a request, for its log line and metrics."""

    def __init__(self, job: Job, prepared: Prepared, ticket: Ticket, on_done):
        self.job, self.prepared, self.ticket, self._on_done = job, prepared, ticket, on_done
        self.kind, self.detail, self.stats = "cancelled", "the client went away", None

    def final(self, ev: Event) -> None:
        self.stats = ev.stats
        if ev.finish_reason == "cancelled":
            self.kind, self.detail = "cancelled", "the client went away"
        else:
            self.kind, self.detail = "ok", None

    def error(self, ev: Event) -> None:
        self.kind, self.detail = "error", ev.error

    def close(self, sup: Supervisor) -> None:
        if self.ticket.state != "done":
            sup.cancel(self.ticket)
        seconds = time.monotonic() - self.job.arrived
        n = (self.stats or {}).get("generated_tokens", self.ticket.n_tokens)
        if self.stats and self.stats.get("log_line"):
            log.info("%s", self.stats["log_line"])
        # the expert tiers' lines (Strata's), where the engine has tiers
        for line in (self.stats or {}).get("expert_lines", ()):
            log.info("%s", line)
        log.info("%s [%s]", done_line(n, seconds, self.kind, self.detail), self.job.id)
        self._on_done(self.job, self.ticket, self.kind, self.stats, seconds)


def usage(st: dict[str, Any] | None, prepared: Prepared, n_tokens: int,
          reasoning: int | None = None) -> dict[str, Any]:
    """OpenAI's usage of one choice; reasoning: its reasoning tokens where the server counted them
    (harmony's analysis: HarmonyTokens), else the engine's count."""
    st = st or {}
    prompt = st.get("prompt_tokens", len(prepared.ids))
    done = st.get("generated_tokens", n_tokens)
    if reasoning is None:
        # the tokens inside <think>...</think> (the engine's count: schedule/thinking.py)
        reasoning = st.get("reasoning_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": st.get("reused_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def timings(st: dict[str, Any] | None) -> dict[str, Any]:
    """llama.cpp's `timings` object."""
    st = st or {}
    prompt_n = st.get("prompt_tokens", 0) - st.get("reused_tokens", 0)
    predicted_n = st.get("generated_tokens", 0)
    prompt_ms, predicted_ms = st.get("prompt_ms", 0.0), round(st.get("generate_ms", 0.0), 3)
    # decode steps, as llama.cpp counts: the first token comes from the prompt's window
    steps = predicted_n - 1
    return {"cache_n": st.get("reused_tokens", 0), "prompt_n": prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
            "prompt_per_second": round(st.get("prompt_per_second", 0.0), 3),
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
            "predicted_per_second": 1e3 * steps / predicted_ms if steps > 0 and predicted_ms > 0
                                    else 0.0,
            "draft_n": st.get("draft_n", 0), "draft_n_accepted": st.get("draft_n_accepted", 0)}


def progress_timings(progress: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's `timings` beside a prompt_progress: the prompt read so far, nothing generated;
    its time counts once a token has been read (the first report, before any, has prompt_ms 0)."""
    read = progress["processed"] > progress["cache"]
    return timings({"prompt_tokens": progress["processed"], "reused_tokens": progress["cache"],
                    "prompt_ms": progress["time_ms"] if read else 0.0})


def _finish_reason(ev: Event) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


def event_error(ev: Event) -> ApiError:
    if ev.finish_reason == "timeout":
        return ApiError(503, ev.error or "timeout", "timeout_error")
    return ApiError(500, ev.error or "the engine failed", "server_error")


# ---- streamed answers ----------------------------------------------------------------------------


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def stream(sup: Supervisor, job: Job, prepared: Prepared, ticket: Ticket,
                 on_done) -> AsyncIterator[bytes]:
    """SSE chunks: chat.completion.chunk or text_completion (each choice's with its index), then
    `data: [DONE]`. An engine error ends the stream with `data: {"error": {...}}` and `data: [DONE]`
    (the openai client raises APIError on it)."""
    # closed here when the client goes away, so its request is cancelled at once (chunks' finally)
    async with aclosing(chunks(sup, job, prepared, ticket, on_done)) as each:
        async for chunk in each:
            yield sse(chunk)
    yield SSE_DONE


async def chunks(sup: Supervisor, job: Job, prepared: Prepared, ticket: Ticket,
                 on_done) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks as objects, in order (stream() writes them as SSE; the Anthropic and
    Responses routes translate them into their own events: messages.py, responses.py). The last is
    the usage chunk (with stream_options.include_usage), or an error body ({"error": {...}})."""
    run = _Run(sup, job, prepared, ticket, on_done)
    chunk = _chat_chunk if job.kind == "chat" else _text_chunk
    try:
        for k in range(job.n):
            if job.kind == "chat":
                yield _chat_chunk(job, _first_delta(job), index=k)
            elif job.echo:
                yield _text_chunk(job, job.echo, index=k)
        async for k, ev in run.choices.merged():
            lp = run.logprobs[k]
            if ev.kind == "token":
                lp.add(ev.logprobs)
                run.token(k, ev)
                for piece in run.held[k].feed(_pieces(job, run.parsers[k], ev.text)):
                    yield chunk(job, piece, index=k, logprobs=lp.take())
            # return_progress: llama.cpp's prompt_progress chunk
            elif ev.kind == "progress":
                yield {**chunk(job, _first_delta(job) if job.kind == "chat" else "", index=k),
                       "prompt_progress": ev.stats}
            elif ev.kind == "final":
                run.final(k, ev)
                for piece in run.held[k].feed(_pieces(job, run.parsers[k], ev.text, last=True),
                                              last=True):
                    yield chunk(job, piece, index=k, logprobs=lp.take())
                reason = (finish_reason(run.held[k].calls, _finish_reason(ev)) if job.tools
                          else _finish_reason(ev))
                end = chunk(job, {} if job.kind == "chat" else "", reason, index=k,
                            logprobs=lp.take() if lp.pending else None)
                end["timings"] = timings(ev.stats)
                yield end
                if len(run.finals) == job.n:
                    if job.include_usage:
                        yield {**_head(job), "choices": [], "usage": run.usage(),
                               # as llama.cpp
                               "timings": timings(run.finals[min(run.finals)].stats)}
                    return
            else:
                run.outcomes[k].error(ev)
                yield event_error(ev).body()
                return
    finally:
        run.close()


class _Run:
    """One request's choices while they run: tickets (serve/http/choices.py), outcomes, reasoning
    parsers, logprobs."""

    def __init__(self, sup: Supervisor, job: Job, prepared: Prepared, ticket: Ticket, on_done):
        self.sup, self.job, self.prepared = sup, job, prepared
        self.outcomes = [Outcome(job, prepared, ticket, on_done)]
        self.choices = Choices(sup, job.id, job.n, prepared, job.params, ticket.deadline, ticket,
                               lambda t: self.outcomes.append(Outcome(job, prepared, t, on_done)))
        chat = job.kind == "chat"
        mark = call_mark(prepared.tool_format) if job.tools and prepared.tool_format else None
        self.parsers = [HarmonySplit(job.reasoning, calls=bool(job.tools))
                        if chat and prepared.harmony else
                        ReasoningParser(prepared.think, enabled=job.reasoning and chat,
                                        call_mark=mark)
                        for _ in range(job.n)]
        # harmony's reasoning tokens, counted here (the engine follows <think> marks only)
        self.harmony = ([HarmonyTokens(sup.prompts.tokenizer) for _ in range(job.n)]
                        if chat and prepared.harmony else None)
        wanted = job.params.logprobs is not None
        self.logprobs = [LogprobsOf(chat, wanted, len(job.echo)) for _ in range(job.n)]
        self.held = [HeldCalls(job.tools, prepared.tool_format, job.parallel_tool_calls)
                     for _ in range(job.n)]
        self.finals: dict[int, Event] = {}

    def final(self, k: int, ev: Event) -> None:
        self.outcomes[k].final(ev)
        self.finals[k] = ev

    def token(self, k: int, ev: Event) -> None:
        """Choice k's token event, before its text is parsed."""
        if self.harmony is not None and ev.token is not None:
            self.harmony[k].add(ev.token)

    def usage(self) -> dict[str, Any]:
        """OpenAI's for n choices: the prompt once, the completion tokens of every choice."""
        tickets = self.choices.tickets
        each = [usage(ev.stats, self.prepared, tickets[k].n_tokens,
                      None if self.harmony is None else self.harmony[k].tokens)
                for k, ev in sorted(self.finals.items())]
        out = dict(each[0])
        out["completion_tokens"] = sum(u["completion_tokens"] for u in each)
        out["completion_tokens_details"] = {"reasoning_tokens": sum(
            u["completion_tokens_details"]["reasoning_tokens"] for u in each)}
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out

    def close(self) -> None:
        for o in self.outcomes:
            o.close(self.sup)


def _pieces(job: Job, parser: ReasoningParser | HarmonySplit, text: str,
            last: bool = False) -> list:
    """Chat: deltas ({"content"} or {"reasoning_content"}); text: strings."""
    if job.kind != "chat":
        return [text] if text else []
    parts = parser.feed(text) + (parser.flush() if last else [])
    return [{"reasoning_content" if kind == REASONING else "content": t} for kind, t in parts]


def _head(job: Job) -> dict[str, Any]:
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model,
            "system_fingerprint": LLAMA_FINGERPRINT if job.llama else SYSTEM_FINGERPRINT}


def _first_delta(job: Job) -> dict[str, Any]:
    """A chat stream's first delta (and each progress chunk's): OpenAI's and vLLM's content "",
    llama.cpp's null."""
    return {"role": "assistant", "content": None if job.llama else ""}


def _chat_chunk(job: Job, delta: dict[str, Any], finish_reason: str | None = None, index: int = 0,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**_head(job), "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason}]}


def _text_chunk(job: Job, text: str, finish_reason: str | None = None, index: int = 0,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**_head(job), "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                       "finish_reason": finish_reason}]}


# ---- whole answers -------------------------------------------------------------------------------


async def whole(sup: Supervisor, job: Job, prepared: Prepared, ticket: Ticket,
                on_done) -> dict[str, Any]:
    """The answer as one JSON body (chat.completion or text_completion); ApiError (500/503) on
    engine errors."""
    run = _Run(sup, job, prepared, ticket, on_done)
    parts: list[list[tuple[str, str]]] = [[] for _ in range(job.n)]
    try:
        async for k, ev in run.choices.merged():
            if ev.kind == "error":
                run.outcomes[k].error(ev)
                raise event_error(ev)
            parser = run.parsers[k]
            if ev.kind == "token":
                run.logprobs[k].add(ev.logprobs)
                run.token(k, ev)
            else:
                run.final(k, ev)
            parts[k] += parser.feed(ev.text) + (parser.flush() if ev.kind != "token" else [])
            # all done, or the client left
            if len(run.finals) == job.n or ev.finish_reason == "cancelled":
                return _whole_body(job, run, parts)
        raise ApiError(500, "the engine ended the request without an answer")
    finally:
        run.close()


def _whole_body(job: Job, run: _Run, parts: list[list[tuple[str, str]]]) -> dict[str, Any]:
    body = {"id": job.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created, "model": job.model,
            "system_fingerprint": LLAMA_FINGERPRINT if job.llama else SYSTEM_FINGERPRINT,
            "choices": []}
    for k, ev in sorted(run.finals.items()):
        content = "".join(t for kind, t in parts[k] if kind == CONTENT)
        choice: dict[str, Any] = {"index": k}
        reason = _finish_reason(ev)
        if job.kind == "chat":
            calls = []
            if job.tools:
                content, calls = parse_calls(content, run.prepared.tool_format, job.tools,
                                             job.parallel_tool_calls)
                reason = finish_reason(calls, reason)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            if run.parsers[k].saw_reasoning:
                message["reasoning_content"] = "".join(t for kind, t in parts[k]
                                                       if kind == REASONING)
            choice["message"] = message
        else:
            choice["text"] = job.echo + content
        body["choices"].append({**choice, "logprobs": run.logprobs[k].whole(),
                                "finish_reason": reason})
    body["usage"] = run.usage()
    body["timings"] = timings(run.finals[min(run.finals)].stats)
    if job.verbose:                     # llama.cpp's: the native answer beside the OpenAI one
        first = body["choices"][0]
        stats = run.finals[min(run.finals)].stats or {}
        body["__verbose"] = {"prompt": run.prepared.text, "model": job.model,
                             "content": first["message"]["content"] if job.kind == "chat"
                                        else first["text"],
                             "tokens_predicted": stats.get("generated_tokens"),
                             "tokens_evaluated": stats.get("prompt_tokens"), "stop": True}
    return body


__all__ = ["Job", "ModelNames", "chunks", "error_body", "parse_chat", "parse_completion", "start",
           "stream", "whole"]
