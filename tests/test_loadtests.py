"""The load scripts, scripts/ladder.py and scripts/replay.py, run as a user runs them (a subprocess,
JSON report) against real `strata-jax serve` processes with a tiny model: a tiny ladder and a few
seconds of replay succeed with sane figures; a ladder whose engine exits mid-way (STRATA_FAULT)
reports the failed requests, exits 1, and its next level succeeds on the restarted engine. Plus the
replay's conversations kept within the context, checked with the model's tokenizer, and a server
that never answers."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from strata_jax.serve.launch import ServerProcess

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import ladder
import replay
from _loadtest import Result, TokenCounter, percentile, server_log_counts, stream_chat
from replay import Conversation


def run_script(name: str, *args: str, tmp_path: Path, env: dict[str, str] | None = None,
               timeout: float = 120) -> tuple[int, str, dict]:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "COLUMNS": "160", **(env or {})}
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), "--json", str(out), *args],
                          check=False, capture_output=True, text=True, timeout=timeout, env=env)
    text = proc.stdout + proc.stderr
    return proc.returncode, text, json.loads(out.read_text()) if out.exists() else {}


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model(arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module")
def server(model):
    with ServerProcess([str(model), "--parallel", "2", "--max-context", "512"]) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def agent_server(model):
    """A context that holds the agents' tool descriptions as the server renders them (its generic
    tool prompt, issue 16) beside a conversation."""
    with ServerProcess([str(model), "--parallel", "2", "--max-context", "2048"]) as srv:
        srv.wait_ready()
        yield srv


def requests_of(level: dict) -> list[dict]:
    return [r for w in level["waves"] for r in w["requests"]]


def test_ladder(server, tmp_path):
    rc, out, report = run_script("ladder.py", "--url", server.url, "--levels", "1,2",
                                 "--waves", "1", "--prompt-tokens", "64", "--max-tokens", "8",
                                 tmp_path=tmp_path)
    assert rc == 0, out
    assert [lv["level"] for lv in report["levels"]] == [1, 2]
    assert report["requests"] == 3 and report["failed"] == 0 and report["engine_restarts"] == 0
    assert report["prompt_counting"].startswith("server's counts")
    for lv in report["levels"]:
        reqs = requests_of(lv)
        assert len(reqs) == lv["level"] and lv["ok"] == lv["level"]
        for r in reqs:
            assert r["ok"] and r["error"] is None and r["finish_reason"] in ("stop", "length")
            assert (abs(r["prompt_tokens"] - 64) <= 4
                    and r["prompt_tokens"] == r["prompt_tokens_counted"])
            assert r["prompt_n"] + r["cache_n"] == r["prompt_tokens"]
            assert 1 <= r["tokens"] <= 8 and 0 < r["ttft_s"] <= r["latency_s"] < 60
            assert r["prompt_tps"] > 0 and (r["decode_tps"] or 0) >= 0
        assert lv["aggregate_tps"] > 0 and 0 < lv["ttft_p50_s"] <= lv["ttft_p95_s"]
        # chunks that arrive together (a tiny model's tokens, run-ahead decode) have gaps that
        # round to 0 (itl_s is kept to 0.1 ms): no lower bound on speed here
        assert (0 <= lv["itl_p50_s"] <= lv["itl_p95_s"]
                and lv["ttft_p50_s"] <= lv["e2e_p50_s"] <= lv["e2e_p95_s"])
        assert all(len(r["itl_s"]) == r["chunks"] - 1 for r in reqs)
    # not our server: its log is not ours to read
    assert "server_log" not in report
    assert report["programs"]["built"] >= 1 and report["programs"]["engine_generation"] == 1
    assert "level 2: 2/2 ok" in out and "3/3 requests ok, 0 failed" in out
    assert (report["latency"]["e2e_p95_s"] >= report["latency"]["e2e_p50_s"] > 0
            and "ITL p50 / p95" in out)
    assert "engine restarts during the ladder (GET /faults): 0" in out


def test_replay(agent_server, tmp_path):
    rc, out, report = run_script("replay.py", "--url", agent_server.url, "--users", "3",
                                 "--minutes", "0.15", "--max-tokens", "8", "--think", "0.2,0.8",
                                 "--progress", "0", "--tool-users", "2", tmp_path=tmp_path)
    assert rc == 0, out
    # learned from the server: no --max-context given
    assert report["settings"]["max_context"] == 2048
    # a turn a user at least: on a loaded machine the first turns (which build programs) may fill
    # the 9 s
    assert report["requests"] >= 3 and report["failed"] == 0 and report["engine_restarts"] == 0
    # without --tokenizer the prompt estimate is a heuristic: a conversation near the context's end
    # may be refused as too long; it is trimmed and retried (never counted as failed), and that must
    # stay rare
    assert report["conversations"] >= 3 and report["context_retries"] <= report["requests"] // 4
    assert (0 < report["ttft_p50_s"] <= report["ttft_p95_s"]
            and 0 < report["e2e_p50_s"] <= report["e2e_p95_s"])
    assert (report["ttft_p50_s"] <= report["e2e_p50_s"]
            and 0 <= report["itl_p50_s"] <= report["itl_p95_s"])      # gaps can round to 0
    # users 0 and 1 are agents: every turn of theirs offers the tools. Our server ignores `tools`
    # for now (issue 16 item 1 is under way), so the counts of calls may be 0; each call made was
    # fed back.
    agents = [r for r in report["requests_list"] if r["agent"]]
    assert report["agents"] == 2 and {r["user"] for r in agents} == {0, 1}
    assert report["agent_turns"] == len(agents) == report["turns_offering_tools"] >= 2
    assert (report["tool_calls"] == sum(len(r["tool_calls"]) for r in agents)
            >= report["answers_with_tool_calls"])
    assert not any(r["tool_calls"] for r in report["requests_list"] if not r["agent"])
    assert report["prefix_reuse"] is not None and 0 <= report["prefix_reuse"] <= 1
    assert report["prompt_n"] + report["cache_n"] == report["prompt_tokens"]
    assert report["largest_prompt"] + 8 <= 2048 and report["tools_dropped"] == 0
    # --grace 120 (default): later turns would fail
    assert report["wall_s"] < 0.15 * 60 + 120 + 10
    turns = {}
    for r in report["requests_list"]:
        assert r["ok"] and 1 <= r["tokens"] <= 8
        turns.setdefault(r["user"], []).append(r["turn"])
    assert (sorted(turns) == [0, 1, 2]
            and all(t == list(range(1, len(t) + 1)) for t in turns.values()))
    assert "engine restarts (GET /faults)" in out


def test_replay_over_anthropics_messages(agent_server, tmp_path):
    """--api messages: the same users over /v1/messages (Claude Code's API), tool_use blocks run
    and sent back as tool_result blocks; the figures read from Anthropic's usage (input_tokens read
    now + cache_read_input_tokens from the prefix cache = the prompt)."""
    rc, out, report = run_script("replay.py", "--url", agent_server.url, "--users", "3",
                                 "--minutes", "0.15", "--max-tokens", "8", "--think", "0.2,0.8",
                                 "--progress", "0", "--tool-users", "2", "--api", "messages",
                                 tmp_path=tmp_path)
    assert rc == 0, out
    assert report["settings"]["api"] == "messages"
    assert report["requests"] >= 3 and report["failed"] == 0 and report["engine_restarts"] == 0
    assert report["prompt_n"] + report["cache_n"] == report["prompt_tokens"] > 0
    assert report["tool_calls"] == sum(len(r["tool_calls"]) for r in report["requests_list"])
    for r in report["requests_list"]:
        assert r["ok"] and 1 <= r["tokens"] <= 8 and r["finish_reason"] in (
            "stop", "length", "tool_calls"), r
        assert 0 < r["ttft_s"] <= r["latency_s"]
    turns = report["by_turn"]
    assert [t["turn"] for t in turns] == list(range(1, len(turns) + 1))
    assert sum(t["requests"] for t in turns) == report["ok"]
    assert "by turn" in out


def test_ladder_reports_an_engine_exit_and_the_next_level_recovers(model, tmp_path):
    # The first engine process exits at its 12th window: level 1 (one request, 8 tokens, ignore_eos)
    # takes 8 windows, so the exit comes while both requests of level 2 are in flight; level 3 runs
    # on engine 2.
    rc, out, report = run_script(
        "ladder.py", "--start-server", str(model), "--parallel", "2", "--levels", "1,2,2",
        "--waves", "1", "--prompt-tokens", "64", "--max-tokens", "8", "--ignore-eos",
        "--health-timeout", "60", "--timeout", "60",
        "--max-context", "256", tmp_path=tmp_path, env={"STRATA_FAULT": "exit:12@1"},
        # two engine starts and three levels: ~2 min at load 15 on 2 cores
        timeout=400)
    assert rc == 1, out
    first, crashed, after = report["levels"]
    assert first["ok"] == 1 and first["failed"] == 0
    # The exit fails the level's requests in flight. Under the whole suite's load (two files at
    # once on 2 cores) one of the level's requests was answered in full (twice in session 33's CI
    # runs; never alone), most likely one that reached the engine only after the exit, a few
    # tiny-model windows (~10 ms each) later, and that engine 2 answered: at least one request
    # fails, and each either fails with the exit or is answered whole.
    failed = crashed["failed"]
    assert failed >= 1 and crashed["ok"] + failed == 2
    for r in requests_of(crashed):
        if r["ok"]:
            assert r["tokens"] == 8, r
            continue
        assert r["error"].startswith("the engine stopped unexpectedly (exit code 1)"), r
        # the ERR line is not in the request's error (issue 32, finding 14) ...
        assert r["tokens"] < 8
    assert (after["ok"] == 2 and after["failed"] == 0
            and all(r["tokens"] == 8 for r in requests_of(after)))
    assert report["failed"] == failed and report["engine_restarts"] == 1
    (fault,) = report["faults"]
    assert fault["exit_code"] == 1 and failed <= fault["requests_in_flight"] <= 2
    # ... but in /faults, behind the API key
    assert "injected engine exit" in fault["error_line"]
    assert report["programs"]["engine_generation"] == 2
    assert report["server_log"]["engine_starts"] == 2 and report["server_log"]["program_frees"] == 0
    assert f"{failed} failed: the engine stopped unexpectedly" in out
    assert "engine restarts during the ladder (GET /faults): 1" in out
    assert "stopped the server" in out


def test_replay_conversations_fit_the_context(model):
    """Many turns with answers of random length: every prompt fits the budget by the model's own
    count, tool messages always answer the tool call of the assistant message before them, and long
    histories are trimmed."""
    counter = TokenCounter.from_gguf(str(model))
    rng = random.Random(0)
    budget = 400
    conv = Conversation(0, rng, counter, budget, long_tokens=150, template_kwargs=None)
    kinds = set()
    for _ in range(150):
        messages, kind = conv.turn()
        kinds.add(kind)
        assert counter.local(messages) <= budget
        assert messages[0]["role"] == "system" and messages[1]["role"] == "user"
        for prev, m in itertools.pairwise(messages):
            if m["role"] == "tool":
                assert m["tool_call_id"] == prev["tool_calls"][0]["id"]
        conv.answered(messages, Result(ok=True, text="ok " * rng.randint(0, 60)))
    assert kinds == {"task", "followup", "log", "tool"}
    assert conv.trims > 10


def test_ladder_against_no_server(tmp_path):
    start = time.monotonic()
    rc, out, report = run_script("ladder.py", "--url", "http://127.0.0.1:9", "--health-timeout",
                                 "1", tmp_path=tmp_path)
    assert rc == 2 and "was not ready within 1 s" in out and "ConnectError" in report["error"]
    assert time.monotonic() - start < 30


def sse_server(*events: str, status: int = 200, body: dict | None = None):
    """An httpx client whose every POST answers with these SSE data lines (or a JSON error body)."""
    def answer(request: httpx.Request) -> httpx.Response:
        if status != 200:
            return httpx.Response(status, json=body)
        return httpx.Response(200, content="".join(f"data: {e}\n\n" for e in events).encode(),
                              headers={"content-type": "text/event-stream"})
    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> str:
    return json.dumps({"choices": [] if delta is None
                                  else [{"index": 0, "delta": delta, "finish_reason": finish}],
                       **extra})


TIMINGS = {"prompt_n": 90, "cache_n": 10, "prompt_per_second": 500.0, "predicted_n": 2,
           "predicted_per_second": 40.0}
USAGE = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}


@pytest.mark.parametrize("case", ["ok", "http_400", "error_event", "cut_short", "no_timings"])
def test_stream_chat_outcomes(case):
    events = {
        "ok": [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
               chunk({"content": "lo"}),
               chunk({}, "stop", timings=TIMINGS), chunk(usage=USAGE), "[DONE]"],
        "error_event": [chunk({"content": "Hel"}),
                        json.dumps({"error": {"message": "the engine stopped"}}), "[DONE]"],
        "cut_short": [chunk({"content": "Hel"})],
        "no_timings": [chunk({"content": "a"}), chunk({"content": "b"}), chunk({"content": "c"}),
                       chunk({}, "length"), "[DONE]"],
    }.get(case, [])
    client = sse_server(*events, status=400 if case == "http_400" else 200,
                        body={"error": {"message": "too long",
                                        "type": "exceed_context_size_error"}})
    r = asyncio.run(stream_chat(client, "http://x", {"messages": []}, 10.0, time.monotonic()))
    if case == "ok":
        assert (r.ok and r.error is None and r.text == "Hello" and r.finish_reason == "stop"
                and not r.measured)
        assert (r.prompt_tokens, r.prompt_n, r.cache_n, r.tokens) == (100, 90, 10, 2)
        assert (r.prompt_tps, r.decode_tps) == (500.0, 40.0) and 0 < r.ttft_s <= r.latency_s
    elif case == "http_400":
        assert not r.ok and r.status == 400 and r.error == "HTTP 400: too long" and r.ttft_s is None
    elif case == "error_event":
        assert not r.ok and r.error == "the engine stopped" and r.tokens == 1
    elif case == "cut_short":
        assert not r.ok and r.error == "the stream ended without [DONE]"
    else:
        assert r.ok and r.tokens == 3 and r.measured and r.decode_tps > 0 and r.prompt_tps is None


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 95) == pytest.approx(1.95)


def test_server_flags_go_to_the_server_only_with_start_server(capsys):
    args, flags = ladder.parse_args(["--start-server", "m.gguf", "--parallel", "8", "--levels",
                                     "1,2,4,8", "--device-memory-mib=900", "--max-tokens", "16",
                                     "--", "--kv", "int8"])
    assert args.levels == [1, 2, 4, 8] and args.max_tokens == 16 and args.start_server == "m.gguf"
    assert flags == ["--parallel", "8", "--device-memory-mib=900", "--kv", "int8"]
    # --max- is not taken for --max-tokens (no abbreviations): it goes to the server, which refuses
    # it
    _, flags = ladder.parse_args(["--start-server", "m.gguf", "--max-context", "2048"])
    assert flags == ["--max-context", "2048"]
    # the replay's --max-context is the server's too
    args, flags = replay.parse_args(["--start-server", "m.gguf", "--max-context", "1280",
                                     "--parallel", "4"])
    assert args.max_context == 1280 and flags == ["--parallel", "4", "--max-context", "1280"]
    args, flags = replay.parse_args(["--start-server", "m.gguf", "--", "--max-context", "640"])
    assert args.max_context == 640 and flags == ["--max-context", "640"]
    for argv in (["--url", "http://x", "--parallel", "8"],
                 ["--url", "http://x", "--", "--parallel", "8"]):
        with pytest.raises(SystemExit):
            ladder.parse_args(argv)
        assert "--parallel 8" in capsys.readouterr().err


def test_server_log_counts():
    text = ("engine process 1 started (pid 10)\nWARNING no device memory for a window program: "
            "freed 3 older layouts, 2 kept\nwindow [8x1 | kv 512] failed (x): running its rows in "
            "smaller windows\nstarting engine process 2 in 0.5 s\nengine process 2 started (pid "
            "11)\nengine: no device memory for a window program: freed 1 older layouts, 4 kept\n")
    assert server_log_counts(text) == {"program_frees": 2, "split_windows": 1, "engine_starts": 2}


def ladder_report() -> dict:
    req = {"ok": True, "decode_tps": 5.0}
    return {"settings": {"prompt_tokens": 64, "max_tokens": 8, "waves": 1}, "levels": [
        {"level": lv, "failed": lv - 1, "median_decode_tps": 5.0 / lv, "aggregate_tps": 4.0 * lv,
         "waves": [{"requests": [req] * lv + [{"ok": False, "decode_tps": None}]}]}
        for lv in (1, 2, 4)]}


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "ladder.png"
    assert ladder.plot(str(out), ladder_report())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "ladder.png"
    assert not ladder.plot(str(out), ladder_report())
    said = " ".join(capsys.readouterr().out.split())
    assert (not out.exists() and "matplotlib is not installed, so no plot" in said
            and "strata-jax[plot]" in said)


def test_an_interrupted_ladder_reports_the_levels_that_ended(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) during a long ladder: the JSON and the summary hold the levels that
    ended, their failures count (exit 1), and the engine restarts seen after the last of them."""
    failed = {**Result(error="the engine stopped unexpectedly (exit code 1)").to_json(), "index": 0}
    fine = {**Result(ok=True, ttft_s=0.5, latency_s=1.0, tokens=4, decode_tps=8.0).to_json(),
            "index": 0}

    def fake(requests: list[dict], restarts: int):
        async def run(args, url, report, t0):
            report.update(settings={}, levels=[])
            report["levels"].append(ladder.summarize(1, [{"wave": 1, "wall_s": 1.0,
                                                          "requests": requests}]))
            report.update(engine_restarts=restarts, faults=[], faults_available=True, programs={})
            raise KeyboardInterrupt
        return run

    out = tmp_path / "ladder.json"
    monkeypatch.setattr(ladder, "ladder", fake([failed], 1))
    assert ladder.main(["--url", "http://x", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert (report["interrupted"] == "after level 1" and report["requests"] == 1
            and report["failed"] == 1)
    assert report["engine_restarts"] == 1
    monkeypatch.setattr(ladder, "ladder", fake([fine], 0))
    assert ladder.main(["--url", "http://x", "--json", str(out)]) == 130
    assert json.loads(out.read_text())["failed"] == 0


def test_agent_feeds_tool_results_back():
    """A server that answers an agent's first turn with two streamed tool calls (their arguments in
    pieces), then in words: the agent runs both tools, sends their results as `role: tool` messages
    answering those calls, with the tools still offered, and then carries on with plain turns."""
    from _agent import TOOLS

    sent: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        if len(sent) == 1:
            events = [chunk({"role": "assistant", "content": ""}),
                      chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                             "function": {"name": "get_weather",
                                                          "arguments": ""}}]}),
                      chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                      chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
                      chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                             "function": {"name": "calculator",
                                                          "arguments": '{"expression": "6*7"}'}}]}),
                      chunk({}, "tool_calls"), "[DONE]"]
        else:
            events = [chunk({"content": "It is mild."}), chunk({}, "stop"), "[DONE]"]
        return httpx.Response(200, content="".join(f"data: {e}\n\n" for e in events).encode(),
                              headers={"content-type": "text/event-stream"})

    async def run() -> None:
        args = replay.parse_args(["--url", "http://x", "--users", "1", "--tool-users", "1"])[0]
        r = replay.Replay(args, "http://x")
        r.t0, r.stop_at = time.monotonic(), time.monotonic() + 3600
        conv = Conversation(0, random.Random(0), TokenCounter(), 4000, 200, None, tools=True)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for _ in range(3):
                messages, _ = conv.turn()
                body = r.body(messages, 0, conv)
                conv.answered(messages, await stream_chat(client, "http://x", body, 10.0, r.t0))
        assert conv.tool_calls == 2 and conv.bad_tool_calls == 0 and conv.tool_rounds == 0

    asyncio.run(run())
    assert all(b["tools"] == TOOLS and b["tool_choice"] == "auto" for b in sent)
    second = sent[1]["messages"]
    call, weather, calc = second[-3:]
    assert [c["id"] for c in call["tool_calls"]] == ["call_a", "call_b"]
    assert (call["tool_calls"][0]["function"]
            == {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    assert weather["role"] == calc["role"] == "tool"
    assert (weather["tool_call_id"], calc["tool_call_id"]) == ("call_a", "call_b")
    assert (json.loads(weather["content"])["city"] == "Paris"
            and json.loads(calc["content"]) == {"result": 42})
    assert sent[2]["messages"][-2] == {"role": "assistant", "content": "It is mild."}
    assert sent[2]["messages"][-1]["role"] == "user"                 # plain turns again


def test_agent_tools_and_rounds():
    from _agent import calculate, run_tool

    assert calculate("(2 + 3) * 4 - 2 ** 3") == 12 and calculate("-7 / 2") == -3.5
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "[1]"):
        with pytest.raises(ValueError):
            calculate(bad)
    call = {"function": {"name": "calculator", "arguments": "{not json"}}
    content, ok = run_tool(call, lambda name, args: "")
    assert not ok and "not valid JSON" in json.loads(content)["error"]
    content, ok = run_tool({"function": {"name": "rm_rf", "arguments": "{}"}},
                           lambda name, args: "")
    assert not ok and "no tool named 'rm_rf'" in json.loads(content)["error"]
    # an agent whose answers keep calling tools is asked for words after --max-tool-rounds
    conv = Conversation(0, random.Random(1), TokenCounter(), 4000, 200, None, tools=True)
    always = Result(ok=True, tool_calls=[
        {"id": "c", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    for round_ in range(3):
        assert conv.offers_tools(2)["tool_choice"] == ("auto" if round_ < 2 else "none")
        messages, kind = conv.turn()
        assert kind == ("tool_result" if round_ else "task")
        conv.answered(messages, always)
    assert Conversation(1, random.Random(1), TokenCounter(), 4000, 200, None).offers_tools(2) == {}
