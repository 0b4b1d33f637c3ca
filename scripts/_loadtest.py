"""What the load scripts (ladder.py, replay.py) share: one streamed chat request, measured; the
server's health, fault ledger and metrics; prompts of a given token length; a server started for the
run.

Everything speaks the OpenAI streaming API (plus llama.cpp's `timings`, /health and /faults where
the server has them), so the scripts also run against llama.cpp's server or any other compatible
one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

# ---- one request ---------------------------------------------------------------------------------


@dataclass
class Result:
    """One streamed chat request as the client saw it. Rates come from the server's `timings` when
    it sends them, else they are measured here (`measured` says which)."""

    ok: bool = False
    error: str | None = None
    status: int | None = None               # HTTP status
    sent_s: float = 0.0                     # when it was sent, seconds since the run began
    ttft_s: float | None = None             # time to the first token (content or reasoning)
    latency_s: float = 0.0                  # time to the end of the stream (or the failure)
    prompt_tokens: int | None = None        # usage.prompt_tokens (all of the prompt)
    # timings.prompt_n (tokens read), cache_n (tokens reused)
    prompt_n: int | None = None
    cache_n: int | None = None
    prompt_tps: float | None = None
    decode_tps: float | None = None
    tokens: int = 0                         # tokens generated
    chunks: int = 0                         # SSE chunks that carried text
    finish_reason: str | None = None
    measured: bool = False
    # the answer's content (replay appends it to the history)
    text: str = field(default="", repr=False)
    # gaps between the chunks that carried text
    itl_s: list[float] = field(default_factory=list, repr=False)
    # the answer's, assembled from its deltas
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        d["itl_s"] = [round(x, 4) for x in self.itl_s]
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def error_message(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float,
                      t0: float, headers: dict[str, str] | None = None) -> Result:
    """POST a streamed chat completion and measure it. Never raises for what the server or the
    network does: every failure (HTTP status, an SSE error event, a stream cut short, the client
    timeout) is `error`."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = Result(sent_s=time.monotonic() - t0)
    start = time.monotonic()
    first = last = None
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    done = False
    pieces: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body,
                                     headers=headers) as resp:
                r.status = resp.status_code
                if resp.status_code != 200:
                    body_text = (await resp.aread()).decode(errors="replace")
                    r.error = f"HTTP {resp.status_code}: {error_message(body_text)}"
                    done = True
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if obj.get("error") is not None:
                            err = obj["error"]
                            r.error = str(err.get("message") if isinstance(err, dict) else err)
                            continue
                        for choice in obj.get("choices") or []:
                            delta = choice.get("delta") or {}
                            text = delta.get("content") or ""
                            add_tool_call_deltas(r.tool_calls, delta.get("tool_calls"))
                            if text or delta.get("reasoning_content") or delta.get("tool_calls"):
                                now = time.monotonic()
                                if last is not None:
                                    r.itl_s.append(now - last)
                                first = first or now
                                last = now
                                r.chunks += 1
                                pieces.append(text)
                            r.finish_reason = choice.get("finish_reason") or r.finish_reason
                        timings = obj.get("timings") or timings
                        usage = obj.get("usage") or usage
    except TimeoutError:
        r.error = f"no complete answer within the client timeout ({timeout:g} s)"
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except ValueError as e:                          # a data line that is not JSON
        r.error = f"unreadable stream: {e}"
    end = time.monotonic()
    r.latency_s = end - start
    r.ttft_s = first - start if first else None
    r.text = "".join(pieces)
    if r.error is None and not done:
        r.error = "the stream ended without [DONE]"
    elif r.error is None and r.finish_reason is None:
        r.error = "the stream ended without a finish_reason"
    r.ok = r.error is None
    _fill_figures(r, usage, timings, first, last)
    return r


def add_tool_call_deltas(calls: list[dict[str, Any]], deltas: Any) -> None:
    """OpenAI's streamed tool calls: each delta names its call by `index`; the first piece of a call
    brings its id, type and function name, later ones pieces of its arguments (a JSON text), in
    order."""
    for d in deltas or ():
        if not isinstance(d, dict):
            continue
        i = d.get("index", len(calls))
        i = i if isinstance(i, int) and 0 <= i < 64 else len(calls)
        while len(calls) <= i:
            calls.append({"id": None, "type": "function",
                          "function": {"name": "", "arguments": ""}})
        call, fn = calls[i], d.get("function") or {}
        call["id"] = d.get("id") or call["id"]
        call["type"] = d.get("type") or call["type"]
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


