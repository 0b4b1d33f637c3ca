"""The leader and its followers in lockstep (one model over processes: hosts.py).

Every call that runs a program over the group's mesh (a window, each KVCache move) must be made by
every process, in one order, with the same inputs. The leader (process 0) sends each such call to
every follower on a TCP channel (the coordinator's port + 1) before making it itself; a follower
replays the frames in the order they come (`follow`). The frames are the window's inputs (a few
int32 arrays a window: tokens, positions, slots, picks) and the KV moves' arguments; no logits or
tokens come back, because only the leader samples (its logits are its local replica of a replicated
output).

One owner each: the Leader owns the channel and the followers' liveness; the KVCache (here
LockstepKV, the leader's) still owns the arrays; the runner owns which program a window runs. A
follower that leaves (its socket closes: the process died) makes the group unusable, since the next
collective would fail or hang: the leader calls the `when_lost` hook with a message naming the
process (the worker exits with it as its ERR line, so the fault ledger names it, and the server
restarts the group), as it does when a window or a move fails.

Who may join, and the bounds on a frame: group_channel.py (a follower proves the group key before it
is one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import jax

from ...config import EngineConfig
from ..execute.executors import Forward, WholeWindows
from ..execute.kv_cache import KVCache
from .group_channel import (
    FRAME_SLACK,
    HANDSHAKE_MAX,
    FrameError,
    Gate,
    GroupLost,
    NotLeader,
    exactly,
    follower_handshake,
    group_key,
    recv_frame,
)
from .hosts import (
    JOIN_S,
    Arr,
    Frame,
    Hello,
    KvCopy,
    KvRead,
    KvReset,
    KvWrite,
    Loaded,
    Scratch,
    Window,
    channel_address,
    digest,
    group_devices,
    join,
    pack,
)

log = logging.getLogger("strata_jax.engine")


class Leader:
    """Process 0's side of the channel. Made at the runner's start (its Gate listens at once and
    answers each connection's handshake as it comes); `accept`, at the runner's end, takes every
    follower's hello (said once it has joined, before loading) and then its Loaded."""

    def __init__(self, cfg: EngineConfig, digest: str):
        self.n = cfg.num_processes
        # listening from now on; who may join: group_channel.py
        self.gate = Gate(cfg, digest)
        self.address = self.gate.address
        self.followers: dict[int, tuple[socket.socket, Hello]] = {}
        # one call at a time: sent and made in the same order
        self._lock = threading.RLock()
        self.lost: str | None = None            # why the group broke, once it has
        self._lost_event = threading.Event()
        self._on_lost: Callable[[str], None] | None = None
        self._closed = False
        self.frames = 0
        self.bytes = 0

    def accept(self, timeout: float = JOIN_S) -> None:
        """Every follower's hello (its settings must be the leader's), then its Loaded. A follower
        says hello as soon as it has joined, before loading, so one that dies while loading is named
        here at once. ConfigError names a follower with the key but other flags or another model;
        GroupLost, one that never came (and the connections refused meanwhile) or ended."""
        end = time.monotonic() + timeout
        self.followers = self.gate.wait(timeout)
        # each connected before loading; now its Loaded
        for conn, hello in self.followers.values():
            conn.settimeout(max(end - time.monotonic(), 0.01))
            try:
                loaded = recv_frame(conn, HANDSHAKE_MAX)
            except (TimeoutError, FrameError) as e:
                loaded = e
            conn.settimeout(None)
            if not isinstance(loaded, Loaded):
                self.close()
                raise GroupLost(f"process {hello.process_id} of the group (pid {hello.pid} on "
                                f"{hello.host}) "
                                + ("is gone: it ended while loading" if loaded is None else
                                   f"did not load within {timeout:g} s"
                                   if isinstance(loaded, TimeoutError) else
                                   f"sent something other than its Loaded ({loaded})"))
            log.info("process %d (pid %d on %s) follows", hello.process_id, hello.pid, hello.host)
            threading.Thread(target=self._watch, args=(conn, hello),
                             name=f"follower-{hello.process_id}", daemon=True).start()

    def when_lost(self, fn: Callable[[str], None]) -> None:
        """What to do when the group breaks (the worker: exit with the message). Called at once when
        it has."""
        self._on_lost = fn
        if self.lost is not None:
            fn(self.lost)

    def _watch(self, conn: socket.socket, hello: Hello) -> None:
        """A follower never sends after its hello: a read that ends means its process is gone."""
        with contextlib.suppress(OSError):
            exactly(conn, 1)
        self._lose(f"process {hello.process_id} of the group (pid {hello.pid} on {hello.host}) is "
                   "gone: its connection to process 0 closed")

    def close(self) -> None:
        """The engine closes: the followers' channels close (they end, and their loops start them
        again)."""
        self._closed = True
        self.gate.close()
        for conn, _ in self.followers.values():
            with contextlib.suppress(OSError):
                # not close() alone: the watcher's recv would keep it open
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def _lose(self, why: str) -> None:
        if self._closed:                    # our own close, not a follower's death
            return
        with contextlib.suppress(Exception):
            if self.lost is None:
                self.lost = why
                log.error("%s; the group restarts", why)
            self._lost_event.set()
        if self._on_lost is not None:
            self._on_lost(self.lost)

    def failed(self, e: BaseException) -> None:
        """A call failed on process 0. Its followers may have made it or not, so the group is
        broken: a follower's death shows as such a failure first (a collective's peer closed), so
        wait a moment for the watcher to name it, then report."""
        self._lost_event.wait(2.0)
        self._lose(self.lost
                   or f"a device call failed on process 0 of the group ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); the processes may "
                                "no longer agree")

    @contextlib.contextmanager
    def call(self, frame: Frame):
        """Send `frame` to every follower, then make the call (the with block) under the same
        lock."""
        with self._lock:
            if self.lost is not None:
                raise GroupLost(self.lost)
            data = pack(frame)
            for pid, (conn, hello) in list(self.followers.items()):
                try:
                    conn.sendall(data)
                except OSError as e:
                    self._lose(f"process {pid} of the group (pid {hello.pid} on {hello.host}) is "
                               f"gone: {e}")
                    raise GroupLost(self.lost) from e
            self.frames += 1
            self.bytes += len(data)
            try:
                yield
            except Exception as e:
                self.failed(e)
                raise

    def window(self, layout, args: list, run: Callable):
        """A window program: the followers are sent it, then run(layout, args) makes it here ->
        process 0's own replica of the replicated logits (sampled here alone: nothing comes back
        from the followers)."""
        with self.call(Window(layout.groups, layout.kv_len, [Arr.of(a) for a in args])):
            # waited for here: a collective's failure (a follower gone) surfaces when the result is
            # read, and must surface inside call(), which breaks the group, not in the engine's own
            # recovery after it
            return jax.block_until_ready([lg.addressable_data(0) for lg in run(layout, args)])

    def kv(self, *args, **kwargs) -> LockstepKV:
        return LockstepKV(self, *args, **kwargs)

    def stats(self) -> dict:
        return {"processes": self.n, "frames": self.frames, "bytes": self.bytes,
                "followers": {p: {"pid": h.pid, "host": h.host}
                              for p, (_, h) in self.followers.items()}}


class GroupWindows(WholeWindows):
    """--num-processes N: the leader's executor (executors.py). Each window is sent to the
    followers, then run here over the group's mesh (Leader.window); a follower runs the windows it
    is sent as WholeWindows."""

    # a window run ahead would reach the followers out of turn
    runs_ahead = False

    def __init__(self, leader: Leader, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.leader = leader

    def forward(self, groups: list, layout) -> Forward:
        hiddens = []

        def run(layout, args):
            logits, h = self.window(layout, args)
            hiddens.append(h)
            return logits
        logits = self.leader.window(layout, [a for g in groups for a in g.arrays()], run)
        return logits, hiddens[0] if hiddens else None

    def close(self) -> None:
        self.leader.close()


class LockstepKV(KVCache):
    """The leader's KVCache: each move that runs a program on the group's arrays goes to the
    followers too."""

    def __init__(self, leader: Leader, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._leader = leader

    def read(self, slot: int, start: int, size: int):
        with self._leader.call(KvRead(slot, start, size)):
            return super().read(slot, start, size)

    def write(self, slot: int, start: int, block: dict) -> None:
        with self._leader.call(KvWrite(slot, start, {k: Arr.of(v) for k, v in block.items()})):
            super().write(slot, start, block)

    def copy(self, src: int, dst: int, n_blocks: int, block: int) -> None:
        with self._leader.call(KvCopy(src, dst, n_blocks, block)):
            super().copy(src, dst, n_blocks, block)

    def reset(self) -> None:
        with self._leader.call(KvReset()):
            super().reset()

    @contextlib.contextmanager
    def scratch(self):
        with self._leader.call(Scratch(True)):
            cm = super().scratch()
            cm.__enter__()
        try:
            yield
        finally:
            with self._leader.call(Scratch(False)):
                cm.__exit__(None, None, None)


def over_processes(cfg: EngineConfig, spec) -> tuple[list, Leader | None]:
    """The runner's start over processes: join the group, its mesh's devices (hosts.py), and on
    process 0 the Leader (listening at once; it accepts the followers once the runner is built)."""
    join(cfg)
    devs = group_devices(cfg, spec)
    return devs, (Leader(cfg, digest(cfg, spec)) if cfg.process_id == 0 else None)


def hello(cfg: EngineConfig, digest: str, host: str) -> socket.socket:
    """A follower, once joined and before loading: connect to the leader and prove the group key
    (retried while process 0 is not listening yet, or closed before its challenge)."""
    leader_host, leader_port = channel_address(cfg)
    where = f"{leader_host} port {leader_port}"
    key = group_key(cfg)
    end = time.monotonic() + JOIN_S
    while True:
        conn = _connect(cfg, end)
        try:
            follower_handshake(conn, key, Hello(cfg.process_id, os.getpid(), host, digest), where)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except NotLeader as e:
            conn.close()
            if time.monotonic() > end:
                raise GroupLost(f"{e}, for {JOIN_S} s") from None
            time.sleep(0.5)
        except BaseException:
            conn.close()
            raise


def follow(runner, conn: socket.socket, cfg: EngineConfig) -> str:
    """A follower's life after loading: say so, then replay every frame in order. Returns why it
    ended (the leader closed the channel: its process stopped) or raises what a call raised."""
    conn.sendall(pack(Loaded()))
    log.info("process %d: following process 0 at %s:%d", cfg.process_id, *channel_address(cfg))
    # no call carries more than the whole KV cache (a slot file's restore) and a window's inputs
    limit = sum(a.nbytes for a in jax.tree_util.tree_leaves(runner.kv.arrays)) + FRAME_SLACK
    scratch: list = []
    n = 0
    while True:
        try:
            frame = recv_frame(conn, limit)
        except FrameError as e:
            raise GroupLost(f"process 0's channel sent {e} (a follower's bound: its KV cache's "
                            f"bytes + {FRAME_SLACK >> 20} MiB)") from None
        if frame is None:
            return f"process 0 closed the channel after {n} calls (its engine stopped)"
        n += 1
        match frame:
            case Window(groups=groups, kv_len=kv_len, args=args):
                from ..execute.programs import Layout

                runner.window(Layout(groups, kv_len), [a.array() for a in args])
            case KvRead(slot=slot, start=start, size=size):
                runner.kv.read(slot, start, size)
            case KvWrite(slot=slot, start=start, block=block):
                runner.kv.write(slot, start, {k: a.array() for k, a in block.items()})
            case KvCopy(src=src, dst=dst, n_blocks=nb, block=b):
                runner.kv.copy(src, dst, nb, b)
            case KvReset():
                runner.kv.reset()
            case Scratch(begin=True):
                cm = runner.kv.scratch()
                cm.__enter__()
                scratch.append(cm)
            case Scratch(begin=False):
                scratch.pop().__exit__(None, None, None)


def _connect(cfg: EngineConfig, end: float) -> socket.socket:
    """The leader's channel, retried while it is still starting (it listens from its runner's
    start)."""
    host, port = channel_address(cfg)
    while True:
        try:
            return socket.create_connection((host, port), timeout=10)
        except OSError:
            if time.monotonic() > end:
                raise GroupLost(f"process 0's channel at {host}:{port} did not answer in {JOIN_S} "
                                "s") from None
            time.sleep(0.2)

