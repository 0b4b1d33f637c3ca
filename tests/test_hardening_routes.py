"""Issue 32, items 9, 10, 11, 13 and 15: what a browser page, a request or a planted file can do to
the llama.cpp routes, against one real server (tiny qwen3, --props, --slot-save-path,
--ui-mcp-proxy, no API key):

    9   /cors-proxy refuses cross-site callers (no CORS allowance either), streams a target's body
        under a byte cap with memory flat, and never serves a target's active content (text/html) as
        such on the API's origin
    10  POST /props refuses a default that a request would be refused for, naming the field and the
        value
    11  /slots/N actions (erase included) and /props need Content-Type application/json: a 415
        naming it
    13  slot files: a planted symlink at the temporary name changes nothing, a shared
        --slot-save-path folder is refused at start, an npz that inflates far beyond the model's KV
        is refused before it is inflated
    15  a slot id beyond 64 bits or negative is a 400 naming id_slot
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from strata_jax.config import ConfigError, ServerConfig
from strata_jax.serve.launch import ServerProcess

EVIL = "http://evil.example"
BIG = 64 << 20                  # a target's body: four times the proxy's default cap (16 MiB)
MiB = 1 << 20


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    saves = root / "slots"              # missing: the server makes it, private
    args = [str(model), "--parallel", "1", "--max-context", "128", "--no-warmup", "--temp", "0",
            "--slot-save-path", str(saves), "--props", "--ui-mcp-proxy"]
    with ServerProcess(args) as srv, _target() as target:
        srv.wait_ready()
        srv.root, srv.saves, srv.target = root, saves, f"http://127.0.0.1:{target.server_port}"
        yield srv


def _post(srv, path, body, headers=None, **kw):
    return httpx.post(srv.url + path, content=json.dumps(body), timeout=120,
                      headers={"Content-Type": "application/json", **(headers or {})}, **kw)


def _error(r, status, *words):
    assert r.status_code == status, r.text[:2000]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}, err
    for w in words:
        assert w in err["message"], err
    return err


# ---- 9: /cors-proxy ------------------------------------------------------------------------------

class _Target(BaseHTTPRequestHandler):
    """The proxy's target: /page is HTML with a script, /json a small JSON, /big BIG bytes with no
    length (read to the connection's end), /declared BIG bytes with a Content-Length."""
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        if self.path in ("/big", "/declared"):
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            if self.path == "/declared":
                self.send_header("Content-Length", str(BIG))
            self.end_headers()
            chunk = b"x" * MiB
            with contextlib.suppress(OSError):
                for _ in range(BIG // MiB):
                    self.wfile.write(chunk)
            return
        body, kind = (b"<html><script>fetch('/v1/models')</script></html>",
                      "text/html; charset=utf-8") \
            if self.path == "/page" else (b'{"ok": true}', "application/json")
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _target():
    target = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    target.daemon_threads = True
    threading.Thread(target=target.serve_forever, daemon=True).start()
    try:
        yield target
    finally:
        target.shutdown()
        target.server_close()


def _proxy(srv, url, headers=None, method="GET", **kw):
    return httpx.request(method, srv.url + "/cors-proxy", params={"url": url},
                         headers=headers or {}, timeout=120, **kw)


def test_cors_proxy_refuses_cross_site_callers(server):
    """A page on another site cannot read the loopback (the server's own API here) through the
    proxy: a foreign Origin, Origin null, or a browser's Sec-Fetch-Site cross-site / same-site is a
    403 with no CORS allowance, and the preflight allows it nothing. The server's own page (its
    Origin, Sec-Fetch-Site same-origin) and a non-browser caller still get the target's answer."""
    own = f"{server.url}/v1/models"
    for headers in ({"Origin": EVIL}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site"},
                    {"Origin": EVIL, "Sec-Fetch-Site": "same-origin"}):
        for method in ("GET", "POST"):
            r = _proxy(server, own, headers, method)
            err = _error(r, 403, "cross-site")
            assert err["type"] == "permission_error"
            assert "access-control-allow-origin" not in r.headers, (headers, dict(r.headers))
    pre = httpx.options(server.url + "/cors-proxy", params={"url": own},
                        headers={"Origin": EVIL, "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in pre.headers, dict(pre.headers)
    for headers in ({}, {"Origin": server.url, "Sec-Fetch-Site": "same-origin"},
                    {"Sec-Fetch-Site": "none"}):
        r = _proxy(server, own, headers)
        assert r.status_code == 200 and r.json()["object"] == "list", (headers, r.text)
    # CORS still serves the API itself to any origin (llama.cpp's default --cors-origins *)
    assert httpx.get(own, headers={"Origin": EVIL}).headers["access-control-allow-origin"] == EVIL


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")      # VmHWM := VmRSS (Linux >= 4.0)


def test_cors_proxy_streams_under_a_byte_cap(server):
    """A target's body is passed on as it comes, up to --cors-proxy-max-bytes (16 MiB by default): a
    body that declares more is a 502 naming the flag before any of it is read; one that turns out
    longer is cut at the cap. Either way the server's memory stays flat (the 64 MiB bodies are never
    held whole)."""
    pid = server.proc.pid
    _reset_peak(pid)
    before = _rss_kib(pid)
    r = _proxy(server, server.target + "/declared")
    _error(r, 502, "--cors-proxy-max-bytes", str(BIG))
    got = 0
    with pytest.raises(httpx.HTTPError), httpx.stream("GET", server.url + "/cors-proxy",
                                                      timeout=120,
                                                      params={"url": server.target + "/big"}) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            got += len(chunk)
    assert 0 < got <= 16 * MiB, got
    grew = _rss_kib(pid, "VmHWM") - before
    assert grew < 24 * 1024, f"the server grew {grew} KiB proxying 64 MiB bodies"
    assert "--cors-proxy-max-bytes" in server.log()
    assert httpx.get(server.url + "/health").status_code == 200


def test_cors_proxy_never_serves_active_content(server):
    """A target's HTML comes back as text/plain, with nosniff and a sandboxing CSP: it never runs as
    a page of the API's origin (where the web UI keeps its key). JSON (an MCP server's answer) comes
    back as JSON."""
    r = _proxy(server, server.target + "/page")
    assert r.status_code == 200 and "<script>" in r.text
    assert r.headers["content-type"].startswith("text/plain"), dict(r.headers)
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "sandbox" in r.headers["content-security-policy"]
    r = _proxy(server, server.target + "/json")
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-content-type-options"] == "nosniff"


# ---- 10: POST /props -----------------------------------------------------------------------------

BAD_DEFAULTS = [({"top_p": 0}, "top_p"), ({"top_k": 2.5}, "top_k"),
                ({"repeat_penalty": 0}, "repeat_penalty"),
                ({"top_k": 1_000_000_000}, "top_k"), ({"temperature": 1e9}, "temperature"),
                ({"min_p": -0.5}, "min_p"), ({"n_predict": 2.5}, "n_predict"),
                ({"repeat_last_n": -2},
                                                                                "repeat_last_n")]


def test_props_refuses_what_a_request_would_refuse(server):
    """A default a request that sets nothing would be refused for is refused by POST /props (400
    naming the field and the value), and the server's requests keep working; --top-p 0 on the
    command line is refused too."""
    try:
        for body, field in BAD_DEFAULTS:
            r = _post(server, "/props", body)
            err = _error(r, 400, field, json.dumps(body[field]))
            assert err["param"] == field, err
            plain = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            assert plain.status_code == 200, (body, plain.text)
        ok = _post(server, "/props", {"top_k": -1, "top_p": 0.5, "n_predict": -1})
        assert ok.status_code == 200, ok.text
        assert (_post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code
                == 200)
    finally:
        _post(server, "/props", {"top_k": 40, "top_p": 0.95})
    for key, value in (("top_p", 0), ("repeat_penalty", 0), ("top_k", 2.5)):
        with pytest.raises(ConfigError, match=f"--{key.replace('_', '-')} {value}"):
            ServerConfig(sampling={key: value})


def test_a_top_k_beyond_the_vocabulary_stops_the_server_at_start(model):
    """--top-k is judged as a request's top_k is, against the model's vocabulary (512 here), at
    start."""
    args = [str(model), "--max-context", "64", "--no-warmup", "--top-k", "100000"]
    with ServerProcess(args) as srv, pytest.raises(RuntimeError,
                                                   match="exited with code 1") as refused:
        srv.wait_up()
        srv.stop()
        raise AssertionError("the server started with --top-k 100000 (every request would be a "
                             "400)")
    assert ("--top-k 100000" in str(refused.value)
            and "512 (the vocabulary)" in str(refused.value)), refused.value


# ---- 11: state-changing routes need JSON ---------------------------------------------------------

def test_state_changing_routes_need_json(server):
    """A cross-site form or text/plain POST (no preflight) changes nothing: /slots/N's actions,
    erase included, and /props are 415 naming Content-Type unless the body is application/json."""
    body = json.dumps({"filename": "plain.bin"})
    for action in ("save", "restore", "erase"):
        for headers in ({"Content-Type": "text/plain"},
                        {"Content-Type": "application/x-www-form-urlencoded"}, {}):
            r = httpx.post(f"{server.url}/slots/0?action={action}", content=body, headers=headers)
            err = _error(r, 415, "Content-Type", "application/json")
            assert err["param"] == "Content-Type", err
    assert not (server.saves / "plain.bin").exists()
    r = httpx.post(server.url + "/props", content='{"top_k": 3}',
                   headers={"Content-Type": "text/plain"})
    _error(r, 415, "application/json")
    assert _post(server, "/slots/0?action=erase", {}).status_code == 200


# ---- 15: slot ids --------------------------------------------------------------------------------

def test_slot_ids_are_bounded_and_named(server):
    """A slot id beyond 64 bits, negative, or past the server's slots is a 400 naming id_slot and
    the value."""
    wrong = {}
    for slot in ("1180591620717411303424", "-1", "1", "99999999999999999999999999999999999999",
                 "0x0", "\u0661"):
        for action in ("erase", "save"):
            r = _post(server, f"/slots/{slot}?action={action}", {"filename": "s.bin"})
            err = r.json().get("error") or {}
            if not (r.status_code == 400 and f"id_slot = {slot}" in err["message"]
                    and "0..0" in err["message"]
                    and err["param"] == "id_slot"):
                wrong[f"{action} {slot}"] = (r.status_code, err.get("message"), err.get("param"))
    assert not wrong, wrong
    assert httpx.get(server.url + "/health").status_code == 200


# ---- 13: slot files ------------------------------------------------------------------------------

def _fill_slot(srv):
    """Slot 0 keeps the KV of a prompt longer than a prefix-cache block."""
    r = _post(srv, "/v1/completions",
              {"prompt": "one two three four five six seven eight nine ten " * 2,
                                       "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_slot_save_ignores_a_planted_symlink(server, tmp_path):
    """A symlink planted at the name save used to write through (NAME.tmp-<engine pid>) changes
    nothing: the temporary file is a fresh random one, made O_EXCL|O_NOFOLLOW, mode 0600, renamed
    into place. The folder the server made is private; a slot file that is a symlink is not
    restored."""
    assert stat.S_IMODE(server.saves.stat().st_mode) == 0o700
    _fill_slot(server)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    for pid in server.engine_pids():
        (server.saves / f"planted.bin.tmp-{pid}").symlink_to(victim)
    r = _post(server, "/slots/0?action=save", {"filename": "planted.bin"})
    assert r.status_code == 200 and r.json()["n_saved"] > 0, r.text
    assert victim.read_bytes() == b"precious", "save wrote through the planted link"
    saved = server.saves / "planted.bin"
    assert not saved.is_symlink() and stat.S_IMODE(saved.stat().st_mode) == 0o600
    left = sorted(p.name for p in server.saves.iterdir() if ".tmp" in p.name and not p.is_symlink())
    assert left == [], left
    (server.saves / "linked.bin").symlink_to(saved)
    _error(_post(server, "/slots/0?action=restore", {"filename": "linked.bin"}), 400, "linked.bin")
    r = _post(server, "/slots/0?action=restore", {"filename": "planted.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] > 0, r.text


def _bomb(good: Path, out: Path, inflated: int) -> None:
    """good's slot file with its first KV member replaced by `inflated` zero bytes (deflated: a few
    hundred KiB)."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        first = next(n for n in names if n.startswith("kv."))
        for name in names:
            if name != first:
                dst.writestr(name, src.read(name))
                continue
            with dst.open(name, "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False,
                                                         "shape": (inflated,)})
                zeros = bytes(MiB)
                for _ in range(inflated // MiB):
                    f.write(zeros)


def test_slot_restore_refuses_a_bomb_before_inflating(server):
    """An npz whose KV member inflates to 256 MiB (the model's KV is a few KiB) is a 400 read from
    the zip's directory: the engine's memory does not grow by what it would inflate to. allow_pickle
    stays off."""
    _fill_slot(server)
    r = _post(server, "/slots/0?action=save", {"filename": "good.bin"})
    assert r.status_code == 200, r.text
    _bomb(server.saves / "good.bin", server.saves / "bomb.bin", 256 * MiB)
    assert (server.saves / "bomb.bin").stat().st_size < 2 * MiB
    (engine,) = server.engine_pids()[-1:]
    _reset_peak(engine)
    before = _rss_kib(engine)
    r = _post(server, "/slots/0?action=restore", {"filename": "bomb.bin"})
    grew = _rss_kib(engine, "VmHWM") - before
    assert grew < 64 * 1024, (f"the engine grew {grew} KiB refusing the file ({r.status_code}: "
                              f"{r.text[:300]})")
    _error(r, 400, "bomb.bin", "kv.")
    # a pickled object array is refused too (numpy's allow_pickle=False)
    buf = io.BytesIO()
    np.savez(buf, tokens=np.asarray([1, 2], np.int32), evil=np.asarray([{"a": 1}], dtype=object))
    (server.saves / "pickled.bin").write_bytes(buf.getvalue())
    _error(_post(server, "/slots/0?action=restore", {"filename": "pickled.bin"}), 400,
           "pickled.bin")
    assert _post(server, "/slots/0?action=restore", {"filename": "good.bin"}).status_code == 200


def _shared_folder(root: Path, mode) -> Path:
    shared = root / "shared"
    shared.mkdir()
    if mode == "owner":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(shared, 4321, 4321)
        shared.chmod(0o700)
    else:
        shared.chmod(mode)
    return shared


def _refusal(mode) -> str:
    return "user 4321" if mode == "owner" else f"mode {mode:o}"


def test_a_world_writable_slot_save_path_stops_the_server_at_start(model, tmp_path):
    """An existing --slot-save-path anyone may write to is refused at start (exit 1), naming the
    folder and its mode: another user could plant files (or links) there for the server to read and
    overwrite."""
    shared = _shared_folder(tmp_path, 0o777)
    args = [str(model), "--max-context", "64", "--no-warmup", "--slot-save-path", str(shared)]
    with ServerProcess(args) as srv, pytest.raises(RuntimeError,
                                                   match="exited with code 1") as refused:
        srv.wait_up()
        srv.stop()
        raise AssertionError("the server started with --slot-save-path mode "
                             f"{shared.stat().st_mode:o}")
    said = str(refused.value)
    assert "--slot-save-path" in said and str(shared) in said and _refusal(0o777) in said, said


@pytest.mark.parametrize("mode", [0o770, 0o722, "owner"],
                         ids=lambda m: m if isinstance(m, str) else oct(m))
def test_a_shared_slot_save_path_is_refused(model, tmp_path, mode):
    """The same check where the server is built (serve.build, as the command above does): a folder
    its group or others may write to, or another user's, is refused; the server's own private folder
    is taken."""
    from strata_jax.config import EngineConfig
    from strata_jax.serve import build

    shared = _shared_folder(tmp_path, mode)
    with pytest.raises(ValueError, match="--slot-save-path") as refused:
        build(ServerConfig(model=str(model), slot_save_path=str(shared)),
              EngineConfig(max_context=64), progress=False)
    assert str(shared) in str(refused.value) and _refusal(mode) in str(refused.value), refused.value
    own = tmp_path / "own"
    assert build(ServerConfig(model=str(model), slot_save_path=str(own)),
                 EngineConfig(max_context=64), progress=False) is not None
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