def latency_figures(results: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """TTFT, inter-token latency (every gap between chunks, pooled over the requests, as vLLM's
    benchmark does) and end-to-end latency, p50 and p95, of requests as `Result.to_json()` gives
    them (the ok ones)."""
    ok = [r for r in results if r["ok"]]
    itl = [gap for r in ok for gap in r.get("itl_s") or ()]
    out: dict[str, float | None] = {}
    for name, values in (("ttft", [r["ttft_s"] for r in ok]), ("itl", itl),
                         ("e2e", [r["latency_s"] for r in ok])):
        for q in (50, 95):
            out[f"{name}_p{q}_s"] = percentile(values, q)
    return out


def describe_latency(f: dict[str, float | None]) -> str:
    return (f"TTFT p50 / p95 {fmt(f['ttft_p50_s'], 2)} / {fmt(f['ttft_p95_s'], 2)} s, ITL p50 / "
            f"p95 {fmt(in_ms(f['itl_p50_s']), 1)} / {fmt(in_ms(f['itl_p95_s']), 1)} ms, e2e p50 / "
            f"p95 {fmt(f['e2e_p50_s'], 2)} / {fmt(f['e2e_p95_s'], 2)} s")


def in_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _fill_figures(r: Result, usage: dict, timings: dict, first: float | None,
                  last: float | None) -> None:
    r.prompt_tokens = usage.get("prompt_tokens")
    r.prompt_n = timings.get("prompt_n")
    r.cache_n = timings.get("cache_n")
    r.tokens = usage.get("completion_tokens") or timings.get("predicted_n") or r.chunks
    r.prompt_tps = timings.get("prompt_per_second") or None
    r.decode_tps = timings.get("predicted_per_second") or None
    if r.prompt_tps is None and r.ttft_s:
        read = r.prompt_n if r.prompt_n is not None else r.prompt_tokens
        r.prompt_tps = read / r.ttft_s if read else None
        r.measured = r.prompt_tps is not None
    if r.decode_tps is None and first and last and last > first and r.chunks > 1:
        # chunks after the first, over their span
        r.decode_tps = (r.chunks - 1) / (last - first)
        r.measured = True


# ---- the server's own view -----------------------------------------------------------------------


async def wait_healthy(client: httpx.AsyncClient, url: str, timeout: float) -> tuple[bool, str]:
    """Until GET /health is 200 (the engine may be loading or restarting after a fault) -> (ready,
    why not)."""
    end = time.monotonic() + timeout
    why = "no answer"
    while True:
        try:
            resp = await client.get(url.rstrip("/") + "/health", timeout=5.0)
            if resp.status_code == 200:
                return True, ""
            why = f"HTTP {resp.status_code}: {_health_reason(resp)}"
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
        if time.monotonic() >= end:
            return False, why
        await asyncio.sleep(0.25)


async def wait_built(client: httpx.AsyncClient, url: str, headers: dict[str, str] | None,
                     timeout: float) -> float:
    """Until strata-jax's builder thread has compiled what its warm-up queued
    (strata_programs_building 0 on /metrics), so the first level does not share the CPU with
    background compiles (llama.cpp's server has none to do) -> seconds waited. A server without that
    metric (another engine) is not waited for."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            text = (await client.get(url.rstrip("/") + "/metrics", headers=headers,
                                     timeout=10.0)).text
        except httpx.HTTPError:
            return time.monotonic() - t0
        line = next((ln for ln in text.splitlines()
                     if ln.startswith("strata_programs_building")), None)
        if line is None or float(line.split()[-1]) == 0:
            break
        await asyncio.sleep(0.5)
    return time.monotonic() - t0


def _health_reason(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        return str(body.get("reason") or body.get("status") or body)
    except ValueError:
        return resp.text[:200]


async def get_faults(client: httpx.AsyncClient, url: str,
                     headers: dict[str, str] | None) -> dict[str, Any] | None:
    """GET /faults ({"total", "faults": [...], ...}); None where the server has no such route."""
    try:
        resp = await client.get(url.rstrip("/") + "/faults", headers=headers, timeout=10.0)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def new_faults(before: dict[str, Any] | None,
               after: dict[str, Any] | None) -> tuple[int, list[dict[str, Any]]]:
    """Engine exits between two /faults readings -> (count, the entries the ledger still holds)."""
    if after is None:
        return 0, []
    count = after.get("total", 0) - (before or {}).get("total", 0)
    return count, list(after.get("faults") or [])[-count:] if count > 0 else []


async def get_metrics(client: httpx.AsyncClient, url: str,
                      headers: dict[str, str] | None) -> dict[str, float]:
    """GET /metrics (Prometheus text) as {"name{labels}": value}; {} where the server has none."""
    try:
        resp = await client.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    if resp.status_code == 200:
        for line in resp.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
    return out


PROGRAM_KEYS = ("built", "live", "evicted", "oom_recoveries", "bytes")


def program_figures(metrics: dict[str, float]) -> dict[str, float]:
    """The window-program counters and engine restarts of strata-jax's /metrics."""
    out = {k: metrics[f"strata_programs_{k}"] for k in PROGRAM_KEYS
           if f"strata_programs_{k}" in metrics}
    for key, name in (("engine_restarts", "strata_engine_restarts_total"),
                      ("engine_generation", "strata_engine_generation")):
        if name in metrics:
            out[key] = metrics[name]
    return out


def describe_programs(p: dict[str, float]) -> str:
    if not p:
        return "no strata program metrics at /metrics"
    parts = [f"{k.replace('_', ' ')} {int(p[k])}"
             for k in ("built", "live", "evicted", "oom_recoveries") if k in p]
    if "bytes" in p:
        parts.append(f"{p['bytes'] / 2**20:.1f} MiB live")
    if "engine_generation" in p:
        parts.append(f"engine process {int(p['engine_generation'])}")
    return "programs (this engine process): " + ", ".join(parts)


# ---- prompts -------------------------------------------------------------------------------------

_WORD_TEXT = ("the river market engine slot window program memory device kernel expert router "
              "token layer cache harbor lantern orchard quarry signal meadow copper ledger canvas "
              "pilot summit glacier thunder village archive compass beacon violet marble falcon "
              "timber crystal ember valley anchor quietly slowly early later often never always "
              "briefly finally suddenly carefully openly builds carries counts drifts finds "
              "gathers holds keeps lifts measures notes opens packs reads shapes tracks turns "
              "waits writes answers follows crosses maps bends rests red green amber northern "
              "narrow ancient hollow bright silent distant heavy gentle rapid of in on under over "
              "beside through across toward within after before during and but while")
_WORDS = _WORD_TEXT.split()


def filler(rng: random.Random, n_chars: int) -> str:
    """Plain English-like sentences, about n_chars long (random words: no two texts share much)."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
        sentence = " ".join(words).capitalize() + rng.choice(".....;!?") + " "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:max(n_chars, 0)]


def unique_id(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))


def ladder_messages(uid: str, text: str) -> list[dict[str, str]]:
    """A system message that starts with the request's own id (so no two prompts share more than the
    chat template's first tokens), then the text and a question about it."""
    return [{"role": "system", "content": f"Request {uid}."},
            {"role": "user", "content": f"{text}\n\nSummarize the text above."}]


class TokenCounter:
    """Counts a chat's prompt tokens the way the server will: exactly with the model's tokenizer
    (`--tokenizer MODEL.gguf`), else by asking the server (a request it must refuse: max_tokens
    beyond any context, whose 400 exceed_context_size_error names n_prompt_tokens and n_ctx, costs
    no generation), else ~4 chars a token."""

    def __init__(self, tokenizer: Any = None, chars_per_token: float = 4.0):
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token
        # template tokens a chat adds beyond its messages (estimate only)
        self.overhead = 0
        # template tokens a message adds (ChatML: 5; estimate only)
        self.per_message = 6
        self.n_ctx: int | None = None       # the server's context, when a refusal said it
        self.source = "tokenizer" if tokenizer is not None else "estimate (~4 chars a token)"

    @classmethod
    def from_gguf(cls, path: str) -> TokenCounter:
        from strata_jax.gguf import load_tokenizer
        return cls(load_tokenizer(path))

    def local(self, messages: list[dict[str, Any]],
              template_kwargs: dict[str, Any] | None = None) -> int:
        """The exact count with the tokenizer, else the calibrated estimate."""
        if self.tokenizer is None:
            return self.overhead + sum(math.ceil(len(str(m.get("content") or ""))
                                                 / self.chars_per_token)
                                       + self.per_message for m in messages)
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=True,
                                       **(template_kwargs or {}))
        bos = getattr(tok, "bos_token", None)
        return len(tok.encode(text, add_special=not (bos and text.startswith(bos))))

    async def server(self, client: httpx.AsyncClient, url: str, messages: list[dict[str, Any]],
                     template_kwargs: dict[str, Any] | None,
                     headers: dict[str, str] | None) -> int | None:
        """The server's own count of the chat's prompt tokens (None when it does not say)."""
        body = {"messages": messages, "max_tokens": 1 << 24, "stream": False}
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        try:
            resp = await client.post(url.rstrip("/") + "/v1/chat/completions", json=body,
                                     headers=headers, timeout=60.0)
            err = resp.json().get("error") or {}
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if isinstance(err, dict) and err.get("n_prompt_tokens") is not None:
            self.n_ctx = err.get("n_ctx") or self.n_ctx
            return int(err["n_prompt_tokens"])
        return None

    async def calibrate(self, client: httpx.AsyncClient, url: str,
                        template_kwargs: dict[str, Any] | None,
                        headers: dict[str, str] | None) -> None:
        """Learn chars a token and the template's overhead from two counts by the server."""
        if self.tokenizer is not None:
            return
        rng = random.Random(1234)
        uid, text = unique_id(rng), filler(rng, 4000)
        small = await self.server(client, url, ladder_messages(uid, ""), template_kwargs, headers)
        big = await self.server(client, url, ladder_messages(uid, text), template_kwargs, headers)
        if small is None or big is None or big <= small:
            return
        self.chars_per_token = len(text) / (big - small)
        self.overhead = 0
        self.overhead = small - self.local(ladder_messages(uid, ""))
        self.source = f"server's counts ({self.chars_per_token:.2f} chars a token)"

    async def count(self, client: httpx.AsyncClient, url: str, messages: list[dict[str, Any]],
                    template_kwargs: dict[str, Any] | None, headers: dict[str, str] | None) -> int:
        if self.tokenizer is None:
            n = await self.server(client, url, messages, template_kwargs, headers)
            if n is not None:
                return n
        return self.local(messages, template_kwargs)


