"""No request names a file, reads the server's secrets or its internals (issue 13, item 5), and the
compile cache that makes a restart quick (item 8).

Against one real `strata-jax serve` process on a tiny MoE model, started with --api-key-file and
--expert-profile-dir in a temporary folder (and STRATA_API_KEY set in its environment, to show the
engine child does not get it): profile names good and bad, the file's mode, nothing written
elsewhere; POST bodies that are not application/json; /v1/models without paths. Then, without a
model: the 500 handler hides the exception's text; and two engine processes in one compile cache
folder, the second loading its programs instead of compiling them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from strata_jax.serve.launch import ServerProcess

MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}
FILE_KEY = "key-from-the-file"
ENV_KEY = "key-from-the-environment"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    keyfile = root / "key.txt"
    keyfile.write_text(FILE_KEY + "\n")
    (root / "a").mkdir()
    profiles = root / "a" / "profiles"              # missing: the server creates it, private
    model = tiny_model(**MOE)
    args = [str(model), "--parallel", "1", "--max-context", "64", "--no-warmup",
            "--api-key-file", str(keyfile), "--expert-profile-dir", str(profiles)]
    with ServerProcess(args, env={"STRATA_API_KEY": ENV_KEY}) as srv:
        srv.api_key = FILE_KEY                      # srv.headers: the key the file holds
        srv.wait_ready()
        srv.root, srv.profiles, srv.model = root, profiles, model
        yield srv


def _post(srv, path, body, headers=None, **kw):
    return httpx.post(srv.url + path, json=body, headers={**srv.headers, **(headers or {})},
                      timeout=120, **kw)


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    return err


BAD_NAMES = ["../x", "../../etc/passwd", "/etc/passwd", "a/b", "a\\b", "", ".hidden", "..", "a..b",
             "x" * 300, "name with spaces", "nul\x00byte", "ü"]


def test_expert_profile_takes_a_name_and_writes_privately_into_its_directory(server):
    r = _post(server, "/v1/completions", {"prompt": "hello there", "max_tokens": 4})
    assert r.status_code == 200, r.text
    r = _post(server, "/expert-profile", {"name": "hot-2026"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"] == "hot-2026" and body["path"] == "hot-2026.json" and body["routed"] > 0
    # no path of the server's machine
    assert "/" not in json.dumps(body)
    written = server.profiles / "hot-2026.json"
    assert json.loads(written.read_text())["routed"] == body["routed"]
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.profiles.stat().st_mode) == 0o700
    assert (_post(server, "/expert-profile", {"name": "hot-2026.json"}).json()["path"]
            == "hot-2026.json")

    for name in BAD_NAMES:
        err = _error(_post(server, "/expert-profile", {"name": name}), 400)
        assert err["param"] == "name", name
        # the 400 names the value
        assert repr(name[:120]) in err["message"], (name, err["message"])
    for body in ({"name": 7}, {"name": None}, {}, [], "hot", {"name": ["a"]}):
        assert _error(_post(server, "/expert-profile", body), 400)["param"] == "name", body
    for body in ({"path": str(server.root / "x.json")}, {"name": "ok", "path": "/tmp/ok.json"}):
        err = _error(_post(server, "/expert-profile", body), 400)
        assert (err["param"] == "path" and "name" in err["message"]
                and "--expert-profile-dir" in err["message"])
    assert (_error(_post(server, "/expert-profile", {"name": "ok", "dir": "/tmp"}), 400)["param"]
            == "dir")

    # nothing but the one profile, nowhere else: no temporary files left, nothing beside the
    # directory
    assert sorted(os.listdir(server.profiles)) == ["hot-2026.json"]
    assert sorted(os.listdir(server.root / "a")) == ["profiles"]
    assert sorted(os.listdir(server.root)) == ["a", "key.txt"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/chat/completions", "/v1/completions",
                                   "/completions", "/expert-profile"])
def test_post_routes_need_application_json(server, route):
    body = json.dumps({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2})
    for given in ("text/plain", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"):
        r = httpx.post(server.url + route, content=body,
                       headers={**server.headers, "Content-Type": given}, timeout=60)
        err = _error(r, 415)
        assert given in err["message"] and "application/json" in err["message"]
    r = httpx.post(server.url + route, content=body.encode(), headers=server.headers, timeout=60)
    assert "no Content-Type" in _error(r, 415)["message"]
    # with a charset it is JSON all the same
    r = httpx.post(server.url + route, content=body, timeout=120,
                   headers={**server.headers, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code != 415, r.text
    if route.endswith("/completions") and "chat" not in route:
        assert r.status_code == 200, r.text


def test_models_shows_no_path(server):
    r = httpx.get(server.url + "/v1/models", headers=server.headers)
    assert r.status_code == 200
    meta = r.json()["data"][0]["meta"]
    assert meta["path"] == server.model.name
    assert "/" not in r.text and str(server.model.parent) not in r.text


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def test_the_key_comes_from_the_file_and_the_engine_does_not_inherit_it(server):
    url = server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    # the file wins
    assert httpx.get(url, headers={"Authorization": f"Bearer {ENV_KEY}"}).status_code == 401
    assert httpx.get(url, headers=server.headers).status_code == 200
    assert _environ(server.proc.pid).get("STRATA_API_KEY") == ENV_KEY       # the server has it ...
    assert server.engine_pids(), server.log()
    engine = server.engine_pids()[-1]
    assert engine != server.proc.pid
    env = _environ(engine)
    # ... this is the engine child ...
    assert "STRATA_ENGINE_GENERATION" in env
    assert "STRATA_API_KEY" not in env                                      # ... and it does not
    for pid in (engine, server.proc.pid):
        assert FILE_KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


# ---- without a model -----------------------------------------------------------------------------

def test_a_500_says_where_the_log_is_not_what_failed(caplog):
    from litestar.testing import TestClient

    from strata_jax import EngineConfig, ServerConfig
    from strata_jax.serve.app import create_app
    from strata_jax.serve.supervisor.supervisor import Supervisor

    sup = Supervisor("/very/secret/dir/mock.gguf", EngineConfig(parallel=1, max_context=64),
                     command=[sys.executable, "-m", "strata_jax.serve.worker.mock_worker"])

    def broken():
        raise RuntimeError("token sk-secret-123 at /very/secret/dir")

    sup.slots = broken
    app = create_app(sup, ServerConfig(model=sup.model))
    with caplog.at_level(logging.ERROR, logger="strata_jax.serve"), TestClient(app) as client:
        r = client.get("/slots")
        models = client.get("/v1/models").text
    err = _error(r, 500)
    assert "secret" not in r.text and "RuntimeError" not in r.text
    ref = re.search(r"err-[0-9a-f]{8}", err["message"]).group(0)
    logged = [rec for rec in caplog.records if ref in rec.getMessage()]
    # the operator finds it in the log
    assert logged and "sk-secret-123" in str(logged[0].exc_info[1])
    assert "/very/secret" not in models and "mock.gguf" in models


def test_compile_cache_private_and_refused_when_others_can_write(tmp_path, caplog):
    from strata_jax.compile_cache import private_dir

    fresh = tmp_path / "new" / "jax-compile"
    assert private_dir(fresh) == str(fresh) and stat.S_IMODE(fresh.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="strata_jax.engine"):
        assert private_dir(shared) is None
    assert "can be written by its group or others" in caplog.text and "not used" in caplog.text
    shared.chmod(0o700)
    assert private_dir(shared) == str(shared)


START = """
import json, sys
from strata_jax import Engine, EngineConfig, compile_cache
with Engine.from_gguf(sys.argv[1], EngineConfig(parallel=1, max_context=64, prefill=16, warmup=False)) as eng:
    out = eng.generate("hello", max_tokens=2, ignore_eos=True)
    print(json.dumps({**compile_cache.counters(), "build_s": eng.stats()["programs"]["build_seconds"],
                      "tokens": out.tokens}))
