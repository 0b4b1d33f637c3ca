"""`strata-jax serve --replicas N` (strata_jax/serve/replicas/ray_app.py): 2 replicas of a tiny
model as a Ray Serve application on a local Ray started once for the module, spoken to over real
HTTP. Requests spread over both replicas, a conversation keeps its replica, and when one replica's
server is killed mid-request that request fails clearly (naming the replica), the others are served,
and Ray brings the replica back."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest

from strata_jax.serve.launch import free_port
from strata_jax.serve.replicas import replica_routing as routing

NAMES = ["strata-0", "strata-1"]
N_CTX = 1024
# tokens of the requests in flight at the kill: 4 s and more at 10 ms a window (below)
LONG = 400


def chat(text: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


def replica_of(body: dict) -> str:
    """Where the ingress sends `body` while both replicas are up (the test checks the answers say
    the same)."""
    return routing.rank(routing.conversation_key(json.dumps(body).encode()), NAMES)[0]


# -- routing alone (no Ray) ------------------------------------------------------------------------
def test_a_conversation_keeps_its_key_as_it_grows_and_ranks_the_same():
    first = chat("plan my trip")
    later = {**first,
             "messages": [*first["messages"], {"role": "assistant", "content": "where to?"},
                                   {"role": "user", "content": "Rome"}], "max_tokens": 9}
    k1, k2 = (routing.conversation_key(json.dumps(b).encode()) for b in (first, later))
    assert k1 == k2 and k1 != routing.conversation_key(json.dumps(chat("other")).encode())
    assert routing.rank(k1, NAMES) == routing.rank(k2, NAMES)
    assert routing.conversation_key(b"", {"x-strata-conversation": "c1"}) == "h:c1"
    assert routing.conversation_key(b"not json") is None
    # no conversation: round robin
    assert routing.rank(None, NAMES, 1) == ["strata-1", "strata-0"]
    assert (routing.healthy_first(["strata-1", "strata-0"], {"strata-1": False})
            == ["strata-0", "strata-1"])
    # 20 conversations over 3 replicas: one replica down moves only its own conversations
    keys = [f"m:{i}" for i in range(20)]
    three = ["a", "b", "c"]
    before = {k: routing.rank(k, three)[0] for k in keys}
    after = {k: routing.healthy_first(routing.rank(k, three), {"b": False})[0] for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == "b"}


def test_replicas_without_ray_is_a_clear_error(tiny_model, monkeypatch, capsys):
    from strata_jax.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)          # import ray -> ImportError
    model = str(tiny_model(arch="qwen3", layers=2, hidden=64))
    assert main(["serve", model, "--replicas", "2"]) == 1
    err = capsys.readouterr().err
    assert "--replicas" in err and "pip install 'ray[serve]==" in err, err
    assert main(["serve", model, "--replicas", "0"]) == 1
    assert "--replicas 0: must be 1 or more" in capsys.readouterr().err


def test_replica_servers_get_the_arguments_less_host_port_and_replicas(tiny_model, monkeypatch):
    from strata_jax import cli
    from strata_jax.serve.replicas import ray_app

    seen = {}
    monkeypatch.setattr(ray_app, "need_ray", lambda: None)
    monkeypatch.setattr(ray_app, "run_replicas", lambda rest, n, host, port, **kw: seen.update(
        rest=rest, n=n, host=host, port=port, **kw) or 0)
    model = str(tiny_model(arch="qwen3", layers=2, hidden=64))
    assert (cli.main(["serve", model, "--replicas=3", "--host", "0.0.0.0", "--por", "9000",
                      "--parallel", "2"]) == 0)
    assert seen == {"rest": [model, "--parallel", "2"], "n": 3, "host": "0.0.0.0", "port": 9000,
                    "api_key": None, "max_body_bytes": 8 << 20}


# -- a real local Ray ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def endpoint(tiny_model):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from strata_jax.serve.replicas import ray_app

    model = tiny_model(arch="qwen3", layers=2, hidden=64)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)
    # Every window 10 ms longer (engine/faults.py): a tiny model decodes ~1,500 tokens/s here, which
    # would end a request before the test can kill its replica. The replicas' servers get STRATA_*
    # from the environment at build time (ray_app.build_app), the replacement replica too.
    old = os.environ.get("STRATA_FAULT")
    os.environ["STRATA_FAULT"] = "slow:10"
    try:
        url = ray_app.start([str(model), "--parallel", "2", "--max-context", str(N_CTX),
                             "--model-name", "tiny"],
                            2, port=free_port(), health_period_s=1.0, health_grace_s=30.0,
                            # 5 s was too short on a loaded 2-core machine (session 27's CI
                            # run: a replica slow to accept was marked down, and the next
                            # conversations went to the other one)
                            accept_timeout_s=15.0)
    except BaseException:
        serve.shutdown()
        ray.shutdown()
        raise
    finally:
        if old is None:
            os.environ.pop("STRATA_FAULT")
        else:
            os.environ["STRATA_FAULT"] = old
    try:
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def test_health_shows_both_replicas(endpoint):
    r = httpx.get(endpoint + "/health", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok" and body["replicas_ok"] == 2
    assert ([x["name"] for x in body["replicas"]] == NAMES
            and all(x["pid"] > 0 for x in body["replicas"]))


def test_requests_spread_and_a_conversation_keeps_its_replica(endpoint):
    bodies = [chat(f"conversation {i}: tell me about topic {i}") for i in range(8)]
    assert {replica_of(b) for b in bodies} == set(NAMES), ("the 8 conversations hash onto both "
                                                           "replicas")
    with httpx.Client(base_url=endpoint, timeout=60) as c:
        for b in bodies:
            r = c.post("/v1/chat/completions", json=b)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"] is not None
            assert r.headers[routing.REPLICA_HEADER] == replica_of(b)
            follow = {**b, "messages": [*b["messages"], r.json()["choices"][0]["message"],
                                        {"role": "user", "content": "and then?"}]}
            again = c.post("/v1/chat/completions", json=follow)
            assert (again.status_code == 200
                    and again.headers[routing.REPLICA_HEADER] == replica_of(b))
        seen = {c.get("/v1/models").headers[routing.REPLICA_HEADER] for _ in range(4)}
    assert seen == set(NAMES), "requests without a conversation go round"


def test_a_stream_passes_through_chunk_by_chunk(endpoint):
    b = chat("stream me", max_tokens=12, stream=True, ignore_eos=True)
    with httpx.stream("POST", endpoint + "/v1/chat/completions", json=b, timeout=60) as r:
        assert r.status_code == 200 and r.headers[routing.REPLICA_HEADER] == replica_of(b)
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 12, "one event a token at least: the stream was not buffered into one"


def test_a_killed_replica_fails_its_requests_clearly_and_comes_back(endpoint):
    # Two long requests on one replica (the victim), then its server is killed while both run.
    victim_bodies = [b for b in (chat(f"long {i}", max_tokens=LONG, ignore_eos=True)
                                 for i in range(40))
                     if replica_of(b) == "strata-0"][:2]
    other = next(b for b in (chat(f"short {i}") for i in range(40)) if replica_of(b) == "strata-1")
    replicas = health(endpoint)["replicas"]
    before = {x["name"]: x["pid"] for x in replicas}
    victim_url = next(x["url"] for x in replicas if x["name"] == "strata-0")

    def both_running() -> bool:       # the victim's server itself says both requests hold a slot
        end = time.monotonic() + 20
        while time.monotonic() < end:
            slots = httpx.get(victim_url + "/slots", timeout=5).json()
            if sum(1 for x in slots if x["is_processing"]) == 2:
                return True
            time.sleep(0.05)
        return False
    whole: dict = {}

    def send_whole():
        whole["r"] = httpx.post(endpoint + "/v1/chat/completions", json=victim_bodies[0],
                                timeout=120)

    t = threading.Thread(target=send_whole)
    t.start()
    events = []
    start = time.monotonic()
    with httpx.stream("POST", endpoint + "/v1/chat/completions",
                      json={**victim_bodies[1], "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers[routing.REPLICA_HEADER] == "strata-0"
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 5:
                assert both_running() and "r" not in whole, "both requests run on strata-0"
                os.kill(before["strata-0"], signal.SIGKILL)
    t.join(120)
    assert time.monotonic() - start < 100, "neither request hung"
    # the stream: an error event naming the replica, then [DONE]
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["replica"] == "strata-0" and "strata-0" in err["message"] and err["code"] == 503, err
    # the whole request: a 503 JSON error naming the replica
    r = whole["r"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["replica"] == "strata-0" and "strata-0" in r.json()["error"]["message"]

    # the rest are served: the other replica's conversations, and the victim's on the other replica
    with httpx.Client(base_url=endpoint, timeout=60) as c:
        for b in (other, chat("short again", max_tokens=2), victim_bodies[0] | {"max_tokens": 4}):
            r = c.post("/v1/chat/completions", json=b)
            assert r.status_code == 200 and r.headers[routing.REPLICA_HEADER] == "strata-1", r.text

    # Ray replaces the replica (its health check saw the server gone): both healthy again, a new
    # server
    end = time.monotonic() + 150
    now = health(endpoint)
    while time.monotonic() < end and now["replicas_ok"] < 2:
        time.sleep(1)
        now = health(endpoint)
    assert now["replicas_ok"] == 2, now
    after = {x["name"]: x["pid"] for x in now["replicas"]}
    assert after["strata-0"] != before["strata-0"] and after["strata-1"] == before["strata-1"]
    r = httpx.post(endpoint + "/v1/chat/completions", json=victim_bodies[0] | {"max_tokens": 4},
                   timeout=60)
    assert (r.status_code == 200
            and r.headers[routing.REPLICA_HEADER] == "strata-0"), "its conversations came back"