async def prompt_of(counter: TokenCounter, client: httpx.AsyncClient, url: str, rng: random.Random,
                    tokens: int,
                    template_kwargs: dict[str, Any] | None, headers: dict[str, str] | None
                    ) -> tuple[list[dict[str, str]], int]:
    """Ladder messages of about `tokens` prompt tokens -> (messages, their count); the filler is cut
    to size in up to four rounds."""
    uid = unique_id(rng)
    base = await counter.count(client, url, ladder_messages(uid, ""), template_kwargs, headers)
    chars = max(0, round((tokens - base) * counter.chars_per_token))
    text = filler(rng, chars + 400)
    n = base
    for _ in range(4):
        messages = ladder_messages(uid, text[:chars])
        n = await counter.count(client, url, messages, template_kwargs, headers)
        if abs(n - tokens) <= max(2, tokens // 200):
            break
        chars = max(0, chars + round((tokens - n) * counter.chars_per_token))
        if chars > len(text):
            text += " " + filler(rng, chars - len(text) + 400)
    return ladder_messages(uid, text[:chars]), n


# ---- figures -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between points; None for no values."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def median(values: Sequence[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- the command line and a server of our own ----------------------------------------------------


def split_server_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """argv before `--` (the script's) and after it (flags for `strata-jax serve`)."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def parse_script_args(p: argparse.ArgumentParser,
                      argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The script's own flags, and the flags for `strata-jax serve`: with --start-server, every flag
    the script does not know goes to the server (`--start-server MODEL --parallel 8 --levels 1,2`),
    as does all after `--`. Without --start-server an unknown flag is an error. The parser must not
    take abbreviations (allow_abbrev=False), or `--max` would pass for a flag of the script's."""
    own, after = split_server_args(argv)
    args, unknown = p.parse_known_args(own)
    if unknown and not args.start_server:
        p.error(f"unrecognized arguments: {' '.join(unknown)} (server flags go with --start-server "
                "MODEL)")
    if after and not args.start_server:
        p.error(f"server flags after `--` ({' '.join(after)}) need --start-server MODEL")
    return args, unknown + after


def add_common_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    where.add_argument("--start-server", metavar="MODEL", help="start `strata-jax serve MODEL` on "
                       "a free port for the run (its flags after `--`) and stop it after")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--model", help="the request's model field (default: none sent)")
    g.add_argument("--health-timeout", type=float, default=300.0, metavar="S",
                   help="how long to wait for GET /health 200 (loading, or restarting after a "
                        "fault) (default 300)")
    g.add_argument("--server-log", metavar="FILE",
                   help="with --start-server: keep the server's output in FILE")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="client timeout of each request, seconds (default 600)")
    p.add_argument("--tokenizer", metavar="MODEL.gguf",
                   help="count prompt tokens with this model's tokenizer (default: ask the server, "
                   "else ~4 chars a token)")
    p.add_argument("--reasoning", choices=("on", "off"),
                   help="chat_template_kwargs.enable_thinking (default: not sent)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and of the sampling (default 0)")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")