"""  # noqa: E501


def test_a_second_start_loads_its_programs_from_the_compile_cache(tiny_model, tmp_path):
    """Two engine processes on one model in one (fresh) cache folder: the first compiles and stores
    every program, the second finds them (JAX's cache-hit events) and builds in less time, with the
    same tokens."""
    model = tiny_model(**MOE)
    env = {**os.environ, "STRATA_JAX_COMPILE_CACHE": str(tmp_path / "jc")}

    def start() -> dict:
        p = subprocess.run([sys.executable, "-c", START, str(model)], env=env, capture_output=True,
                           text=True, timeout=300, check=False)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    assert first["on"] and first["hits"] == 0 and first["misses"] > 0
    assert stat.S_IMODE((tmp_path / "jc").stat().st_mode) == 0o700
    assert second["hits"] > 0 and second["misses"] * 10 <= first["misses"], (first, second)
    assert second["build_s"] < first["build_s"], (first, second)
    assert second["tokens"] == first["tokens"]


def test_compile_cache_location_and_off_switch(monkeypatch, tmp_path):
    from strata_jax.compile_cache import cache_path

    monkeypatch.delenv("STRATA_JAX_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path))
    assert cache_path() == tmp_path / "jax-compile"
    for off in ("off", "0", "no", "false", "none", "OFF"):
        monkeypatch.setenv("STRATA_JAX_COMPILE_CACHE", off)
        assert cache_path() is None
    monkeypatch.setenv("STRATA_JAX_COMPILE_CACHE", str(tmp_path / "mine"))
    assert cache_path() == tmp_path / "mine"
