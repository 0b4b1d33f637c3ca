"""llama.cpp's native generation route, in its request and response shapes (tools/server/README.md
of llama.cpp):

    POST /completion (and /completions, as llama.cpp)
        {"prompt": text | [ids] | [text | id, ...] (one prompt, mixed) | {"prompt_string": text}
                   | [prompt, prompt, ...] (several: the answer is a list),
         "n_predict", "temperature", "top_k", ..., "stop", "grammar", "json_schema", "n_probs",
         "post_sampling_probs", "logit_bias" ([[id | text, bias | false], ...] or {id | text:
             bias}),
         "return_tokens", "response_fields", "cache_prompt", "id_slot", "stream", "return_progress"}
        -> {"index", "content", "tokens", "id_slot", "stop": true, "model", "tokens_predicted",
            "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated",
                "stop_type" (eos | word | limit),
            "stopping_word", "tokens_cached", "timings", "completion_probabilities" (with n_probs)}
        streamed: `data: {"index", "content", "tokens": [id], "stop": false, ...}` a token, then the
            body above
        with "stop": true (llama.cpp sends no `data: [DONE]` here).

The request runs through the same pipeline as /v1/completions (generate.start: the engine tokenizes
and checks it, our queue, the engine); only the shapes differ. Fields llama.cpp has and this engine
has not (mirostat, dry_*, xtc_*, typical_p, n_keep, samplers, ...) are accepted and have no effect;
`cache_prompt: false` too (the prefix cache never changes an answer's tokens). A request without
`seed` samples with the server's `--seed` (llama.cpp's rule). `id_slot` is accepted: the engine
picks the slot whose kept KV matches the prompt best. `return_progress` (streams) sends a
`prompt_progress` chunk when the prompt gets its slot and one as each prompt chunk is read, with
`timings` too under `timings_per_token`.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec

from ..errors import ApiError, invalid
from ..http.choices import events
from ..http.generate import Outcome, event_error, progress_timings, sse, start, timings
from ..http.parse import Job, _decode, _params
from ..http.schemas import MAX_LOGPROBS, CompletionRequest
from ..protocol import Detokenize

MAX_PROMPTS = 8
NProbs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
NPredict = Annotated[int, msgspec.Meta(ge=-1, le=1 << 24)]


class NativeRequest(CompletionRequest):
    prompt: Any = None                          # checked by _prompts (llama.cpp's shapes)
    logit_bias: Any = None                      # llama.cpp's shapes: _logit_bias
    n_predict: NPredict | None = None
    n_probs: NProbs = 0
    post_sampling_probs: bool = False
    return_tokens: bool = False
    response_fields: list[str] | None = None
    cache_prompt: bool = True
    id_slot: int = -1


def parse(body: bytes, served: str, model: str, defaults: dict[str, Any],
          seed: int | None = None) -> tuple[list[Job], NativeRequest]:
    """The body -> one job a prompt, and the request (its response options). A request without a
    seed samples with the server's (--seed), as llama.cpp's does."""
    req = _decode(body, NativeRequest)
    prompts = _prompts(req.prompt)
    asked = req.n_predict if req.n_predict is not None and req.n_predict >= 0 else req.max_tokens
    # llama.cpp's n_predict 0: read the prompt, generate nothing
    if asked == 0:
        raise invalid("n_predict = 0: this server generates at least one token; give n_predict >= "
                      "1 or -1", "n_predict")
    plain = msgspec.structs.replace(req, logit_bias=None, logprobs=req.n_probs or None)
    params = _params(plain, asked, chat=False, defaults=defaults)
    params.logit_bias = _logit_bias(req.logit_bias)
    if params.seed is None and req.seed is None and seed is not None:
        params.seed = seed % 2**32
    jobs = []
    for prompt in prompts:
        job = Job("text", f"cmpl-{uuid.uuid4().hex[:24]}", model, prompt,
                  msgspec.structs.replace(params), req.stream, False)
        jobs.append(job)
    return jobs, req


def _prompts(prompt: Any) -> list[Any]:
    """llama.cpp's prompt shapes -> the prompts (each a text, or a list of ids and texts)."""
    if prompt is None or prompt == "" or prompt == []:
        raise invalid("prompt is empty: send the text (or token ids) to continue", "prompt")
    if isinstance(prompt, (str, dict)):
        return [_one(prompt, "prompt")]
    if not isinstance(prompt, list):
        raise invalid("prompt must be a text, a list of token ids and texts, or a list of such "
                      "prompts", "prompt")
    # one prompt: ids, maybe mixed
    if any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_one(prompt, "prompt")]
    if len(prompt) > MAX_PROMPTS:
        raise invalid(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} a request",
                      "prompt")
    return [_one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]


