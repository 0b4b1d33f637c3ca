"""Issue 32, items 8 and 12: peers and the network.

8. The process-group channel (engine/distributed/lockstep.py, engine/distributed/group_channel.py):
   strangers on a real leader's port (garbage, a huge length, a hello signed with no key, a replayed
   handshake, a silent connection) neither fail the group's start nor take a follower's place nor
   read a frame, while real followers join; the channel and jax.distributed's coordinator listen on
   the coordinator's address; frames are bounded.
12. Ray replicas' ingress (serve/replicas/replica_ingress.py) as a real HTTP server (uvicorn, fake
   replicas): the key before the body, a bounded body, deeply nested JSON a 400, a public /health
   with only a status; then on a real local Ray started as `serve --replicas` starts it: no
   dashboard, and the same through Ray Serve's proxy.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import httpx
import msgspec
import psutil
import pytest

from strata_jax import EngineConfig
from strata_jax.config import ConfigError
from strata_jax.engine.distributed.hosts import (
    Hello,
    KvReset,
    Loaded,
    digest,
    pack,
    unpack,
)
from strata_jax.gguf import GGUFModel
from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.ports import group_port

MOE = {"arch": "qwen3moe", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}
FLAGS = ["--parallel", "2", "--max-context", "256", "--no-warmup"]
PROMPT = [(7 * i + 13) % 500 + 3 for i in range(24)]
KEY = "k3y-0f-th1s-gr0up-" + "7" * 20


def listening(pid: int, port: int) -> list[str]:
    """The addresses `pid` listens on at `port` (an IPv4-mapped IPv6 one as its IPv4 address)."""
    return [c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def framed(body: bytes) -> bytes:
    return len(body).to_bytes(8, "big") + body


class Stranger:
    """One connection to the leader's channel that sends `payload` and keeps reading whatever comes
    back until the leader closes it (or 60 s pass)."""

    def __init__(self, port: int, payload: bytes):
        self.got = bytearray()
        self.closed_by_leader = False
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        # TCP's self-connect (source port = port): nobody listened
        if self.sock.getsockname()[1] == port:
            self.sock.close()
            raise ConnectionRefusedError(f"nobody listens on {port}")
        self.sock.settimeout(0.5)
        if payload:
            self.sock.sendall(payload)
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.closed_by_leader = True
                return
            self.got += chunk

    def frames(self) -> list:
        """The frames it received (each an 8-byte length, then the body)."""
        out, data = [], bytes(self.got)
        while len(data) >= 8:
            n = int.from_bytes(data[:8], "big")
            out.append(unpack(data[8:8 + n]))
            data = data[8 + n:]
        return out

    def done(self) -> None:
        """Once the leader closed it (a silent one: after the leader's handshake timeout, 5 s)."""
        self._t.join(60)
        self.sock.close()


def stranger_rounds(port: int, digest_: str, until: threading.Event, rounds: list) -> None:
    """From when the channel listens until the group has formed (it then stops listening) or
    `until`: round after round of garbage, a huge length, a hello with a made-up signature, one with
    the right digest claiming process 1 unsigned, and a silent connection. Each round whose five
    connections all got in is kept."""
    hello = ["hello", 1, 4242, "stranger", digest_, b"n" * 32, b"m" * 32]
    payloads = [framed(b"\xc1" * 5), (1 << 62).to_bytes(8, "big"),
                framed(msgspec.msgpack.encode(hello)),
                framed(msgspec.msgpack.encode(["hello", 1, 4243, "stranger", digest_])), b""]
    listened = False
    end = time.monotonic() + 180
    while not until.is_set() and time.monotonic() < end and len(rounds) < 5:
        got: list[Stranger] = []
        try:
            for p in payloads:
                got.append(Stranger(port, p))
        except OSError:
            if listened and not got:
                return                                  # the channel closed: the group has formed
            time.sleep(0.02)
            continue
        listened = True
        if len(got) == len(payloads):
            rounds.append(got)
        time.sleep(0.1)


# ---- 8: the process-group channel ----------------------------------------------------------------


@pytest.mark.slow
def test_strangers_on_the_group_channel_neither_fail_its_start_nor_join_nor_read(tiny_model,
                                                                                 tmp_path):
    model = tiny_model(**MOE)
    key = tmp_path / "group.key"
    key.write_text(KEY + "\n")
    port = group_port()
    group = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--group-key-file",
             str(key)]
    spec = GGUFModel.open(model).spec
    mine = digest(EngineConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, parallel=2,
                               max_context=256, warmup=False, group_key_file=str(key)), spec)
    until = threading.Event()
    rounds: list[list[Stranger]] = []
    watcher = threading.Thread(target=stranger_rounds, args=(port + 1, mine, until, rounds),
                               daemon=True)
    watcher.start()
    with ServerProcess([str(model), *FLAGS, *group, "--process-id", "1"]) as follower, \
            ServerProcess([str(model), *FLAGS, *group, "--process-id", "0"]) as leader:
        leader.wait_ready(180)
        until.set()
        watcher.join(30)
        assert rounds, "no round of strangers reached the leader's channel while the group formed"
        r = httpx.post(leader.url + "/completion",
                       json={"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                                         "return_tokens": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["tokens"]) == 8
        engine = leader.engine_pids()[-1]
        coordinator = listening(engine, port)
        faults = httpx.get(leader.url + "/faults", timeout=10).json()["faults"]
        strangers = [s for r in rounds for s in r]
        for s in strangers:
            s.done()
        assert faults == [], f"a stranger failed the group's start: {faults}"
        assert len(leader.engine_pids()) == 1, leader.log()[-3000:]
        for s in strangers:
            kinds = [type(f).__name__ for f in s.frames()]
            assert kinds in ([], ["Challenge"]), f"a stranger read {kinds}"
            assert s.closed_by_leader, "a stranger's connection was left open"
        assert coordinator == ["127.0.0.1"], ("jax.distributed's coordinator listens on "
                                              f"{coordinator}")
        log = leader.log()
        assert ("refused a connection from 127.0.0.1" in log
                and "not signed with the group key" in log)
        assert "past the bound of 4096 bytes" in log
        assert follower.proc.poll() is None


def _leader(key_file, n: int = 2):
    from strata_jax.engine.distributed.lockstep import Leader

    port = group_port()
    cfg = EngineConfig(coordinator=f"127.0.0.1:{port}", num_processes=n,
                       group_key_file=str(key_file))
    return Leader(cfg, "same"), port


class _Recording(socket.socket):
    """A socket that keeps what it sends (what a listener on the wire would see)."""

    def __init__(self, record: list, **kwargs):
        super().__init__(**kwargs)
        self.record = record

    def sendall(self, data, *args):
        self.record.append(bytes(data))
        return super().sendall(data, *args)


def _follow(port: int, key: bytes, process_id: int = 1, dig: str = "same",
            record: list | None = None):
    """A follower's side of the handshake on a real socket (sent bytes kept in `record`)."""
    from strata_jax.engine.distributed.group_channel import follower_handshake

    c = socket.create_connection(("127.0.0.1", port + 1), timeout=10)
    if record is not None:
        c = _Recording(record, fileno=c.detach())
    follower_handshake(c, key, Hello(process_id, 4242, "elsewhere", dig),
                       f"127.0.0.1 port {port + 1}")
    return c


def test_the_channel_listens_on_the_coordinators_address_only(tmp_path):
    key = tmp_path / "k"
    key.write_text(KEY)
    leader, port = _leader(key)
    try:
        assert listening(os.getpid(), port + 1) == ["127.0.0.1"]
    finally:
        leader.close()


def test_a_replayed_handshake_and_an_unsigned_hello_do_not_join_and_the_real_follower_does(
        tmp_path):
    key_file = tmp_path / "k"
    key_file.write_text(KEY)
    key = KEY.encode()
    first, port1 = _leader(key_file)
    sent: list[bytes] = []
    # a handshake a listener on the wire recorded
    _follow(port1, key, record=sent).sendall(pack(Loaded()))
    first.accept(timeout=10)
    first.close()

    leader, port = _leader(key_file)
    # the same bytes, to the next leader
    replay = Stranger(port + 1, b"".join(sent))
    unsigned = Stranger(port + 1, pack(Hello(1, 4243, "stranger", "same")))   # right digest, no key
    end = time.monotonic() + 15
    while not (replay.closed_by_leader and unsigned.closed_by_leader) and time.monotonic() < end:
        time.sleep(0.05)
    real = _follow(port, key)
    real.sendall(pack(Loaded()))
    leader.accept(timeout=10)
    assert [h.pid for _, h in leader.followers.values()] == [4242]
    with leader.call(KvReset()):                        # a frame goes to the real follower alone
        pass
    real.settimeout(5)
    assert type(unpack(real.recv(1 << 16)[8:])).__name__ == "KvReset"
    for s in (replay, unsigned):
        s.done()
        assert s.closed_by_leader and [type(f).__name__ for f in s.frames()] == ["Challenge"]
    leader.close()
    real.close()


def test_a_follower_with_another_key_is_refused_and_told_so(tmp_path):
    from strata_jax.engine.distributed.group_channel import GroupLost

    key_file = tmp_path / "k"
    key_file.write_text(KEY)
    leader, port = _leader(key_file)
    with pytest.raises(ConfigError,
                       match="closed the channel after this process's hello: it was refused"):
        _follow(port, b"another-key-of-this-length")
    with pytest.raises(GroupLost, match=r"process\(es\) \[1\] did not connect .* not signed with "
                                        r"the group key"):
        leader.accept(timeout=1)


def test_a_frame_past_its_bound_is_refused_naming_the_bound_before_reading_it():
    from strata_jax.engine.distributed.group_channel import FrameError, recv_frame

    a, b = socket.socketpair()
    with a, b:
        a.sendall((1 << 40).to_bytes(8, "big"))
        # no waiting for 1 TiB to come: refused at its length
        b.settimeout(5)
        with pytest.raises(FrameError,
                           match=f"a frame of {1 << 40} bytes, past the bound of 4096 bytes"):
            recv_frame(b, 4096)


def test_a_group_off_loopback_needs_a_key_and_a_loopback_one_makes_a_private_one(tmp_path,
                                                                                 monkeypatch):
    from strata_jax.engine.distributed.group_key import group_key

    with pytest.raises(ConfigError, match="coordinator = '10.1.2.3:1234': is not a loopback "
                                          "address.*--group-key-file"):
        EngineConfig(num_processes=2, coordinator="10.1.2.3:1234")
    short = tmp_path / "short"
    short.write_text("abc\n")
    cfg = EngineConfig(num_processes=2, coordinator="10.1.2.3:1234", group_key_file=str(short))
    with pytest.raises(ConfigError, match="group_key_file = .*16 characters or more"):
        group_key(cfg)
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path / "cache"))
    loop = EngineConfig(num_processes=2, coordinator="127.0.0.1:1234")
    made = group_key(loop)
    path = tmp_path / "cache" / "group-key"
    assert len(made) >= 32 and group_key(loop) == made
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="others may read it"):
        group_key(loop)


