"""Who may join a group's channel, and how much a frame on it may hold (lockstep.py, issue 32 item
8).

Process 0 listens on the coordinator's own address (port + 1), never on every interface unless that
address is 0.0.0.0. A connection is a follower only once it has proved the group key, by challenge
and response:

    leader -> Challenge(a fresh 32-byte nonce)
    follower -> Hello(process id, pid, host, settings digest, its own nonce, HMAC-SHA256 of both
                nonces and those fields under the key)
    leader -> Welcome(HMAC of the same under the key, labelled otherwise): the follower knows it is
        process 0

A handshake recorded and replayed later fails (the leader's nonce is new each connection). A
connection that sends garbage, a length past the bound, an unsigned or wrongly signed hello, or
nothing within HANDSHAKE_S is logged and closed, and the leader keeps waiting for its followers
until its deadline: without the key, nobody can fail the group's start, take a follower's place or
read a frame.

The key: --group-key-file FILE (the same first line on every host, 16 characters or more). Without
one, a group whose coordinator is a loopback address uses <cache folder>/group-key, made once with
mode 0600 (one user's processes on one machine share it; other users cannot read it); any other
coordinator is refused without a key (config.py says so, naming the flag).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time

import msgspec

from ...config import ConfigError, EngineConfig
from .group_key import group_key
from .hosts import Challenge, Frame, Hello, Welcome, channel_address, pack, unpack

log = logging.getLogger("strata_jax.engine")

NONCE_BYTES = 32
# bytes a handshake frame (Challenge, Hello, Welcome, Loaded) may hold
HANDSHAKE_MAX = 4096
# how long a connection may take to say who it is (and the leader to answer)
HANDSHAKE_S = 5.0
# connections saying who they are at once; more are closed at once (a follower closed so tries
# again: only a flood of silent connections delays it)
HANDSHAKES_MAX = 256
# a follower's frame bound: the whole KV cache's bytes plus this (window inputs)
FRAME_SLACK = 64 << 20


class GroupLost(RuntimeError):
    """A process of the group is gone (or the group no longer agrees): it must restart as a
    whole."""


class FrameError(ValueError):
    """A frame that cannot be one: a length past the bound, or bytes that do not decode."""


class Refused(Exception):
    """Why a connection is not a follower (logged by the leader, which closes it and keeps
    waiting)."""


class NotLeader(Exception):
    """The process at the channel's address closed before its challenge (busy, or not ready): try
    again."""


# ---- frames on the wire --------------------------------------------------------------------------


def recv_frame(conn: socket.socket, limit: int) -> Frame | None:
    """One frame of at most `limit` bytes, or None when the peer closed. FrameError names a length
    past the bound (refused before a byte of it is read) or bytes that are not a frame."""
    head = exactly(conn, 8)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > limit:
        raise FrameError(f"a frame of {size} bytes, past the bound of {limit} bytes")
    body = exactly(conn, size)
    if body is None:
        return None
    try:
        return unpack(body)
    except msgspec.DecodeError as e:
        raise FrameError(f"{size} bytes that are not a frame ({e})") from None


def exactly(conn: socket.socket, n: int) -> bytes | None:
    """n bytes, or None when the peer closed (or the connection failed). A timeout set on conn
    raises."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = conn.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise
        except OSError:
            chunk = b""
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# ---- the handshake -------------------------------------------------------------------------------


def _mac(key: bytes, label: bytes, leader_nonce: bytes, hello: Hello) -> bytes:
    fields = msgspec.msgpack.encode([hello.process_id, hello.pid, hello.host, hello.digest,
                                     hello.nonce])
    return hmac.new(key, label + b"\0" + leader_nonce + fields, hashlib.sha256).digest()


def hello_mac(key: bytes, leader_nonce: bytes, hello: Hello) -> bytes:
    return _mac(key, b"strata-group-hello", leader_nonce, hello)