def headers_of(args: argparse.Namespace) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None


def template_kwargs_of(args: argparse.Namespace) -> dict[str, Any] | None:
    return None if args.reasoning is None else {"enable_thinking": args.reasoning == "on"}


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` among server flags."""
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return flags[i + 1]
        if f.startswith(name + "="):
            return f.split("=", 1)[1]
    return None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class ServerStartError(Exception):
    """The server started for the run exited, or did not answer in time."""


class Server:
    """The server the run talks to: the one at --url, or `strata-jax serve` started for it."""

    def __init__(self, args: argparse.Namespace, server_flags: list[str]):
        self.args, self.flags, self.proc = args, server_flags, None
        # with --start-server: LOG_MARKS counted at the end
        self.log_counts: dict[str, int] | None = None
        self.url = args.url

    def __enter__(self) -> Self:
        # SIGTERM (a job runner, `timeout`) ends the run as Ctrl-C does, so that the server we
        # started stops too
        self._sigterm = signal.signal(signal.SIGTERM, _interrupt)
        if self.args.start_server:
            # run from a checkout, not installed
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from strata_jax.serve.launch import ServerProcess
            self.proc = ServerProcess([self.args.start_server, *self.flags],
                                      api_key=self.args.api_key)
            self.url = self.proc.url
            print(f"started strata-jax serve {' '.join([self.args.start_server, *self.flags])} on "
                  f"{self.url}", file=sys.stderr)
            try:
                self.proc.wait_up(timeout=self.args.health_timeout)
            except (RuntimeError, TimeoutError) as e:
                self.__exit__()
                raise ServerStartError(str(e)) from None
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._sigterm)
        if self.proc is not None:
            code = self.proc.stop()
            text = self.proc.log()
            if self.args.server_log:
                Path(self.args.server_log).write_text(text)
            self.proc.__exit__()
            self.log_counts = server_log_counts(text)
            print(f"stopped the server (exit code {code})", file=sys.stderr)


# lines of the server's log (--start-server) that say what the program cache and the supervisor did
LOG_MARKS = {"program_frees": "no device memory for a window program: freed",
             "split_windows": "running its rows in smaller windows",
             "engine_starts": " started (pid "}


def server_log_counts(text: str) -> dict[str, int]:
    """How many lines of the server's log carry each of LOG_MARKS."""
    lines = text.splitlines()
    return {k: sum(mark in line for line in lines) for k, mark in LOG_MARKS.items()}


def describe_log(counts: dict[str, int] | None) -> str:
    if counts is None:
        return "server log: not ours (--url)"
    return (f"server log: {counts['program_frees']} 'no device memory for a window program: freed "
            f"N older layouts' lines, {counts['split_windows']} windows split, "
            f"{counts['engine_starts']} engine process starts")


def write_json(path: str | None, obj: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=1) + "\n")


def client_of(concurrency: int, timeout: float) -> httpx.AsyncClient:
    n = concurrency + 8
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
