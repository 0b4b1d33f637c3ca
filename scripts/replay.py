"""Simulated agent users over the OpenAI streaming API: the multi-user replay that found Strata
#997's leak.

Each of `--users` users holds a multi-turn conversation. A turn sends the whole history plus one new
message: a short instruction, a follow-up, a pasted log (a user message), or a long tool output
(`role: tool`, answering a tool call the previous assistant message made), streams the answer,
appends it, thinks for a short random time (`--think 0.5,3`) and goes on. Histories are kept within
the server's context: when prompt plus `--max-tokens` would not fit `--max-context`, the oldest
exchanges are dropped, and when even the newest turn would not fit the conversation starts over.

`--tool-users N` of the users (default: half) are agents that call tools: each of their turns sends
`tools` (get_weather, calculator, read_file, run_command: scripts/_agent.py) and some of their tasks
ask for them; when an answer has `tool_calls` the agent runs each call here, sends the results back
as `role: tool` messages in its next turn (no new user message), and goes on, up to
`--max-tool-rounds` rounds in a row (then it asks with `tool_choice: "none"`); when an answer calls
no tool, it carries on with plain turns. The other users make up their tool calls (the assistant
message gets a read_file or run_command call the server did not make, and the next turn sends its
long output), so they work with a server without tools.

After `--minutes` no turn starts; turns in flight get `--grace` seconds to finish (those that do not
are failures). The report: requests, failures, p50/p95 time to first token, inter-token latency (the
gaps between streamed chunks, pooled) and end-to-end latency, the agents' tool calls, prefix reuse
(the share of prompt tokens the server reused: sum of timings.cache_n over sum of cache_n +
prompt_n), and the engine restarts the server's fault ledger (GET /faults) recorded during the run.

    python scripts/replay.py --url http://127.0.0.1:8000 --users 8 --minutes 5 --max-context 8192
    python scripts/replay.py --start-server model.gguf --users 8 --minutes 5 --parallel 8
        --max-context 2048

`--api messages` sends every turn to Anthropic's `POST /v1/messages` instead (as Claude Code does:
system text, tool_use / tool_result blocks, tools with input_schema: scripts/_messages_client.py),
measured the same way. The report also gives each turn number's figures (the n-th request of a
conversation: its count, TTFT p50 and prefix reuse), which show the prefix cache at work as
histories grow.

Exit code: 0 when every request succeeded and the engine never restarted, 1 otherwise, 2 when the
server never became ready (or bad settings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _agent import TOOLS, run_tool, tool_task
from _loadtest import (
    Result,
    Server,
    ServerStartError,
    TokenCounter,
    add_common_flags,
    client_of,
    describe_log,
    describe_programs,
    filler,
    flag_value,
    fmt,
    get_faults,
    get_metrics,
    headers_of,
    in_ms,
    latency_figures,
    new_faults,
    parse_script_args,
    percentile,
    program_figures,
    stream_chat,
    template_kwargs_of,
    unique_id,
    wait_healthy,
    write_json,
)
from _messages_client import stream_messages

console = Console(highlight=False)
DEFAULT_CONTEXT = 4096


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="With --start-server, flags the script does not know (and "
                                "all after `--`) go to `strata-jax serve`.")
    add_common_flags(p)
    p.add_argument("--users", type=int, default=8,
                   help="simulated users, each one conversation at a time (default 8)")
    p.add_argument("--minutes", type=float, default=5.0,
                   help="start turns for this long (default 5)")
    p.add_argument("--grace", type=float, default=120.0, metavar="S",
                   help="then wait at most S seconds for the turns in flight (default 120)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens a turn (default 256)")
    p.add_argument("--max-context", type=int,
                   help="the server's context a slot (default: --max-context of the server flags, "
                        f"else what the server says, else {DEFAULT_CONTEXT})")
    p.add_argument("--long-tokens", type=int, help="longest tool output or pasted log, tokens "
                   "(default: a quarter of the context, at most 4000)")
    p.add_argument("--think", default="0.5,3", metavar="MIN,MAX",
                   help="think time between turns, seconds (default 0.5,3)")
    p.add_argument("--tool-users", type=int,
                   help="users that are tool-calling agents (default: half of --users)")
    p.add_argument("--max-tool-rounds", type=int, default=4, help="tool-call rounds in a row "
                   "before an agent asks with tool_choice none (default 4)")
    p.add_argument("--api", choices=("chat", "messages"), default="chat",
                   help="the route each turn goes to: OpenAI's /v1/chat/completions (default) or "
                        "Anthropic's /v1/messages")
    p.add_argument("--progress", type=float, default=15.0, metavar="S",
                   help="a status line every S seconds (default 15; 0: none)")
    args, server_flags = parse_script_args(p, argv)
    try:
        args.think = tuple(float(x) for x in args.think.split(","))
        assert len(args.think) == 2 and 0 <= args.think[0] <= args.think[1]
    except (ValueError, AssertionError):
        p.error(f"--think {args.think!r}: give MIN,MAX seconds with 0 <= MIN <= MAX (e.g. 0.5,3)")
    args.tool_users = args.users // 2 if args.tool_users is None else args.tool_users
    if not 0 <= args.tool_users <= args.users:
        p.error(f"--tool-users {args.tool_users}: give 0 to --users ({args.users})")
    for name, value in (("--users", args.users), ("--max-tokens", args.max_tokens),
                        ("--max-tool-rounds", args.max_tool_rounds)):
        if value < 1:
            p.error(f"{name} must be at least 1 (got {value})")
    if args.minutes <= 0 or args.grace < 0 or args.timeout <= 0:
        p.error("--minutes and --timeout must be positive, --grace not negative")
    if args.max_context is None and flag_value(server_flags, "--max-context"):
        args.max_context = int(flag_value(server_flags, "--max-context"))
    elif (args.start_server and args.max_context is not None
          and flag_value(server_flags, "--max-context") is None):
        # the script's flag, and the server's
        server_flags += ["--max-context", str(args.max_context)]
    return args, server_flags


# ---- what agents say -----------------------------------------------------------------------------

_REPOS = ("billing-api", "ingest-worker", "web-frontend", "search-indexer", "auth-service",
          "data-pipeline")
_FILES = ("src/server.py", "src/handlers/orders.py", "lib/cache.ts", "cmd/main.go",
          "pkg/queue/queue.go", "tests/test_api.py", "src/db/migrations.sql", "Cargo.toml",
          "src/lib.rs", "config/settings.yaml")
_TASKS = ("fix the failing test in {f}", "add retries with backoff to the HTTP client in {f}",
          "find why requests to /orders time out under load and patch {f}",
          "refactor {f} so the cache is injected",
          "write a migration that adds an index on created_at, see {f}",
          "upgrade the logging setup in {f}", "explain what {f} does and list its risky parts",
          "make the build pass again; the CI log points at {f}")
_FOLLOWUPS = ("That did not work, the same error is still there. Try another approach.",
              "Good. Now run the tests.", "Can you make it shorter and keep the behaviour?",
              "Also handle the empty input case.",
              "Explain the change in two sentences before you go on.",
              "Check {f} too, it has the same pattern.",
              "Revert the last change and try a smaller fix.", "Now update the docs for it.")
_LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")
_EVENTS = ("request {h} took {n} ms", "worker-{k} picked job {h}", "cache miss for key user:{n}",
           "retrying connection to db-{k} (attempt {k})", "GET /orders/{n} 200 in {n} ms",
           "POST /orders 500: upstream timeout after {n} ms", "gc pause {n} ms",
           "flushed {n} rows to table events")


def _fill(rng: random.Random, text: str) -> str:
    return text.format(f=rng.choice(_FILES), h=unique_id(rng)[:8], n=rng.randint(1, 9999),
                       k=rng.randint(1, 9))


def log_lines(rng: random.Random, chars: int) -> str:
    lines, size, t = [], 0, rng.randint(0, 86000)
    while size < chars:
        t += rng.randint(0, 3)
        line = (f"2026-10-05T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}"
                f".{rng.randint(0, 999):03d}Z {rng.choice(_LEVELS):5s} "
                f"{_fill(rng, rng.choice(_EVENTS))}")
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:chars]


def code_listing(rng: random.Random, chars: int) -> str:
    lines, size, n = [], 0, 1
    while size < chars:
        name = unique_id(rng)[:6]
        block = (f"{n:4d}  def handle_{name}(request, retries={rng.randint(1, 5)}):\n"
                 f"{n + 1:4d}      # {filler(rng, rng.randint(20, 60)).strip()}\n"
                 f"{n + 2:4d}      value = cache.get('{name}') or db.fetch({rng.randint(1, 999)})\n"
                 f"{n + 3:4d}      return respond(value, "
                 f"status={rng.choice((200, 201, 404, 500))})\n")
        lines.append(block)
        size += len(block)
        n += 4
    return "".join(lines)[:chars]


class Conversation:
    """One user's chat history, kept within the context. The history always ends with an assistant
    message (or is only the system message); a turn adds one new message (an agent's: the results of
    the tool calls the last answer made) and, on success, the answer. `tools`: an agent that sends
    TOOLS (scripts/_agent.py)."""

    def __init__(self, user: int, rng: random.Random, counter: TokenCounter, budget: int,
                 long_tokens: int, template_kwargs: dict[str, Any] | None, tools: bool = False):
        self.user, self.rng, self.counter, self.budget, self.long = (user, rng, counter, budget,
                                                                     long_tokens)
        self.kwargs, self.tools = template_kwargs, tools
        self.started = self.trims = 0
        self.scale = 1.0                     # the server's count over our estimate, as last seen
        self.next_kind = "task"
        # role: tool messages answering the last answer's calls
        self.pending: list[dict[str, Any]] = []
        self.tool_rounds = 0                 # answers with tool calls in a row
        self.tool_calls = self.bad_tool_calls = 0
        # the tool definitions are in the prompt too where the template renders them: counted as
        # their JSON
        self.tools_tokens = round(len(json.dumps(TOOLS)) / counter.chars_per_token) if tools else 0
        self.start()

    def start(self) -> None:
        self.started += 1
        self.repo = self.rng.choice(_REPOS)
        self.history: list[dict[str, Any]] = [{"role": "system", "content": (
            f"Session {unique_id(self.rng)} of user {self.user}. You are a coding agent working in "
            f"the {self.repo} repository. Use the tools when you need to look at files or run "
            "commands, and answer briefly.")}]
        self.next_kind = "task"
        self.pending, self.tool_rounds = [], 0

    def _chars(self, tokens: int) -> int:
        return max(16, int(tokens * self.counter.chars_per_token / self.scale))

    def new_message(self) -> dict[str, Any]:
        rng, kind = self.rng, self.next_kind
        if kind == "task" and self.tools and rng.random() < 0.6:
            return {"role": "user", "content": f"In {self.repo}: {tool_task(rng, _FILES)}"}
        if kind == "task":
            return {"role": "user", "content": f"In {self.repo}: {_fill(rng, rng.choice(_TASKS))}. "
                    + filler(rng, self._chars(rng.randint(10, 60)))}
        if kind == "followup":
            return {"role": "user", "content": _fill(rng, rng.choice(_FOLLOWUPS))}
        size = self._chars(rng.randint(50, 300) if rng.random() < 0.6
                           else rng.randint(300, max(self.long, 301)))
        if kind == "log":
            cmd = rng.choice(("kubectl logs deploy/api", "journalctl -u worker", "cat build.log",
                              "pytest -x"))
            return {"role": "user", "content": f"Here is the output of `{cmd}`:\n```\n"
                                               f"{log_lines(rng, size)}\n```\nWhat is going wrong?"}
        call = (self.history[-1].get("tool_calls") or [{}])[0]
        return {"role": "tool", "tool_call_id": call.get("id", "call_0"),
                "content": self.tool_output(call.get("function", {}).get("name"), {})}

    def tool_output(self, name: str | None, args: dict[str, Any]) -> str:
        """A long tool output: a code listing (read_file) or a log (run_command, or anything
        else)."""
        rng = self.rng
        size = self._chars(rng.randint(50, 300) if rng.random() < 0.6
                           else rng.randint(300, max(self.long, 301)))
        return code_listing(rng, size) if name == "read_file" else log_lines(rng, size)

    def estimate(self, messages: list[dict[str, Any]]) -> int:
        n = self.counter.local(messages, self.kwargs) + self.tools_tokens
        return n if self.counter.tokenizer is not None else int(n * max(1.0, self.scale))

    def turn(self) -> tuple[list[dict[str, Any]], str]:
        """The messages to send (history + the new ones, trimmed to fit) and the turn's kind."""
        if self.pending:
            kind, new = "tool_result", self.pending
        else:
            kind, new = self.next_kind, [self.new_message()]
        while self.estimate(self.history + new) > self.budget and len(self.history) > 1:
            self.trim()
        # its call was trimmed away
        if new[0]["role"] == "tool" and not self.history[-1].get("tool_calls"):
            new = [{"role": "user",
                    "content": "A tool printed this:\n" + "\n".join(m["content"] for m in new)}]
        # even alone it does not fit
        if self.estimate(self.history + new) > self.budget:
            self.start()
            kind, new = "task", [self.new_message()]
        return self.history + new, kind

    def offers_tools(self, max_rounds: int) -> dict[str, Any]:
        """The request fields of an agent's turn: its tools, and after max_rounds answers with calls
        in a row tool_choice none (an answer in words is due)."""
        if not self.tools:
            return {}
        return {"tools": TOOLS, "tool_choice": "none" if self.tool_rounds >= max_rounds else "auto"}

    def trim(self) -> None:
        """Drop the oldest exchange: from the first message after the system one up to the next user
        one."""
        self.trims += 1
        del self.history[1]
        while len(self.history) > 1 and self.history[1]["role"] != "user":
            del self.history[1]

    def answered(self, sent: list[dict[str, Any]], result: Result) -> None:
        if result.prompt_tokens and self.counter.tokenizer is None:
            self.scale = result.prompt_tokens / max(1, self.counter.local(sent, self.kwargs))
        self.pending = []
        if self.tools and result.tool_calls:
            self.run_calls(sent, result)
            return
        self.tool_rounds = 0
        r = self.rng.random()
        if self.tools:          # an agent's calls are the server's own: no made-up ones
            self.next_kind = "task" if r < 0.3 else "log" if r < 0.45 else "followup"
        else:
            self.next_kind = "tool" if r < 0.4 else "log" if r < 0.55 else "followup"
        reply: dict[str, Any] = {"role": "assistant", "content": result.text}
        if self.next_kind == "tool":
            name = self.rng.choice(("read_file", "run_command"))
            args = ({"path": self.rng.choice(_FILES)} if name == "read_file"
                    else {"command": "pytest -x -q"})
            reply["tool_calls"] = [{"id": f"call_{unique_id(self.rng)}", "type": "function",
                                    "function": {"name": name, "arguments": json.dumps(args)}}]
        self.history = sent + [reply]

    def run_calls(self, sent: list[dict[str, Any]], result: Result) -> None:
        """The answer called tools: run each here; their results are the next turn's messages."""
        calls = []
        for call in result.tool_calls:
            fn = call.get("function") or {}
            calls.append({"id": call.get("id") or f"call_{unique_id(self.rng)}", "type": "function",
                          "function": {"name": fn.get("name") or "",
                                       "arguments": fn.get("arguments") or "{}"}})
        for call in calls:
            content, well_formed = run_tool(call, self.tool_output)
            self.tool_calls += 1
            self.bad_tool_calls += not well_formed
            self.pending.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        self.tool_rounds += 1
        self.history = sent + [{"role": "assistant", "content": result.text, "tool_calls": calls}]


