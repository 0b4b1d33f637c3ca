"""One model over several processes or hosts (--coordinator HOST:PORT --num-processes N --process-id
I): joining them, which devices the mesh takes, what is refused, and the frames between them (issue
19, item 2).

jax.distributed joins the processes. That is multi-controller JAX: each process drives only its own
devices, and a program over a mesh that spans processes runs only when every process calls it, in
the same order, with the same inputs. The experts split (devices.py) already runs a window as ONE
SPMD program over a 1-D mesh; here the mesh holds the first --devices devices of every process, so
each process holds E/(N·D) of every layer's experts and a psum over gloo (CPU) or NCCL (GPU) adds
the expert rows across processes.

Process 0 leads: its engine schedules, samples and serves HTTP. Every other process follows: it
loads the same weights (its part of the experts) and replays each device call the leader makes, in
the leader's order (lockstep.py). Only the leader's engine makes decisions, so nothing needs to be
agreed but the calls.
"""

from __future__ import annotations

import hashlib
import json
import logging

import msgspec
import numpy as np

from ...config import ConfigError, EngineConfig
from .group_key import group_key

log = logging.getLogger("strata_jax.engine")

# how long jax.distributed waits for every process to join (a restart's reload included)
JOIN_S = 300


def is_group(cfg: EngineConfig) -> bool:
    return cfg.num_processes > 1


def channel_address(cfg: EngineConfig) -> tuple[str, int]:
    """The leader's lockstep channel: the coordinator's host, its port + 1 (one address for users to
    give)."""
    host, _, port = cfg.coordinator.rpartition(":")
    return host.strip("[]"), int(port) + 1


def join(cfg: EngineConfig) -> None:
    """jax.distributed.initialize for this process, once, before JAX starts its backend (the worker
    calls it first thing; a restarted worker is a new process and joins afresh). Multi-process CPU
    collectives need gloo, chosen before initialize."""
    if not is_group(cfg):
        return
    import jax

    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("process %d of %d: joining the group at %s", cfg.process_id, cfg.num_processes,
             cfg.coordinator)
    # the coordinator listens on the address the processes were given, not on every interface ([::],
    # JAX's default): a coordinator at 127.0.0.1 cannot be reached from the network
    jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id,
                               initialization_timeout=JOIN_S,
                               coordinator_bind_address=cfg.coordinator if cfg.process_id == 0
                                                        else None)
    # the backend's start is a step of joining too (every process publishes its devices and waits
    # for the others'): done here, so no process waits on its channel for a leader still starting
    # its backend
    jax.devices()


def refusal(cfg: EngineConfig, spec) -> str | None:
    """Why this config cannot run over processes, or None. Pure (no JAX): the CLI refuses before
    starting."""
    if not spec.is_moe:
        return ("the model has no experts to split over processes (only --split experts spans "
                "processes)")
    if cfg.split == "layers":
        return ("split = layers: pipeline stages do not span processes yet; use --split experts "
                "(or auto)")
    if cfg.expert_cache != "auto":
        return (f"expert_cache = {cfg.expert_cache}: the expert tiers (a device arena fed by the "
                "host) do not combine with several processes")
    if cfg.kv_resident is not None:
        return (f"kv_resident = {cfg.kv_resident}: host-RAM KV does not combine with several "
                "processes")
    if cfg.spec > 0 and cfg.drafter != "ngram":
        return f"drafter = {cfg.drafter}: only the ngram drafter combines with several processes"
    total = cfg.num_processes * cfg.devices
    if spec.n_experts % total:
        return (f"the model's {spec.n_experts} experts do not divide over {cfg.num_processes} "
                f"processes x {cfg.devices} device(s) = {total} devices")
    return None


def refuse(cfg: EngineConfig, spec) -> None:
    why = refusal(cfg, spec) if is_group(cfg) else None
    if why:
        raise ConfigError(f"num_processes = {cfg.num_processes}: {why}")
    # an unreadable or short key file: refused now, not at each engine restart
    if is_group(cfg):
        group_key(cfg)


def group_devices(cfg: EngineConfig, spec) -> list:
    """The mesh's devices: the first cfg.devices of each process, process 0's first (ConfigError
    when a process has fewer, or what the config asks cannot span processes)."""
    import jax

    refuse(cfg, spec)
    mine: dict[int, list] = {}
    for d in jax.devices():
        mine.setdefault(d.process_index, []).append(d)
    for p in range(cfg.num_processes):
        if len(mine.get(p, [])) < cfg.devices:
            raise ConfigError(f"devices = {cfg.devices}: process {p} has {len(mine.get(p, []))} "
                              "device(s)")
    return [d for p in range(cfg.num_processes) for d in mine[p][:cfg.devices]]


def digest(cfg: EngineConfig, spec) -> str:
    """What every process must agree on: the engine settings (but the process's own number) and the
    model's shape. A follower started with other flags or another model is refused by the leader,
    naming it."""
    settings = {k: v for k, v in cfg.to_dict().items() if k not in ("process_id", "group_key_file")}
    text = json.dumps(settings, sort_keys=True, default=str) + repr(spec)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- the frames: leader -> follower (each device call), follower -> leader (hello) ---------------


class Arr(msgspec.Struct, array_like=True):
    """A numpy array on the wire."""
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, a) -> Arr:
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, a.shape, a.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, np.dtype(self.dtype)).reshape(self.shape)


class Frame(msgspec.Struct, tag_field="t", array_like=True):
    pass


class Challenge(Frame, tag="challenge"):
    """The leader's first frame on every connection: a fresh nonce the follower's hello must
    sign."""
    nonce: bytes


class Hello(Frame, tag="hello"):
    """A follower says who it is; mac: HMAC of both nonces and these fields under the group key
    (group_channel.py)."""
    process_id: int
    pid: int
    host: str
    digest: str
    nonce: bytes = b""
    mac: bytes = b""


class Welcome(Frame, tag="welcome"):
    """The leader's answer to a signed hello: its own HMAC, so the follower knows it holds the key
    too."""
    mac: bytes


class Loaded(Frame, tag="loaded"):
    """A follower's weights are loaded and its decode programs built: it replays from now on."""


class Window(Frame, tag="window"):
    """A window program: its layout (programs.Layout's fields) and its inputs after the weights and
    KV."""
    groups: tuple[tuple[int, int, bool, int], ...]
    kv_len: int
    args: list[Arr]


class KvRead(Frame, tag="kv_read"):
    slot: int
    start: int
    size: int


class KvWrite(Frame, tag="kv_write"):
    slot: int
    start: int
    block: dict[str, Arr]


class KvCopy(Frame, tag="kv_copy"):
    src: int
    dst: int
    n_blocks: int
    block: int


class KvReset(Frame, tag="kv_reset"):
    pass


class Scratch(Frame, tag="scratch"):
    """Engine.logits' blank cache: begin (True) or put the slots' own back (False)."""
    begin: bool


AnyFrame = (Challenge | Hello | Welcome | Loaded | Window | KvRead | KvWrite | KvCopy | KvReset
            | Scratch)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyFrame)


def pack(frame: Frame) -> bytes:
    body = _encoder.encode(frame)
    return len(body).to_bytes(8, "big") + body


def unpack(body: bytes) -> AnyFrame:
    return _decoder.decode(body)
