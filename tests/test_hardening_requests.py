"""Issue 32, findings 14 and 16, against one real `strata-jax serve` process on a tiny qwen3 model:
no log text in public answers (/health after an engine fault; /faults with paths removed); each of a
request's n choices counts against --max-queue; the early prompt-size refusal counts every field
rendered into the prompt (tools, tool_calls, reasoning_content, chat_template_kwargs), on
/chat/completions/input_tokens too; a client that sends its headers or body a byte at a time is
disconnected after --read-timeout-s while others are served; `cache_salt` keeps one client's
prefix-cache blocks (slots and the conversation cache) from another's.

The engine-killing test runs first, while the engine's last log lines are those of its start (one
names the compile cache's folder); the tests after it run on the engine the server started next."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from strata_jax.compile_cache import ENV as COMPILE_CACHE_ENV
from strata_jax.serve.launch import ServerProcess

KEY = "sk-hardening"
N_CTX = 256
READ_TIMEOUT_S = 2
# ~100 tokens of the tiny model: several conversation-cache blocks (16 tokens each at this context)
PROMPT = "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 2
OTHER = "omega psi chi phi upsilon tau sigma rho pi omicron " * 2


@pytest.fixture(scope="module")
def server(tiny_model):
    model = tiny_model(arch="qwen3", layers=2, hidden=64)
    args = [str(model), "--parallel", "1", "--max-queue", "1", "--max-context", str(N_CTX),
            "--no-warmup", "--read-timeout-s", str(READ_TIMEOUT_S), "--conversation-cache-mib", "8"]
    if os.environ.get("TODAY"): args = [a for a in args
                                        if a not in ("--read-timeout-s", str(READ_TIMEOUT_S))]
    with ServerProcess(args, api_key=KEY) as srv:
        srv.wait_ready()
        yield srv


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=120, **kw)


def error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status, err
    if param is not None:
        assert err.get("param") == param, err
    return err


# ---- 14: no log text in public answers (first: the engine's last lines are its start's) ----------


def test_health_and_faults_show_no_log_text(server):
    """The engine's last log line names the compile cache's folder: /health (public even with
    --api-key) gives a fixed phrase, and /faults (behind the key) keeps its lines with the paths
    taken out."""
    cache = os.environ[COMPILE_CACHE_ENV]
    os.kill(server.engine_pids()[-1], signal.SIGKILL)
    seen, end = [], time.monotonic() + 60
    while time.monotonic() < end:
        r = httpx.get(server.url + "/health", timeout=5)
        if r.status_code == 200 and seen:
            break
        if r.status_code == 503:
            seen.append(r.json())
        time.sleep(0.05)
    assert any(b["status"] == "restarting" for b in seen), seen
    for body in seen:                                   # no engine log line (each names its logger)
        text = json.dumps(body)
        assert cache not in text and "strata_jax" not in text and "log line" not in text, body
    restarting = next(b for b in seen if b["status"] == "restarting")
    assert restarting["reason"].startswith("the engine stopped unexpectedly (killed by SIGKILL, "
                                           "exit code -9)")
    assert httpx.get(server.url + "/faults", timeout=5).status_code == 401
    faults = httpx.get(server.url + "/faults", headers=server.headers, timeout=5).json()
    text = json.dumps(faults)
    assert cache not in text and "/root" not in text and "/tmp" not in text, text
    fault = faults["faults"][-1]
    assert fault["exit_code"] == -9 and fault["last_lines"], fault
    # the lines kept, the paths out
    assert any("<path>" in line for line in fault["last_lines"]), fault
    assert "Its last log line: " in server.log()        # the server's own log keeps the line whole
    server.wait_ready()                                 # the next engine serves the tests below


# ---- 16: n choices are admitted ------------------------------------------------------------------


def test_n_choices_count_against_max_queue(server):
    """--parallel 1 --max-queue 1: two places in all, so n=2 fits and n=3 is a 503 with
    Retry-After."""
    r = post(server, "/v1/completions",
             {"prompt": "hello", "max_tokens": 2, "n": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    r = post(server, "/v1/completions",
             {"prompt": "hello", "max_tokens": 2, "n": 3, "temperature": 0})
    err = error(r, 503)
    assert err["type"] == "unavailable_error" and int(r.headers["Retry-After"]) >= 1, r.headers
    assert "n = 3" in err["message"] and "--max-queue 1" in err["message"], err
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2, "n": 8})
    assert error(r, 503)["type"] == "unavailable_error"
    # the server serves on, and nothing stayed counted
    r = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "n": 2})
    assert r.status_code == 200, r.text


# ---- 16: the early size refusal counts every rendered field --------------------------------------

BIG = "word " * 400_000           # 2 MB of text: far beyond 256 tokens whatever a token's length


def _chat(**extra):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize("field, body", [
    ("tools", _chat(tools=[{"type": "function", "function": {"name": "f", "description": BIG,
                                                             "parameters": {"type": "object"}}}])),
    ("tool_calls", {"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant",
                                  "tool_calls": [{"id": "c1", "type": "function", "function": {
                                     "name": "f", "arguments": json.dumps({"x": BIG})}}]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
                    "max_tokens": 2}),
    ("reasoning_content", {"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "ok",
                                         "reasoning_content": BIG},
                                        {"role": "user", "content": "more"}], "max_tokens": 2}),
    ("chat_template_kwargs", _chat(chat_template_kwargs={"notes": BIG})),
    ("content parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}],
                       "max_tokens": 2}),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/input_tokens"])
def test_early_size_refusal_counts_every_rendered_field(server, field, body, path):
    err = error(post(server, path, body), 400)
    assert err["type"] == "exceed_context_size_error", err
    assert "before tokenizing" in err["message"] and "--max-context" in err["message"], err


def test_input_tokens_still_counts_a_prompt_that_fits(server):
    r = post(server, "/v1/chat/completions/input_tokens", _chat(tools=[
        {"type": "function",
         "function": {"name": "f", "description": "a tool", "parameters": {"type": "object"}}}]))
    assert r.status_code == 200 and 0 < r.json()["input_tokens"] < N_CTX, r.text


# ---- 16: slow clients ----------------------------------------------------------------------------


def _closed_while_trickling(server, head: bytes, trickle: bytes, deadline_s: float = 40.0) -> bytes:
    """Send `head`, then `trickle` a byte every 0.25 s (and check the server serves others
    meanwhile) until the server closes the connection -> what it answered. Fails if it is still open
    at the deadline."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(head)
        end, i, got = time.monotonic() + deadline_s, 0, b""
        s.settimeout(0.25)
        while time.monotonic() < end:
            try:
                chunk = s.recv(65536)
                if not chunk:
                    return got
                got += chunk
                continue
            except TimeoutError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                return got
            try:
                s.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
            except (ConnectionResetError, BrokenPipeError):
                return got
            i += 1
            if i % 4 == 0:
                assert server.health().status_code == 200      # the slow client holds nobody up
        pytest.fail("the server kept a client that trickles one byte each 0.25 s for "
                    f"{deadline_s:.0f} s (--read-timeout-s {READ_TIMEOUT_S}); it answered "
                    f"{got[:200]!r}")