def _one(p: Any, where: str) -> Any:
    if isinstance(p, dict):
        if p.get("multimodal_data"):
            raise invalid(f"{where}.multimodal_data: this server reads text only (no multimodal "
                          "projector)", where)
        p = p.get("prompt_string")
        if not isinstance(p, str):
            raise invalid(f"{where}: a JSON prompt needs \"prompt_string\": TEXT", where)
    if isinstance(p, str):
        if not p:
            raise invalid(f"{where} is empty", where)
        return p
    if isinstance(p, list) and p:
        for j, part in enumerate(p):
            if isinstance(part, bool) or not isinstance(part, (int, str)):
                raise invalid(f"{where}[{j}]: a prompt's parts are token ids and texts", where)
            if isinstance(part, int) and not 0 <= part < 2**31:
                raise invalid(f"{where}[{j}] = {part}: not a token id", where)
        return p if any(isinstance(part, str) for part in p) else [int(t) for t in p]
    raise invalid(f"{where}: a prompt is a text, a list of token ids (and texts), or "
                  "{\"prompt_string\": TEXT}", where)


def _logit_bias(bias: Any) -> list[list]:
    """llama.cpp's logit_bias ([[id | text, bias | false], ...] or {id | text: bias}) -> [[id |
    text, bias]]: a text's tokens get the bias (the engine tokenizes it); false bans the token (bias
    -100)."""
    if bias is None:
        return []
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, list):
        raise invalid("logit_bias: give [[token id or text, bias], ...] or {\"token id or text\": "
                      "bias}", "logit_bias")
    out = []
    for pair in pairs[:1024]:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise invalid(f"logit_bias: {str(pair)[:40]} is not a [token, bias] pair", "logit_bias")
        key, value = pair
        if value is False:
            value = -100.0
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value)):
            raise invalid(f"logit_bias: the bias of {str(key)[:40]!r} is {value!r}; a bias is a "
                          "number or false", "logit_bias")
        value = max(-100.0, min(100.0, float(value)))
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            key = int(key)              # an object's keys are strings: "15043" is a token id
        if (isinstance(key, bool) or not isinstance(key, (int, str))
                or (isinstance(key, int) and not 0 <= key < 2**31)):
            raise invalid(f"logit_bias: {str(key)[:40]!r} is neither a token id nor a text",
                          "logit_bias")
        out.append([key, value])
    return out


# ---- running -------------------------------------------------------------------------------------