# ---- the run -------------------------------------------------------------------------------------


class Replay:
    def __init__(self, args: argparse.Namespace, url: str):
        self.args, self.url = args, url
        self.headers, self.kwargs = headers_of(args), template_kwargs_of(args)
        self.records: list[dict[str, Any]] = []
        self.in_flight: dict[int, dict[str, Any]] = {}
        self.context_retries = 0
        # agents whose tools did not fit the server's context with a fresh conversation
        self.tools_dropped = 0
        self.conversations: list[Conversation] = []

    def body(self, messages: list[dict[str, Any]], seed: int, conv: Conversation) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.args.max_tokens,
                                "seed": seed, **conv.offers_tools(self.args.max_tool_rounds)}
        if self.args.model:
            body["model"] = self.args.model
        if self.args.temperature is not None:
            body["temperature"] = self.args.temperature
        if self.kwargs:
            body["chat_template_kwargs"] = self.kwargs
        return body

    async def user(self, client, i: int, counter: TokenCounter, budget: int,
                   long_tokens: int) -> None:
        a = self.args
        rng = random.Random(a.seed * 1_000_003 + i)
        conv = Conversation(i, rng, counter, budget, long_tokens, self.kwargs,
                            tools=i < a.tool_users)
        self.conversations.append(conv)
        await asyncio.sleep(rng.uniform(0, a.think[1]))          # users do not all start at once
        n = 0
        while time.monotonic() < self.stop_at:
            messages, kind = conv.turn()
            n += 1
            self.in_flight[i] = {"user": i, "turn": n, "kind": kind,
                                 "sent_s": time.monotonic() - self.t0}
            body = self.body(messages, rng.randrange(1 << 31), conv)
            send = stream_messages if a.api == "messages" else stream_chat
            result = await send(client, self.url, body, a.timeout, self.t0, self.headers)
            del self.in_flight[i]
            if result.status == 400 and "exceed" in (result.error or ""):
                # our estimate was short: trim, and try again
                self.context_retries += 1
                if len(conv.history) > 1:
                    conv.trim()
                elif conv.tools and kind == "task":
                    # a fresh conversation refused: the server's tool descriptions alone fill its
                    # context; this user goes on without tools (retrying the same request would loop
                    # for ever)
                    conv.tools = False
                    self.tools_dropped += 1
                # the new message alone was too long
                else:
                    conv.start()
                n -= 1
                await asyncio.sleep(0.05)
                continue
            self.records.append({"user": i, "turn": n, "kind": kind, "messages": len(messages),
                                 "conversation": conv.started, "agent": conv.tools,
                                 "tools_sent": body.get("tool_choice") == "auto",
                                 **result.to_json()})
            if result.ok:
                conv.answered(messages, result)
            await asyncio.sleep(min(rng.uniform(*a.think),
                                    max(0.0, self.stop_at - time.monotonic())))

    async def progress(self) -> None:
        async with client_of(1, 10.0) as client:
            while True:
                await asyncio.sleep(self.args.progress)
                faults = await get_faults(client, self.url, self.headers)
                restarts, _ = new_faults(self.faults_before, faults)
                ok = [r for r in self.records if r["ok"]]
                console.print(f"[{time.monotonic() - self.t0:6.0f} s] {len(self.records)} "
                              f"requests, {len(self.records) - len(ok)} failed, "
                              f"{len(self.in_flight)} in flight, TTFT p50 "
                              f"{fmt(percentile([r['ttft_s'] for r in ok], 50), 2)} s, engine "
                              f"restarts {restarts}", style="dim")

    async def run(self) -> dict[str, Any]:
        a, url = self.args, self.url
        self.t0 = time.monotonic()
        report: dict[str, Any] = {"command": sys.argv, "url": url, "settings": {
            k: getattr(a, k) for k in ("users", "minutes", "grace", "max_tokens", "max_context",
                                       "think", "reasoning", "temperature", "timeout", "seed",
                                       "api")}}
        async with client_of(a.users, a.timeout) as client:
            ready, why = await wait_healthy(client, url, a.health_timeout)
            if not ready:
                report["error"] = (f"the server at {url} was not ready within {a.health_timeout:g} "
                                   f"s: {why}")
                return report
            self.faults_before = await get_faults(client, url, self.headers)
            counter = TokenCounter.from_gguf(a.tokenizer) if a.tokenizer else TokenCounter()
            await counter.calibrate(client, url, self.kwargs, self.headers)
            ctx = a.max_context or counter.n_ctx or DEFAULT_CONTEXT
            # a margin for estimates and template tokens
            budget = ctx - a.max_tokens - max(16, ctx // 20)
            if budget < 64:
                report["error"] = (f"--max-tokens {a.max_tokens} leaves no room for a conversation "
                                   f"in a context of {ctx} tokens: lower --max-tokens")
                return report
            long_tokens = a.long_tokens or min(4000, ctx // 4)
            report["settings"].update(max_context=ctx, long_tokens=long_tokens,
                                      prompt_budget=budget, prompt_counting=counter.source)
            console.print(f"replay on {url}: {a.users} users for {a.minutes:g} min, context {ctx} "
                          f"(prompts up to ~{budget} tokens, counted by the {counter.source}), "
                          f"max_tokens {a.max_tokens}, think {a.think[0]:g}-{a.think[1]:g} s")
            self.t0 = time.monotonic()
            self.stop_at = self.t0 + a.minutes * 60
            users = [asyncio.create_task(self.user(client, i, counter, budget, long_tokens))
                     for i in range(a.users)]
            ticker = asyncio.create_task(self.progress()) if a.progress > 0 else None
            done, late = await asyncio.wait(users, timeout=max(0.0, self.stop_at + a.grace
                                                                    - time.monotonic()))
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            if ticker:
                ticker.cancel()
            for task in done:
                # a bug here, not the server's: say so, loudly
                if task.exception() is not None:
                    raise task.exception()
            for f in list(self.in_flight.values()):
                self.records.append({**Result(error=f"unfinished: still running {a.grace:g} s "
                                                    "after the last turn started "
                                                    "(--grace)").to_json(), **f,
                                     "latency_s": round(
                                         time.monotonic() - self.t0 - f["sent_s"], 3)})
            wall = time.monotonic() - self.t0
            faults_after = await get_faults(client, url, self.headers)
            report["engine_restarts"], report["faults"] = new_faults(self.faults_before,
                                                                     faults_after)
            report["faults_available"] = faults_after is not None
            report["programs"] = program_figures(await get_metrics(client, url, self.headers))
        report.update(self.summary(wall))
        report["requests_list"] = self.records
        return report

    def summary(self, wall: float) -> dict[str, Any]:
        recs, ok = self.records, [r for r in self.records if r["ok"]]
        read = sum(r["prompt_n"] or 0 for r in ok)
        reused = sum(r["cache_n"] or 0 for r in ok)
        tokens = sum(r["tokens"] for r in recs)
        return {"wall_s": round(wall, 3), "requests": len(recs), "ok": len(ok),
                "failed": len(recs) - len(ok), "context_retries": self.context_retries,
                "tools_dropped": self.tools_dropped,
                "turns_by_kind": dict(Counter(r["kind"] for r in recs)),
                "conversations": sum(c.started for c in self.conversations),
                "trimmed_exchanges": sum(c.trims for c in self.conversations),
                **latency_figures(recs),                  # TTFT, ITL, e2e: p50 and p95
                "agents": self.args.tool_users,
                "agent_turns": sum(r["agent"] for r in recs),
                "turns_offering_tools": sum(r["tools_sent"] for r in recs),
                "answers_with_tool_calls": sum(bool(r["tool_calls"]) for r in ok if r["agent"]),
                "tool_calls": sum(c.tool_calls for c in self.conversations),
                "bad_tool_calls": sum(c.bad_tool_calls for c in self.conversations),
                "tool_calls_by_name": dict(Counter(t["function"]["name"] for r in ok if r["agent"]
                                                   for t in r["tool_calls"])),
                "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
                "largest_prompt": max((r["prompt_tokens"] or 0 for r in ok), default=0),
                "prompt_n": read, "cache_n": reused,
                "prefix_reuse": round(reused / (read + reused), 4) if read + reused else None,
                "generated_tokens": tokens,
                "aggregate_tps": round(tokens / wall, 3) if wall else None,
                "by_turn": by_turn(ok)}


def by_turn(ok: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each turn number's requests (the n-th of its user's conversations so far): how many, TTFT
    p50 and the prefix cache's share of their prompts."""
    out = []
    for n in sorted({r["turn"] for r in ok}):
        rs = [r for r in ok if r["turn"] == n]
        read = sum(r["prompt_n"] or 0 for r in rs)
        reused = sum(r["cache_n"] or 0 for r in rs)
        out.append({"turn": n, "requests": len(rs),
                    "ttft_p50_s": percentile([r["ttft_s"] for r in rs], 50),
                    "prefix_reuse": round(reused / (read + reused), 4) if read + reused else None})
    return out


def print_report(r: dict[str, Any]) -> None:
    t = Table(title=f"replay: {r['settings']['users']} users, {r['settings']['minutes']:g} min",
              title_justify="left", show_header=False)
    t.add_column(justify="left")
    t.add_column(justify="right")
    reuse = "-" if r["prefix_reuse"] is None else f"{100 * r['prefix_reuse']:.1f}%"
    rows = [("requests", r["requests"]), ("ok", r["ok"]), ("failed", r["failed"]),
            ("turns (task / followup / log / tool / tool_result)", " / ".join(
                str(r["turns_by_kind"].get(k, 0))
                for k in ("task", "followup", "log", "tool", "tool_result"))),
            ("conversations (started over when full)", r["conversations"]),
            ("exchanges trimmed to fit the context", r["trimmed_exchanges"]),
            ("refused as too long, trimmed and retried", r["context_retries"]),
            ("TTFT p50 / p95, s", f"{fmt(r['ttft_p50_s'], 2)} / {fmt(r['ttft_p95_s'], 2)}"),
            ("ITL p50 / p95, ms", f"{fmt(in_ms(r['itl_p50_s']))} / {fmt(in_ms(r['itl_p95_s']))}"),
            ("e2e latency p50 / p95, s", f"{fmt(r['e2e_p50_s'], 2)} / {fmt(r['e2e_p95_s'], 2)}"),
            ("agents: turns (offering tools)", f"{r['agent_turns']} ({r['turns_offering_tools']})"),
            ("agents: answers with tool calls, calls (malformed)",
             f"{r['answers_with_tool_calls']}, {r['tool_calls']} ({r['bad_tool_calls']})"),
            ("prompt tokens (largest prompt)", f"{r['prompt_tokens']} ({r['largest_prompt']})"),
            ("prefix reuse (cache_n / (cache_n + prompt_n))",
             f"{reuse} ({r['cache_n']} of {r['cache_n'] + r['prompt_n']})"),
            ("generated tokens (aggregate tok/s)",
             f"{r['generated_tokens']} ({fmt(r['aggregate_tps'])})"),
            ("engine restarts (GET /faults)",
             r["engine_restarts"] if r["faults_available"] else "unknown"),
            ("wall time, s", f"{r['wall_s']:.1f}")]
    for name, value in rows:
        t.add_row(name, str(value))
    console.print(t)
    turns = Table(title="by turn", title_justify="left")
    for name in ("turn", "requests", "TTFT p50, s", "prefix reuse"):
        turns.add_column(name, justify="right")
    for row in r["by_turn"]:
        turns.add_row(str(row["turn"]), str(row["requests"]), fmt(row["ttft_p50_s"], 2),
                      "-" if row["prefix_reuse"] is None else f"{100 * row['prefix_reuse']:.1f}%")
    console.print(turns)
    for message, n in Counter(x["error"] for x in r["requests_list"] if not x["ok"]).most_common():
        console.print(f"[red]{n} failed:[/red] {message}")
    for f in r["faults"]:
        console.print(f"[red]engine fault[/red] {f.get('time')}: {f.get('message')} "
                      f"({f.get('requests_in_flight')} requests in flight)")
    console.print(describe_programs(r.get("programs") or {}))
    console.print(describe_log(r.get("server_log")))


def main(argv: list[str] | None = None) -> int:
    args, server_flags = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with Server(args, server_flags) as server:
            report = asyncio.run(Replay(args, server.url).run())
    except ServerStartError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    except KeyboardInterrupt:
        console.print("[red]interrupted: no report[/red]")
        return 130
    if server.log_counts is not None:
        report["server_log"] = server.log_counts
    write_json(args.json, report)
    if "error" in report:
        console.print(f"[red]{report['error']}[/red]")
        return 2
    print_report(report)
    return 1 if report["failed"] or report["engine_restarts"] else 0


if __name__ == "__main__":
    sys.exit(main())