def test_slow_headers_are_cut_off_and_others_served(server):
    got = _closed_while_trickling(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"X-Slow: aaaaaaaaaa")
    if got:                                         # a 408 when the server says why before closing
        assert got.startswith(b"HTTP/1.1 408") and b"--read-timeout-s" in got, got


def test_slow_body_is_cut_off_and_others_served(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode()
            + b"\r\nContent-Length: 100000\r\n\r\n{\"prompt\": \"")
    got = _closed_while_trickling(server, head, b"aaaaaaaaaa")
    if got:
        assert got.startswith(b"HTTP/1.1 408") and b"--read-timeout-s" in got, got


def test_idle_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        got = b""
        # until the server closes it (a socket timeout: never)
        while chunk := s.recv(4096):
            got += chunk
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got


def test_a_whole_request_on_a_kept_alive_connection_is_not_cut(server):
    """The read deadline is each request's: one connection may live longer (keep-alive) and send
    requests whose bytes come whole, each answered."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
               + str(len(body)).encode()
               + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        # 3 x 1.5 s on one connection, past --read-timeout-s 2
        for _ in range(3):
            s.sendall(request)
            got = b""
            while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                assert chunk, got                       # the server closed it
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got
            time.sleep(1.5)


# ---- 16: cache_salt ------------------------------------------------------------------------------


def _cached(server, prompt: str, salt: str | None = None) -> int:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0,
            **({"cache_salt": salt} if salt else {})}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_keeps_clients_apart_in_the_slots(server):
    # a prompt of this test's own (the server is shared)
    prompt = "slots " + PROMPT
    _cached(server, prompt)
    assert _cached(server, prompt) > 0                  # no salt: today's prefix cache
    assert _cached(server, prompt, "alice") == 0        # another salt never reads unsalted KV
    assert _cached(server, prompt, "alice") > 0         # its own, it does
    assert _cached(server, prompt, "bob") == 0
    fresh = "fresh " + PROMPT
    _cached(server, fresh, "alice")
    # nor does an unsalted request read a salted one's
    assert _cached(server, fresh) == 0
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
            "cache_salt": "alice"}
    for _ in range(2):
        r = post(server, "/v1/chat/completions", chat)
    assert (r.status_code == 200
            and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0), r.text


def test_cache_salt_keeps_clients_apart_in_the_conversation_cache(server):
    """--conversation-cache-mib: alice's evicted blocks go to host RAM; bob's same prompt restores
    none of them, alice's does."""
    prompt = "host " + PROMPT
    _cached(server, prompt, "alice")
    # alice's slot KV goes to the conversation cache
    _cached(server, OTHER)
    assert _cached(server, prompt, "bob") == 0
    assert _cached(server, prompt) == 0
    _cached(server, OTHER)
    # restored from host RAM (the slot held OTHER)
    assert _cached(server, prompt, "alice") > 0


@pytest.mark.parametrize("salt, says",
                         [("", "cache_salt"), (7, "cache_salt"), ("x" * 5000, "cache_salt")])
def test_bad_cache_salt_is_a_400_naming_it(server, salt, says):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "cache_salt": salt})
    assert says in error(r, 400)["message"]