# ---- 12: Ray replicas' ingress -------------------------------------------------------------------

SECRET = "ConnectError: /home/someone/.cache/strata-jax/x.sock refused"
INGRESS_KEY = "ingress-key-123"
BODY_MAX = 1 << 20


class _Call:
    """What a DeploymentHandle's .remote() gives: awaitable once, cancellable."""

    def __init__(self, coro):
        self.coro = coro

    def __await__(self):
        return self.coro.__await__()

    def cancel(self) -> None:
        self.coro.close()


class _Stream:
    """A streaming .remote(): an async iterator, cancellable."""

    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        pass


class FakeReplica:
    """A replica's deployment handle as the ingress uses it (health, options(stream=True).forward),
    recording each request forwarded to it; `down` replicas say why in text a public answer must not
    show."""

    def __init__(self, name: str, down: bool = False):
        self.name, self.down = name, down
        self.calls: list[tuple[str, str, int]] = []
        self.health = type("M", (), {"remote": lambda _: _Call(self._health())})()
        self.forward = type("M", (), {"remote": lambda _, *a: _Stream(self._forward(*a))})()

    def options(self, **_):
        return self

    async def _health(self) -> dict:
        info = {"name": self.name, "url": "http://127.0.0.1:40001", "pid": 4242}
        return {**info, "ok": False, "status": "unreachable", "detail": SECRET} if self.down else \
            {**info, "ok": True, "status": "ok"}

    async def _forward(self, method, path, query, headers, body):
        self.calls.append((method, path, len(body)))
        yield {"accepted": self.name}
        yield {"status": 200, "headers": [("content-type", "application/json")], "stream": False}
        yield b'{"ok": true}'


