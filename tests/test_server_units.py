"""Server pieces on their own, fast: the reasoning parser on token streams, request parsing, the
frame protocol, the fault ledger, and the supervisor driving a mock engine process (mock_worker.py:
no model, no JAX) through queueing, cancels, deadlines, an engine exit and a start that keeps
failing."""

from __future__ import annotations

import asyncio
import io
import itertools
import sys
import time

import pytest

from strata_jax import EngineConfig
from strata_jax.engine.request import make_params
from strata_jax.serve.errors import ApiError
from strata_jax.serve.http.choices import events
from strata_jax.serve.http.generate import ModelNames, parse_chat, parse_completion
from strata_jax.serve.http.reasoning import (
    CONTENT,
    REASONING,
    ReasoningParser,
    split_reasoning,
)
from strata_jax.serve.params import RequestParams
from strata_jax.serve.protocol import (
    Cancel,
    Submit,
    decode_command,
    pack,
    read_frame,
)
from strata_jax.serve.supervisor.ledger import Fault, describe_exit
from strata_jax.serve.supervisor.supervisor import (
    Prepared,
    StderrTail,
    Supervisor,
)
from strata_jax.serve.worker.mock_prompts import MockPrompts

# ---- reasoning -----------------------------------------------------------------------------------

CASES = [  # (text, starts inside reasoning) -> (reasoning or None, content)
    ("Let me think.\n</think>\n\nParis.", True, ("Let me think.", "Paris.")),
    ("\n<think>\nhmm\n</think>\n\nAnswer", False, ("hmm", "Answer")),
    ("<think>a</think>b <think>c</think>", False, ("a", "b <think>c</think>")),
    ("Plain answer, a < b </thin", False, (None, "Plain answer, a < b </thin")),
    ("still thinking </thi", True, ("still thinking </thi", "")),
    ("  ", True, ("", "")),
    ("<thin", False, (None, "<thin")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text, inside, expected", CASES)
def test_reasoning_split_whole(text, inside, expected):
    assert split_reasoning(text, inside) == expected


@pytest.mark.parametrize("text, inside, expected", CASES)
def test_reasoning_split_any_way_into_tokens(text, inside, expected):
    """Tags cut anywhere, in two or three pieces: the streamed parts add up to the whole split."""
    n = len(text)
    cuts = ([(i,) for i in range(n + 1)]
            + list(itertools.combinations(range(0, n + 1, max(1, n // 12)), 2)))
    for cut in cuts:
        bounds = [0, *cut, n]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        p = ReasoningParser(inside)
        parts = [part for piece in pieces for part in p.feed(piece)] + p.flush()
        reasoning = "".join(t for k, t in parts if k == REASONING)
        content = "".join(t for k, t in parts if k == CONTENT)
        assert ((reasoning if p.saw_reasoning else None), content) == expected, pieces
        assert all(t for _, t in parts), "no empty deltas"


def test_reasoning_streams_as_it_comes():
    p = ReasoningParser(in_reasoning=True)
    assert p.feed("Let me th") == [(REASONING, "Let me th")]
    # "</th" held back: it may be the tag
    assert p.feed("ink</th") == [(REASONING, "ink")]
    assert p.feed("ink>\n\nPar") == [(CONTENT, "Par")]
    assert p.feed("is") == [(CONTENT, "is")]
    assert p.flush() == []


@pytest.mark.parametrize("text, expected", [
    ("Let me look.\n<tool_call>\n<function=f>", ("Let me look.", "<tool_call>\n<function=f>")),
    ("<tool_call>\n{}", ("", "<tool_call>\n{}")),
    # after </think> it is content anyway
    ("Hm.</think>\n\nSure.<tool_call>x", ("Hm.", "Sure.<tool_call>x")),
])
def test_a_call_mark_ends_the_reasoning_and_is_the_answer(text, expected):
    """With tools (the format's call mark given), a call written inside the reasoning the template
    opened ends it, as llama.cpp's Qwen3-Coder / Qwen3.5 parser ends it at <tool_call>: whole, and
    cut at every character."""
    assert split_reasoning(text, True, call_mark="<tool_call>") == expected
    for cut in range(len(text) + 1):
        p = ReasoningParser(True, call_mark="<tool_call>")
        parts = p.feed(text[:cut]) + p.feed(text[cut:]) + p.flush()
        got = ("".join(t for k, t in parts if k == REASONING),
               "".join(t for k, t in parts if k == CONTENT))
        assert got == expected, cut


def test_without_tools_a_call_mark_is_reasoning():
    assert split_reasoning("Let me look.\n<tool_call>x", True) == ("Let me look.\n<tool_call>x", "")


def test_reasoning_off_passes_tags_through():
    p = ReasoningParser(in_reasoning=True, enabled=False)
    assert p.feed("<think>x</think>y") == [(CONTENT, "<think>x</think>y")] and not p.saw_reasoning


def test_reasoning_on_real_token_stream(tiny_model):
    """Token by token through the tiny tokenizer, where <think> and </think> are tokens of their
    own."""
    from strata_jax.gguf import load_tokenizer

    tok = load_tokenizer(tiny_model(arch="qwen3", layers=2, hidden=64))
    ids = tok.encode("The capital</think>\n\nis Paris", add_special=False)
    assert tok.token_to_id("</think>") in ids
    dec, p = tok.stream_decoder(), ReasoningParser(in_reasoning=True)
    parts = [part for i in ids for part in p.feed(dec.add(i))] + p.flush()
    assert "".join(t for k, t in parts if k == REASONING) == "The capital"
    assert "".join(t for k, t in parts if k == CONTENT) == "is Paris"


# ---- request parsing -----------------------------------------------------------------------------

NAMES = ModelNames("tiny", "tiny.gguf")
# --strict-model-name: an unknown name is a 404
STRICT = ModelNames("tiny", "tiny.gguf", strict=True)


def test_an_unknown_model_name_is_served_unless_strict():
    body = b'{"messages": [{"role": "user", "content": "x"}], "model": "other"}'
    # llama.cpp's way: the one model serves it
    assert parse_chat(body, NAMES) is not None


def test_chat_parsing_maps_openai_fields():
    job = parse_chat(b'{"model": "tiny.gguf", "messages": [{"role": "developer", "content": "Be '
                     b'brief."}, {"role": "user", "content": [{"type": "text", "text": "a"}, '
                     b'{"type": "text", "text": "b"}]}], "max_completion_tokens": 7, "max_tokens": '
                     b'99, "seed": -1, "stop": "END", "top_k": 5, "stream": true, '
                     b'"stream_options": {"include_usage": true}, "user": "ignored"}', NAMES)
    assert job.model == "tiny" and job.stream and job.include_usage
    assert (job.prompt
            == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}])
    assert job.params == RequestParams(max_tokens=7, temperature=0.8, top_k=5, top_p=0.95,
                                       min_p=0.05, seed=None,
                                       stop=["END"], ignore_eos=False, logit_bias=[],
                                       presence_penalty=0.0, frequency_penalty=0.0,
                                       repeat_penalty=1.0, repeat_last_n=64, logprobs=None,
                                       grammar=None)
    assert parse_completion(b'{"prompt": ["hi"], "seed": 8589934593}', NAMES).params.seed == 1


@pytest.mark.parametrize("body, param", [
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 9}', "n"),
    (b'{"messages": [{"role": "user", "content": "x"}], "model": "other"}', "model"),
    (b'{"messages": [{"role": "tool"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_k": 1.5}', "top_k"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop[0]"),
])
def test_chat_parsing_names_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body, STRICT if param == "model" else NAMES)
    assert e.value.param == param and e.value.status in (400, 404)
    assert param.split("[")[0] in e.value.message


# ---- protocol, ledger, stderr --------------------------------------------------------------------

def test_frames_round_trip_and_stop_at_a_cut():
    """(every frame type round trips, and malformed ones are refused: tests/test_protocol.py)"""
    msgs = [Submit("a", [1, 233], make_params(3, stop=["é"])), Cancel("\x00")]
    data = b"".join(pack(m) for m in msgs)
    f = io.BytesIO(data)
    assert [read_frame(f, decode_command), read_frame(f, decode_command),
            read_frame(f, decode_command)] == \
        [*msgs, None]
    assert read_frame(io.BytesIO(data[:-1]), decode_command) == msgs[0]


def test_fault_messages_say_why():
    f = Fault(1, 1, "ERR window 7: boom", "ERR window 7: boom", 2, ["a", "b"], 3.0, True)
    assert (f.message
            == "the engine stopped unexpectedly (exit code 1). Its last error: ERR window 7: boom")
    g = Fault(2, -9, "loading weights", None, 0, [], 1.0, False)
    assert (g.message == "the engine stopped unexpectedly (killed by SIGKILL, exit code -9). Its "
                         "last log line: loading weights")
    assert describe_exit(None) == "it did not start"
    tail = StderrTail()
    for line in ("INFO strata_jax.engine: prompt 3 tokens", "ERR window 2: x",
                 "WARNING later line", ""):
        tail.add(line)
    assert tail.error_line == "ERR window 2: x" and tail.last_line == "later line"


# ---- the supervisor over a mock engine -----------------------------------------------------------

MOCK = [sys.executable, "-m", "strata_jax.serve.worker.mock_worker"]
PARAMS = RequestParams()                  # the engine's defaults: greedy, to the end of the context


def _run(coro_fn, parallel=2, timeout_s=10.0, **kw):
    async def main():
        sup = Supervisor("mock.gguf", EngineConfig(parallel=parallel, max_context=512,
                                                   request_timeout_s=timeout_s),
                         command=MOCK, backoff_s=0.05, max_backoff_s=0.3,
                         prompts=MockPrompts(512), **kw)
        await sup.start()
        try:
            return await asyncio.wait_for(coro_fn(sup), 30)
        finally:
            await sup.stop()

    return asyncio.run(main())


_IDS = itertools.count(1)


async def _ask(sup, prompt, max_tokens=5):
    deadline = time.monotonic() + sup.config.request_timeout_s
    params = RequestParams(max_tokens=max_tokens)
    rid = f"r{next(_IDS)}-{prompt[:8]}"
    prepared = await sup.prepare(rid, prompt, params, None, deadline)
    return sup.enqueue(rid, prepared, params, deadline)


async def _drain(t):
    events = []
    while not events or events[-1].kind == "token":
        events.append(await asyncio.wait_for(t.events.get(), 10))
    return events


def test_mock_queue_never_runs_more_than_parallel():
    async def go(sup):
        tickets = [await _ask(sup, f"p{i}", 20) for i in range(5)]
        most = 0
        while any(t.state != "done" for t in tickets):
            most = max(most, len(sup.running))
            await asyncio.sleep(0.002)
        ends = [(await _drain(t))[-1] for t in tickets]
        return most, ends, tickets

    most, ends, tickets = _run(go)
    assert most == 2
    assert ([e.finish_reason for e in ends] == ["length"] * 5
            and all(e.stats["generated_tokens"] == 20 for e in ends))
    # first come, first served
    assert sorted(t.started for t in tickets) == [t.started for t in tickets]


def test_a_request_crosses_the_pipe_to_the_engine_once():
    """issue 35: the server renders, tokenizes and checks a request itself (here the mock's prompt
    maker); the engine gets one frame for it, its Submit, and answers with its events."""
    async def go(sup):
        await sup.wait_ready(time.monotonic() + 20)
        sent = []
        engine = sup._engine
        real = engine.send
        engine.send = lambda cmd: sent.append(type(cmd).__name__) or real(cmd)
        t = await _ask(sup, "hello", 3)
        events = await _drain(t)
        return list(sent), events, t

    sent, events, t = _run(go)
    assert sent == ["Submit"] and t.submit.ids == [ord(c) for c in "hello"]
    assert [e.kind for e in events] == ["token"] * 3 + ["final"]


def test_mock_engine_exit_fails_running_and_serves_queued():
    async def go(sup):
        crash, other = await _ask(sup, "EXIT now", 50), await _ask(sup, "long", 400)
        queued = await _ask(sup, "queued", 5)
        assert queued.state == "queued"
        ends = [(await _drain(t))[-1] for t in (crash, other, queued)]
        return sup, ends, queued

    sup, (crash, other, queued_end), queued = _run(go)
    # no log text
    want = "the engine stopped unexpectedly (exit code 3). This request was in flight"
    assert crash.kind == other.kind == "error" and crash.error.startswith(want)
    assert "exit asked by the prompt" in sup.ledger.last.message
    assert queued_end.finish_reason == "length" and queued.generation == 2
    fault = sup.ledger.last
    assert fault.requests_in_flight == 2 and fault.restart_in_s == 0.05 and fault.exit_code == 3


def test_mock_cancel_a_queued_request_and_a_running_one():
    async def go(sup):
        running, queued = await _ask(sup, "a", 500), await _ask(sup, "b", 5)
        sup.cancel(queued)
        q = await _drain(queued)
        await asyncio.sleep(0.05)
        sup.cancel(running)
        r = await _drain(running)
        return q, r, sup.running, sup.queued

    q, r, running, n_queued = _run(go, parallel=1)
    assert q[-1].finish_reason == "cancelled" and len(q) == 1
    assert r[-1].finish_reason == "cancelled" and 0 < r[-1].stats["generated_tokens"] < 500
    assert running == [] and n_queued == 0


def test_mock_stuck_engine_meets_the_deadline():
    """An engine that never answers a request: its reader gets a timeout error at the deadline, and
    the request is cancelled."""
    async def go(sup):
        t0 = time.monotonic()
        t = await _ask(sup, "HANG")
        got = [ev async for ev in events(sup, t)]
        return got, time.monotonic() - t0, t

    got, waited, t = _run(go, timeout_s=0.5)
    assert [ev.kind for ev in got] == ["error"] and got[0].finish_reason == "timeout"
    assert "deadline" in got[0].error and 0.4 < waited < 2.0 and t.cancelled


def test_mock_engine_refusing_a_submit_ends_its_ticket_with_the_refusal():
    """A Submit the engine refuses (a grammar it cannot compile): the ticket's verdict is the
    refusal as the API's 400, naming the field; the seat is free again for the next request."""
    async def go(sup):
        t = await _ask(sup, "GRAMMAR")
        with pytest.raises(ApiError) as e:
            await t.verdict()
        after = await _ask(sup, "fine", 3)
        await after.verdict()
        return e.value, t, await _drain(after), sup.running

    err, t, after, running = _run(go, parallel=1)
    assert (err.status, err.param) == (400, "response_format") and "cannot be compiled" in \
        err.message
    assert t.state == "done" and t.refused is err
    assert after[-1].finish_reason == "length" and running == []


def test_mock_engine_that_cannot_start_backs_off(monkeypatch):
    monkeypatch.setenv("STRATA_MOCK_START_FAIL", "1")

    async def go(sup):
        while sup.ledger.total < 5:
            await asyncio.sleep(0.02)
        with pytest.raises(ApiError) as e:
            await sup.prepare("x", "hi", PARAMS, None, time.monotonic() + 0.2)
        return sup, e.value, sup.health()

    sup, err, (ok, body) = _run(go)
    assert [f.restart_in_s for f in sup.ledger.entries][:5] == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert not ok and body["status"] == "restarting"
    assert "the engine stopped unexpectedly" in body["reason"] and "in a row" in body["reason"]
    assert "ERR" not in body["reason"] and "ERR mock engine start" in sup.ledger.last.message
    assert err.status == 503 and "the engine stopped unexpectedly" in err.message


def test_prepared_is_plain_data():
    assert Prepared([1, 2], make_params(3)).max_tokens == 3


@pytest.mark.parametrize("args, says", [
    (["/no/such/model.gguf"], "no such file"),
    (["--parallel", "0", "/no/such/model.gguf"], "parallel = 0"),
])
def test_serve_refuses_bad_settings_before_starting(args, says):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "strata_jax", "serve", *args, "--port", "0"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1 and says in out.stderr and "strata-jax serve: error:" in out.stderr


def test_pipe_to_a_deaf_engine_is_bounded():
    """An engine that stops reading its input: requests written to it and not read stay under
    MAX_UNREAD_BYTES (the rest wait in the server's queue, unwritten), and a question beyond it is a
    503 with Retry-After at once, not a wait."""
    from strata_jax.serve.protocol import Tokenize
    from strata_jax.serve.supervisor.supervisor import MAX_UNREAD_BYTES

    async def go():
        cfg = EngineConfig(parallel=64, max_context=1 << 20, request_timeout_s=20)
        sup = Supervisor("mock.gguf", cfg, command=MOCK, prompts=MockPrompts(cfg.max_context))
        await sup.start()
        await sup.wait_ready(time.monotonic() + 20)
        await _ask(sup, "DEAF", 1)
        await asyncio.sleep(0.3)
        # 2-byte ids (msgpack): a MiB a frame
        tickets = [await _ask(sup, f"{i}" + "é" * (1 << 19), 1) for i in range(60)]
        await asyncio.sleep(1.0)
        refused = []
        for _ in range(3):
            try:
                await sup.ask(Tokenize, timeout=5.0, content="x")
            except ApiError as e:
                refused.append(e)
        unread = sup._unread()
        held = sum(t.state == "queued" for t in tickets)
        await sup.stop(timeout=1.0)
        return refused, unread, held

    refused, unread, held = asyncio.run(go())
    assert held >= 20, held
    assert len(refused) == 3 and all(e.status == 503 and e.headers["Retry-After"]
                                     for e in refused)
    assert "has not read" in refused[0].message
    assert unread <= MAX_UNREAD_BYTES + (2 << 20), unread
