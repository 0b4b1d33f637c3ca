"""No request can stop, hang or take over the server (issue 13): out-of-range values, an engine loop
that raises, dies or blocks, an engine that is stopped (SIGSTOP), NaN logits, a burst of 50x
--parallel requests, and prompts too long to tokenize. Real server processes on tiny models, spoken
to over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from strata_jax.bench.machine import rss_mib
from strata_jax.gguf import GGUFModel
from strata_jax.serve.launch import ServerProcess

N_CTX = 256
LONG_CTX = 4096         # the main server's: room for requests long enough to be caught mid-way
HI = [{"role": "user", "content": "Hi"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def _post(srv, path, body, timeout=60.0):
    data = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(srv.url + path, content=data, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module")
def server(model):
    args = [str(model), "--parallel", "2", "--max-context", str(LONG_CTX), "--max-queue", "4",
            "--engine-stall-s", "8", "--request-timeout-s", "120"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        yield srv


# ---- 1. every value a request sets is checked ----------------------------------------------------

BIG = 2**70
# (field, value, the words the error names): each a 400 naming the field (param) and showing the
# value
OUT_OF_RANGE = [
    ("top_k", 2**40, "1099511627776"), ("top_k", BIG, str(BIG)), ("top_k", -2, "-2"),
    ("top_k", 10**6, "1000000"),                       # within int32, beyond the vocabulary
    ("temperature", 1e300, "1e300"), ("temperature", -0.5, "-0.5"), ("temperature", "1e999", None),
    ("top_p", 0.0, "0.0"), ("top_p", 1.5, "1.5"), ("top_p", "1e999", None),
    ("min_p", -1e-9, None), ("min_p", 2, "2"),
    ("seed", 2**64, str(2**64)), ("seed", BIG, str(BIG)), ("seed", -7, "-7"),
    ("max_tokens", 2**31, str(2**31)), ("max_tokens", 0, "0"), ("max_tokens", BIG, str(BIG)),
    ("stop", ["x"] * 17, None), ("stop", "y" * 513, "yyyy"), ("stop", [""], '""'),
    ("stop", ["ok", 5], "5"), ("n", 0, "0"), ("n", BIG, str(BIG)),
]


def _raw(body: dict, field: str, value) -> bytes:
    """The body as JSON text, with `value` written raw when it is a string standing for a number
    (1e999)."""
    if isinstance(value, str) and value[:1].isdigit():
        return json.dumps({**body, field: "@@"}).replace('"@@"', value).encode()
    return json.dumps({**body, field: value}).encode()


@pytest.mark.parametrize(("field", "value", "shown"), OUT_OF_RANGE,
                         ids=[f"{f}={str(v)[:12]}" for f, v, _ in OUT_OF_RANGE])
def test_out_of_range_values_are_400_naming_field_and_value(server, field, value, shown):
    for path, body in ((CHAT, {"messages": HI, "max_tokens": 2}),
                       (TEXT, {"prompt": "Hi", "max_tokens": 2})):
        if field == "max_tokens":
            body = {k: v for k, v in body.items() if k != "max_tokens"}
        r = _post(server, path, _raw(body, field, value))
        assert r.status_code == 400, (path, field, value, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert ((err.get("param") or "").split("[")[0] == field
                or err["message"].startswith(field)), err
        if shown is not None:
            assert shown in err["message"], err["message"]


def test_a_tiny_temperature_is_greedy(server):
    def answer(t):
        r = _post(server, TEXT, {"prompt": "The sky", "max_tokens": 12, "temperature": t, "seed": 3,
                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert answer(1e-7) == answer(0) == answer(9.9e-6)


def test_prompt_too_long_by_its_bytes_is_refused_before_tokenizing(server):
    t0 = time.monotonic()
    # 2 MB: seconds to tokenize
    r = _post(server, TEXT, {"prompt": "word " * 400_000, "max_tokens": 2})
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == LONG_CTX
    assert err["n_prompt_tokens"] >= LONG_CTX
    assert "before tokenizing" in err["message"]
    r = _post(server, CHAT,
              {"messages": [{"role": "user", "content": "x" * 300_000}], "max_tokens": 2})
    assert r.status_code == 400 and "before tokenizing" in r.json()["error"]["message"]


# ---- 3. load shedding ----------------------------------------------------------------------------


def test_a_burst_of_50x_parallel_is_answered_quickly_and_memory_stays_bounded(server):
    """100 requests at once on 2 slots with --max-queue 4: each gets a 200, or a 503 with
    Retry-After at once; nobody waits out a deadline; the server's memory grows by little; the next
    request is served."""
    rss0 = rss_mib(server.proc.pid)
    # 96 tokens each: the 6 requests the slots and the queue hold outlast the burst's arrival on a
    # fast engine
    body = {"prompt": "Count: one two three " * 8, "max_tokens": 96, "temperature": 0,
            "ignore_eos": True}

    def one(i):
        t0 = time.monotonic()
        r = _post(server, TEXT, {**body, "seed": i}, timeout=120)
        return r.status_code, r.headers.get("retry-after"), r.json(), time.monotonic() - t0

    with cf.ThreadPoolExecutor(100) as pool:
        results = list(pool.map(one, range(100)))
    codes = [c for c, *_ in results]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 2 and codes.count(503) >= 50, codes
    for code, retry, body_, seconds in results:
        if code == 503:
            assert retry is not None and int(retry) >= 1
            assert (body_["error"]["type"] == "unavailable_error"
                    and "--max-queue" in body_["error"]["message"])
            assert seconds < 15, seconds
        else:
            assert body_["usage"]["completion_tokens"] == 96
    rss1 = rss_mib(server.proc.pid)
    assert rss1 - rss0 < 150, (rss0, rss1)                       # MiB
    r = _post(server, CHAT, {"messages": HI, "max_tokens": 4})
    assert r.status_code == 200
    health = server.health().json()
    assert health["restarts"] == 0 and health["queued"] == 0
    print(f"burst: {codes.count(200)} x 200, {codes.count(503)} x 503; server RSS {rss0:.1f} -> "
          f"{rss1:.1f} MiB")


# ---- 2. the watchdog: an engine stopped with SIGSTOP ---------------------------------------------


def test_watchdog_kills_a_stopped_engine_and_serves_the_queue(server):
    """Last in this module: it restarts the engine."""
    pid = server.engine_pids()[-1]
    long = {"prompt": "Once upon a time", "max_tokens": LONG_CTX - 100, "temperature": 0,
            "ignore_eos": True}
    with cf.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(_post, server, TEXT, long, 120) for _ in range(2)]
        _wait(lambda: server.health().json()["slots_processing"] == 2, 30, "both slots busy")
        os.kill(pid, signal.SIGSTOP)
        queued = pool.submit(_post, server, TEXT, {"prompt": "Hello", "max_tokens": 4}, 120)
        t0 = time.monotonic()
        h = _wait(lambda: (r := server.health()).status_code == 503 and r.json(), 15, "/health 503")
        assert h["status"] in ("stalled", "restarting", "loading")
        faults = _wait(lambda: (f := httpx.get(server.url + "/faults").json())["total"] >= 1 and f,
                       30, "a fault")
        noticed = time.monotonic() - t0
        stall = faults["faults"][-1]
        assert stall["kind"] == "stall" and "not even its heartbeat" in stall["stall"], stall
        assert "SIGKILL" in stall["message"] and stall["requests_in_flight"] == 2
        for f in running:
            r = f.result()
            assert r.status_code == 500 and "stalled" in r.json()["error"]["message"], r.text
        r = queued.result()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert 5 <= noticed <= 20, noticed
    server.wait_ready()
    assert _post(server, CHAT, {"messages": HI, "max_tokens": 3}).status_code == 200


# ---- 1 and 2 with injected faults: a loop that raises, dies, blocks ------------------------------


@pytest.fixture(scope="module")
def faulty(model):
    # engine 1: planning its 3rd window raises, its 12th window ends the loop's thread;
    # engine 2: its 4th window blocks the loop for good; engine 3 is healthy
    args = [str(model), "--parallel", "2", "--max-context", str(N_CTX), "--engine-stall-s", "8",
            "--request-timeout-s", "120"]
    with ServerProcess(args,
                       env={"STRATA_FAULT": "plan_error:3@1,loop_death:12@1,block:4@2"}) as srv:
        srv.wait_ready()
        yield srv


def _text(srv, n, prompt="Hello"):
    return _post(srv, TEXT,
                 {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}, 120)


def test_a_failing_window_ends_its_requests_and_the_loop_goes_on(faulty):
    ok = _text(faulty, 2)                         # windows 1 and 2
    assert ok.status_code == 200
    r = _text(faulty, 4)                          # window 3's planning raises
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    assert "planning a window" in msg and "RuntimeError" in msg and "injected" in msg, msg
    assert _text(faulty, 3).status_code == 200   # the same engine goes on
    assert faulty.health().json()["restarts"] == 0


def test_when_the_loop_thread_ends_the_engine_exits_with_an_err_line(faulty):
    r = _text(faulty, 20)                         # reaches window 12: the loop's thread ends
    assert r.status_code == 500
    faults = _wait(lambda: (f := httpx.get(faulty.url + "/faults").json())["total"] >= 1 and f, 30,
                   "a fault")
    fault = faults["faults"][-1]
    assert fault["kind"] == "exit" and fault["exit_code"] == 1
    assert fault["error_line"].startswith("ERR the engine loop stopped: InjectedLoopDeath"), fault
    faulty.wait_ready()
    assert _text(faulty, 2).status_code == 200   # engine 2, windows 1-2


def test_watchdog_kills_an_engine_whose_loop_blocks(faulty):
    with cf.ThreadPoolExecutor(3) as pool:
        # block at engine 2's 4th window
        stuck = [pool.submit(_text, faulty, 30, p) for p in ("One", "Two")]
        _wait(lambda: "blocks the engine loop" in faulty.log(), 30, "the blocking fault")
        _wait(lambda: faulty.health().json()["slots_processing"] == 2, 30, "both slots busy")
        queued = pool.submit(_text, faulty, 3, "Queued")
        t0 = time.monotonic()
        faults = _wait(lambda: (f := httpx.get(faulty.url + "/faults").json())["total"] >= 2 and f,
                       40, "the stall")
        noticed = time.monotonic() - t0
        fault = faults["faults"][-1]
        assert fault["kind"] == "stall" and "loop has not moved" in fault["stall"], fault
        assert [f.result().status_code for f in stuck] == [500, 500]
        assert queued.result().status_code == 200
    assert 4 <= noticed <= 20, noticed


# ---- NaN logits ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_model(model, tmp_path_factory):
    """The tiny model with NaN in its final norm: every logit is NaN."""
    path = tmp_path_factory.mktemp("nan") / "nan.gguf"
    path.write_bytes(Path(model).read_bytes())
    t = GGUFModel.open(path).tensors["output_norm.weight"]
    with open(path, "r+b") as f:
        f.seek(t.offset)
        f.write(np.full(t.n_bytes // 4, np.nan, np.float32).tobytes())
    return path


def test_nan_logits_end_the_request_with_an_error_not_token_0_forever(nan_model):
    with ServerProcess([str(nan_model), "--parallel", "2", "--max-context", str(N_CTX)]) as srv:
        srv.wait_ready()
        for body in ({"prompt": "Hi", "max_tokens": 50, "temperature": 0},
                     {"prompt": "Hi", "max_tokens": 50, "temperature": 0.9, "seed": 1}):
            r = _post(srv, TEXT, body)
            assert r.status_code == 500 and "NaN or inf" in r.json()["error"]["message"], r.text
        with httpx.stream("POST", srv.url + TEXT,
                          json={"prompt": "Hi", "max_tokens": 50, "stream": True}, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "NaN or inf" in events[-2] and events[-1] == "data: [DONE]"
        assert srv.health().json()["restarts"] == 0