@pytest.fixture(scope="module")
def ingress():
    """The ingress as a real HTTP server (uvicorn, as Ray Serve's proxy hands it each request) over
    two fake replicas: (url, replicas)."""
    import asyncio

    import uvicorn
    from starlette.requests import Request

    from strata_jax.serve.launch import free_port
    from strata_jax.serve.replicas.replica_ingress import ReplicaIngress

    replicas = [FakeReplica("strata-0"), FakeReplica("strata-1", down=True)]
    front = ReplicaIngress(replicas, ["strata-0", "strata-1"], accept_timeout_s=5,
                           api_key=INGRESS_KEY, max_body_bytes=BODY_MAX)

    async def app(scope, receive, send):
        response = await front(Request(scope, receive))
        await response(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    end = time.monotonic() + 30
    while not server.started and time.monotonic() < end:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}", replicas
    finally:
        server.should_exit = True
        t.join(10)
        asyncio.set_event_loop(None)


def _raw(url: str, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request on a raw socket (a client that claims a length and sends little): the status and
    body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as c:
        c.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < 20:
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            raise AssertionError(f"no answer in 20 s to {head.splitlines()[0]!r}: the ingress "
                                 "waited for the body it was promised") from None
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def test_the_ingress_asks_for_the_key_before_it_reads_a_body_and_bounds_the_body(ingress):
    url, replicas = ingress
    huge = ("POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Type: application/json\n"
            "Content-Length: 10737418240\n")
    status, body = _raw(url, huge, b"{" * 1024)                     # 10 GiB promised, no key
    assert status == 401 and b"invalid or missing API key" in body, body[:300]
    status, body = _raw(url, huge.replace("Host: x\n",
                                          f"Host: x\nAuthorization: Bearer {INGRESS_KEY}\n"), b"{")
    assert (status == 413 and f"larger than {BODY_MAX} bytes".encode() in body
            and b"--max-body-bytes" in body)
    auth = {"Authorization": f"Bearer {INGRESS_KEY}"}

    # no Content-Length: a stream past the bound
    def chunks():
        for _ in range(BODY_MAX // 65536 + 2):
            yield b" " * 65536
    r = httpx.post(url + "/v1/completions", content=chunks(), headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    assert not any(c for rep in replicas for c in rep.calls), "a refused body reached a replica"
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers=auth, timeout=30)
    assert r.status_code == 200 and r.headers["x-strata-replica"] == "strata-0", r.text
    # the servers' public page needs no key
    assert httpx.get(url + "/", timeout=30).status_code == 200


def test_json_nested_too_deeply_is_a_400_at_the_ingress(ingress):
    url, _ = ingress
    r = httpx.post(url + "/v1/chat/completions", content=b"[" * 200_000, timeout=30,
                   headers={"Authorization": f"Bearer {INGRESS_KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert "nested too deeply" in r.json()["error"]["message"]


def test_the_public_health_shows_a_status_and_the_details_need_the_key(ingress):
    url, _ = ingress
    public = httpx.get(url + "/health", timeout=30)
    assert public.status_code == 200 and public.json()["status"] == "ok"
    for leak in (SECRET, "40001", "4242", "url", "pid", "detail"):
        assert leak not in public.text, f"the public /health shows {leak!r}: {public.text}"
    full = httpx.get(url + "/health", headers={"X-Api-Key": INGRESS_KEY}, timeout=30).json()
    assert ([r["pid"] for r in full["replicas"]] == [4242, 4242]
            and full["replicas"][1]["detail"] == SECRET)


class RayFakeReplica:
    """A replica deployment with no server behind it (Ray calls health and forward on it, as on
    ReplicaServer)."""

    def __init__(self, name: str):
        self.name = name

    async def health(self) -> dict:
        return {"name": self.name, "url": "http://127.0.0.1:40001", "pid": 4242, "ok": True,
                "status": "ok", "detail": SECRET}

    async def forward(self, method, path, query, headers, body):
        yield {"accepted": self.name}
        yield {"status": 200, "headers": [("content-type", "application/json")], "stream": False}
        yield b'{"ok": true}'


def test_ray_starts_without_its_dashboard_and_its_proxy_hands_the_ingress_no_unchecked_body():
    """A real local Ray (serve --replicas' own start): no dashboard (its job API) on 8265; through
    Ray Serve's HTTP proxy, a body promised 10 GiB without the key is a 401 at once, nested JSON a
    400, /health public."""
    import sys

    import ray  # the test extra pins ray[serve]: a missing Ray is a failure, not a skip
    from ray import cloudpickle, serve

    from strata_jax.serve.launch import free_port
    from strata_jax.serve.replicas import ray_app
    from strata_jax.serve.replicas.replica_ingress import ReplicaIngress

    # Ray's workers cannot import this test module
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def on_8265() -> list[int]:
        return [c.pid for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN
                and c.laddr.port == 8265]
    before = on_8265()
    ctx = ray_app.init_ray({"num_cpus": 2, "log_to_driver": False,
                            "object_store_memory": 100 * 2**20})
    try:
        assert ctx is not None and not ctx.dashboard_url, ctx.dashboard_url
        assert on_8265() == before, "Ray's dashboard (its job API) listens on 8265"
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        names = ["strata-0", "strata-1"]
        handles = [serve.deployment(RayFakeReplica).options(
            name=n, ray_actor_options={"num_cpus": 0}).bind(n)
                   for n in names]
        app = serve.deployment(ReplicaIngress).options(name="strata-ingress",
                                                       ray_actor_options={"num_cpus": 0})
        serve.run(app.bind(handles, names, api_key=INGRESS_KEY, max_body_bytes=BODY_MAX),
                  name="peers", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        status, body = _raw(url, "POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Type: "
                                 "application/json\nContent-Length: 10737418240\n", b"{" * 65536)
        assert status == 401 and b"invalid or missing API key" in body, body[:300]
        r = httpx.post(url + "/v1/chat/completions", content=b"[" * 200_000, timeout=60,
                       headers={"Authorization": f"Bearer {INGRESS_KEY}",
                                "Content-Type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.text, r.text[:300]
        public = httpx.get(url + "/health", timeout=60)
        assert (public.status_code == 200 and SECRET not in public.text
                and "4242" not in public.text), public.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=60,
                       headers={"Authorization": f"Bearer {INGRESS_KEY}"})
        assert r.status_code == 200 and r.headers["x-strata-replica"] in names, r.text
    finally:
        serve.shutdown()
        ray.shutdown()