def welcome_mac(key: bytes, leader_nonce: bytes, hello: Hello) -> bytes:
    return _mac(key, b"strata-group-welcome", leader_nonce, hello)


def leader_handshake(conn: socket.socket, key: bytes) -> Hello:
    """The leader's side, on a connection with a timeout set: its Hello once it proved the key;
    Refused, naming why, for anything else."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        conn.sendall(pack(Challenge(nonce)))
        hello = recv_frame(conn, HANDSHAKE_MAX)
    except TimeoutError:
        raise Refused(f"it said nothing within {HANDSHAKE_S:g} s") from None
    except FrameError as e:
        raise Refused(f"it sent {e}") from None
    except OSError as e:
        raise Refused(f"its connection failed ({e})") from None
    if hello is None:
        raise Refused("it closed the connection before saying who it is")
    if not isinstance(hello, Hello):
        raise Refused(f"it sent a {type(hello).__name__} frame, not a hello")
    if not hmac.compare_digest(hello.mac, hello_mac(key, nonce, hello)):
        raise Refused(f"its hello (process {hello.process_id}, pid {hello.pid} on {hello.host!r}) "
                      "is not signed with the group key: a stranger, a replayed handshake, or a "
                      "process started with another --group-key-file")
    try:
        conn.sendall(pack(Welcome(welcome_mac(key, nonce, hello))))
    except OSError as e:
        raise Refused(f"its connection failed ({e})") from None
    return hello


def follower_handshake(conn: socket.socket, key: bytes, hello: Hello, where: str) -> None:
    """The follower's side: answer the challenge with `hello` signed, then check the leader's
    Welcome. NotLeader: closed before a challenge (try again); ConfigError: the two do not share the
    key."""
    conn.settimeout(HANDSHAKE_S)
    try:
        challenge = recv_frame(conn, HANDSHAKE_MAX)
        if not isinstance(challenge, Challenge):
            raise NotLeader(f"the process at {where} sent no challenge")
        signed = Hello(hello.process_id, hello.pid, hello.host, hello.digest,
                       secrets.token_bytes(NONCE_BYTES))
        signed.mac = hello_mac(key, challenge.nonce, signed)
        conn.sendall(pack(signed))
        welcome = recv_frame(conn, HANDSHAKE_MAX)
    except (TimeoutError, FrameError, OSError) as e:
        raise NotLeader(f"the process at {where} did not complete the handshake ({e})") from None
    if welcome is None:
        raise ConfigError(f"process 0 at {where} closed the channel after this process's hello: it "
                          "was refused (another group key: give every process the same "
                          "--group-key-file; process 0's log says why)")
    if not isinstance(welcome, Welcome) or not hmac.compare_digest(welcome.mac,
                                                                   welcome_mac(key, challenge.nonce,
                                                                               signed)):
        raise ConfigError(f"the process at {where} did not prove the group key: it is not this "
                          "group's process 0, or it was started with another --group-key-file")
    conn.settimeout(None)


# ---- the leader's door ---------------------------------------------------------------------------


class Gate:
    """Process 0's listening socket and the followers that proved the key, until the group forms.
    Made at the runner's start: it listens at once, and a thread of its own answers each
    connection's handshake as it comes (a follower says hello before loading, so one that dies
    loading is seen); `wait`, at the runner's end, returns every follower's connection and hello."""

    def __init__(self, cfg: EngineConfig, digest: str):
        self.n = cfg.num_processes
        self.digest = digest
        self.key = group_key(cfg)
        self.address = channel_address(cfg)
        # the coordinator's own address, not every interface: a group on 127.0.0.1 is not reachable
        # from outside
        try:
            family, _, _, _, where = socket.getaddrinfo(*self.address, type=socket.SOCK_STREAM)[0]
            self._sock = socket.socket(family)
            # SO_REUSEADDR: a restarted leader binds the port its predecessor's connections left in
            # TIME_WAIT
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(where)
        except OSError as e:
            raise ConfigError(f"coordinator = {cfg.coordinator}: process 0 cannot listen for its "
                              f"followers on port {self.address[1]} of {self.address[0]} (the "
                              f"coordinator's port + 1): {e.strerror or e}") from None
        self._sock.listen(64)
        self._sock.settimeout(0.5)              # the acceptor looks at `open` this often
        self._cond = threading.Condition()      # guards all below
        self.open = True
        self._joined: dict[int, tuple[socket.socket, Hello]] = {}
        # a follower with the key but other settings or model
        self._misconfigured: str | None = None
        self._refused: list[str] = []           # why connections were not followers (the last five)
        threading.Thread(target=self._acceptor, name="group-acceptor", daemon=True).start()

    def close(self) -> None:
        # the acceptor stops, and the listening socket closes
        self.open = False

    def _acceptor(self) -> None:
        """Every connection gets a handshake thread of its own (a silent stranger delays nobody), up
        to HANDSHAKES_MAX at once; the listening socket closes when the group has formed."""
        pending = threading.BoundedSemaphore(HANDSHAKES_MAX)
        with self._sock:
            while self.open:
                try:
                    conn, peer = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not pending.acquire(blocking=False):
                    self._refuse(conn, peer,
                                 f"{HANDSHAKES_MAX} connections were saying who they are already")
                    continue
                threading.Thread(target=self._handshake, args=(conn, peer, pending),
                                 name="group-handshake", daemon=True).start()

    def _handshake(self, conn: socket.socket, peer, pending: threading.BoundedSemaphore) -> None:
        try:
            conn.settimeout(HANDSHAKE_S)
            try:
                hello = leader_handshake(conn, self.key)
            except Refused as e:
                self._refuse(conn, peer, str(e))
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                if not self.open:
                    self._refuse(conn, peer,
                                 f"process {hello.process_id} came after the group had formed")
                elif not 1 <= hello.process_id < self.n:
                    self._refuse(conn, peer,
                                 f"process_id {hello.process_id} is not one of 1 to {self.n - 1}")
                elif hello.digest != self.digest:
                    conn.close()
                    self._misconfigured = (
                        f"process {hello.process_id} (pid {hello.pid} on {hello.host}) runs other "
                        "engine settings or another model than process 0: start every process with "
                        "the same model and flags (but --process-id)")
                else:
                    old = self._joined.pop(hello.process_id, None)
                    # its engine restarted while this one loads: the new connection
                    if old is not None:
                        old[0].close()
                    self._joined[hello.process_id] = (conn, hello)
                self._cond.notify_all()
        finally:
            pending.release()

    def _refuse(self, conn: socket.socket, peer, why: str) -> None:
        """A connection that is not a follower: said in the log, closed; the leader waits on."""
        shown = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        log.warning("process 0's group channel refused a connection from %s: %s", shown, why)
        with contextlib.suppress(OSError):
            conn.close()
        with self._cond:
            self._refused = [*self._refused[-4:], f"{shown}: {why}"]

    def wait(self, timeout: float) -> dict[int, tuple[socket.socket, Hello]]:
        """Every follower's connection and hello, once all came; then the door closes. ConfigError
        names a follower with the key but other flags or another model; GroupLost, the processes
        that never came (and the connections refused meanwhile)."""
        end = time.monotonic() + timeout
        with self._cond:
            while len(self._joined) < self.n - 1 and self._misconfigured is None:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self.open = False
            joined, refused = dict(self._joined), list(self._refused)
        if self._misconfigured is not None or len(joined) < self.n - 1:
            for conn, _ in joined.values():
                conn.close()
        if self._misconfigured is not None:
            raise ConfigError(self._misconfigured)
        if len(joined) < self.n - 1:
            missing = sorted(set(range(1, self.n)) - set(joined))
            raise GroupLost(f"process(es) {missing} did not connect to process 0 at "
                            f"{self.address[0]} port {self.address[1]} within {timeout:g} s"
                            + (f"; connections refused meanwhile: {'; '.join(refused)}" if refused
                               else ""))
        return joined