class _One:
    """One prompt's run: its chunks as it goes, and its final body."""

    def __init__(self, sup, job: Job, req: NativeRequest, index: int, settings: dict, on_done):
        self.sup, self.job, self.req, self.index, self.settings = sup, job, req, index, settings
        self.on_done = on_done
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.probs: list[dict] = []
        self.ticket = None
        self.prepared = None

    async def begin(self) -> None:
        self.prepared, self.ticket = await start(self.sup, self.job)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The streamed chunks; the last is the final body (stop: true). ApiError on an engine
        error."""
        outcome = Outcome(self.job, self.prepared, self.ticket, self.on_done)
        try:
            async for ev in events(self.sup, self.ticket):
                if ev.kind == "error":
                    outcome.error(ev)
                    raise event_error(ev)
                if ev.kind == "progress":
                    chunk = {"index": self.index, "content": "", "tokens": [], "stop": False,
                             "id_slot": self._slot(), "tokens_predicted": 0,
                             "tokens_evaluated": len(self.prepared.ids),
                             "prompt_progress": ev.stats}
                    if self.req.timings_per_token:
                        chunk["timings"] = progress_timings(ev.stats)
                    yield chunk
                elif ev.kind == "token":
                    self.tokens.append(ev.token)
                    self.text.append(ev.text)
                    prob = self._prob(ev)
                    chunk = {"index": self.index, "content": ev.text, "tokens": [ev.token],
                             "stop": False,
                             "id_slot": self._slot(), "tokens_predicted": len(self.tokens),
                             "tokens_evaluated": len(self.prepared.ids)}
                    if prob is not None:
                        self.probs.append(prob)
                        chunk["completion_probabilities"] = [prob]
                    yield chunk
                else:
                    outcome.final(ev)
                    self.text.append(ev.text)
                    yield await self._final(ev, tail=ev.text)
        finally:
            outcome.close(self.sup)

    def _slot(self) -> int:
        return self.ticket.seat if self.ticket.seat is not None else -1

    def _prob(self, ev) -> dict[str, Any] | None:
        if not self.req.n_probs or ev.logprobs is None:
            return None
        raw, logprob, top = ev.logprobs
        ids = ev.logprob_ids or [ev.token, []]
        post = self.req.post_sampling_probs

        def entry(tid: int, b: bytes, lp: float) -> dict[str, Any]:
            out = {"id": tid, "token": bytes(b).decode("utf-8", "replace"), "bytes": list(bytes(b))}
            out["prob" if post else "logprob"] = math.exp(lp) if post else lp
            return out

        alts = [entry(t, b, v) for t, (b, v) in zip(ids[1], top)
                if not (post and math.exp(v) <= 0.0)]
        return {**entry(ev.token, raw, logprob), ("top_probs" if post else "top_logprobs"): alts}

    async def _final(self, ev, tail: str) -> dict[str, Any]:
        st = ev.stats or {}
        content = "".join(self.text)
        n_prompt = st.get("prompt_tokens", len(self.prepared.ids))
        if ev.finish_reason == "length":
            stop_type, word = "limit", ""
        elif ev.finish_reason == "stop":
            stop_type, word = st.get("stop_type", "eos"), st.get("stopping_word", "")
        else:
            stop_type, word = "none", ""
        body: dict[str, Any] = {
            "index": self.index, "content": tail if self.job.stream else content,
            "tokens": self.tokens if self.req.return_tokens and not self.job.stream else [],
            "id_slot": self._slot(), "stop": True, "model": self.job.model,
            "tokens_predicted": len(self.tokens), "tokens_evaluated": n_prompt,
            "generation_settings": self.settings, "prompt": await self._prompt_text(),
            "has_new_line": "\n" in content, "truncated": False, "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": n_prompt + len(self.tokens), "timings": timings(st)}
        if self.req.n_probs and not self.job.stream:
            body["completion_probabilities"] = self.probs
        return body

    async def _prompt_text(self) -> str:
        try:
            return ((await self.sup.ask(Detokenize, tokens=self.prepared.ids,
                                        timeout=5.0)).content or "")
        except ApiError:
            return ""


def generation_settings(job: Job, req: NativeRequest, seed: int) -> dict[str, Any]:
    """llama.cpp's generation_settings: the sampling this request runs with (only what this engine
    has, plus the samplers llama.cpp has and this engine has not, at their off values)."""
    p = job.params
    n = p.max_tokens
    grammar = p.grammar
    return {"n_predict": n if n is not None else -1, "seed": p.seed if p.seed is not None else seed,
            "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "repeat_last_n": p.repeat_last_n, "repeat_penalty": p.repeat_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "max_tokens": n if n is not None else -1, "ignore_eos": p.ignore_eos,
            "stream": job.stream, "n_probs": req.n_probs,
            "post_sampling_probs": req.post_sampling_probs, "stop": p.stop,
            "grammar": grammar[1] if grammar else "",
            # llama.cpp's shape; a ban (-100 here, false in a request) is its -inf, which its JSON
            # writes as null
            "logit_bias": [{"bias": None if b <= -100 else b, "token": t}
                           for t, b in p.logit_bias or ()],
            "timings_per_token": req.timings_per_token,
            # llama.cpp's samplers this engine does not have, at the values that turn them off
            "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0,
            "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0,
            "mirostat": 0, "adaptive_target": -1.0, "adaptive_decay": 0.9, "n_keep": 0,
            "n_discard": 0, "min_keep": 0,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "speculative.n_max": 0, "lora": []}


def pick_fields(body: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama.cpp's response_fields: only these paths ("generation_settings/n_predict"), keyed by the
    path."""
    if not fields:
        return body
    out = {}
    for path in fields:
        value: Any = body
        for part in path.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            out[path] = value
    return out


async def answer(sup, jobs: list[Job], req: NativeRequest, seed: int, on_done, stream: bool,
                 watch=None):
    """Start every prompt (a 4xx before any byte is sent), then the whole body (a list for several
    prompts) or an async iterator of SSE bytes."""
    runs = [_One(sup, job, req, k, generation_settings(job, req, seed), on_done)
            for k, job in enumerate(jobs)]
    started = []
    try:
        for run in runs:
            await run.begin()
            started.append(run)
    except BaseException:
        for run in started:
            sup.cancel(run.ticket)
        raise
    if stream:
        return _stream(runs, req)
    watcher = (asyncio.create_task(watch([run.ticket for run in runs])) if watch is not None
               else None)
    try:
        bodies = await asyncio.gather(*(_last(run) for run in runs))
    finally:
        if watcher is not None:
            watcher.cancel()
    bodies = [pick_fields(b, req.response_fields) for b in bodies]
    return bodies[0] if len(bodies) == 1 else bodies


async def _last(run: _One) -> dict[str, Any]:
    body = None
    async for chunk in run.chunks():
        body = chunk
    if body is None:
        raise ApiError(500, "the engine ended the request without an answer")
    return body


async def _stream(runs: list[_One], req: NativeRequest) -> AsyncIterator[bytes]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: _One) -> None:
        try:
            async for chunk in run.chunks():
                await queue.put(chunk)
        except ApiError as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    left = len(runs)
    try:
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, ApiError):
                yield sse(item.body())
            else:
                yield sse(item)
    finally:
        for t in tasks:
            t.cancel()

