"""Frames between the server and its engine process: msgspec structs sent as msgpack maps, each
behind a 4-byte big-endian length.

The first frame the server writes is the engine's start-up, `Start` (untagged). After it:

Server -> engine, `Command`s, tagged by "op":
    submit {id, ids, sampling, progress, cache_salt, checkpoint_at} (serve/prompts.py made it) |
        cancel {id} | stats {id} | expert_profile {id, path} | shutdown
    tokenize {id, content, add_special, parse_special, with_pieces} | detokenize {id, tokens}
        (tokens.py)
    slot {id, action, slot, path} | embed {id, inputs, pooling, normalize}
Engine -> server, `Reply`s, tagged by "t":
    progress {stage, n, total} | ready {info} | beat {stuck_s, compiling, loop}
    rejected {id, kind, message, ...}: a command refused (a submit whose grammar cannot compile)
    ev {id, event}: the engine's own Event (engine/request.py), so the engine's events and the
        server's are one type
    stats {id, stats} | saved {id, path, routed} | answer {id, tokens | content | slot |
        embeddings}

Each side decodes with a decoder typed by the union it reads, so a frame that is not one of these
(an unknown tag, a field of the wrong type, a field too many) is a FrameError naming the frame and
the field, raised where the frame is read, never a KeyError later. A request's sampling parameters
are the engine's own `SamplingParams` (a dataclass msgspec reads and writes), built and checked
once, by the server (serve/prompts.py); no `dict[str, Any]` of a request crosses the pipe.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, BinaryIO, Literal, Union

import msgspec

from ..engine.request import Event, SamplingParams

MAX_FRAME = 1 << 30
_HEADER = struct.Struct(">I")


class Start(msgspec.Struct, forbid_unknown_fields=True):
    """The engine process's start-up: the model file, EngineConfig as a dict,
    --chat-template(-file)'s text."""
    model: str
    engine: dict[str, Any]
    chat_template: str | None = None


# ---- server -> engine ----------------------------------------------------------------------------


class Command(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True):
    """What the server asks of the engine process; every command but shutdown has the id its answer
    names."""


class Submit(Command, tag="submit"):
    """A request as the server prepared it (serve/prompts.py): its prompt's token ids and its
    sampling parameters, checked there (the context too); the engine compiles its grammar, if any,
    and runs it (a grammar it cannot compile: Rejected, kind "invalid")."""
    id: str
    ids: list[int]
    sampling: SamplingParams
    progress: bool = False                      # prompt progress events (return_progress)
    cache_salt: str | None = None
    # a hybrid family's chat: its turn's end (engine/prompt.py turn_end)
    checkpoint_at: int | None = None


class Cancel(Command, tag="cancel"):
    id: str


class GetStats(Command, tag="stats"):
    id: str


class SaveExpertProfile(Command, tag="expert_profile"):
    id: str
    # in the server's --expert-profile-dir, never a request's path
    path: str


class Shutdown(Command, tag="shutdown"):
    pass


class Tokenize(Command, tag="tokenize"):
    id: str
    content: str | list[str | int]
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    # the most ids it may answer (--max-tokenize-ids; 0: any)
    max_ids: int = 0


class Detokenize(Command, tag="detokenize"):
    id: str
    tokens: list[int]
    # the most bytes of text it may answer (--max-tokenize-bytes)
    max_bytes: int = 0


class Embed(Command, tag="embed"):
    """Embeddings (engine/execute/embeddings.py) of texts (tokenized with special tokens) or token
    lists."""
    id: str
    # a text, token ids, or llama.cpp's mix of texts and ids
    inputs: list[str | list[int | str]]
    pooling: str                                # the server's --pooling
    normalize: int = 2                          # llama.cpp's embd_normalize


class SlotAction(Command, tag="slot"):
    """llama.cpp's /slots/N?action=...; path: a file in the server's --slot-save-path (None to
    erase)."""
    id: str
    action: Literal["save", "restore", "erase"]
    slot: int
    path: str | None = None


# ---- engine -> server ----------------------------------------------------------------------------


class Reply(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, omit_defaults=True):
    """What the engine process sends: its start (progress, ready), its heartbeat, answers to
    commands by id, and each request's events."""


class Progress(Reply, tag="progress"):
    """A progress bar of the engine's start (loading weights, building programs)."""
    stage: str
    n: int
    total: int


class Ready(Reply, tag="ready"):
    # what /props, /v1/models and the console show (worker.py: ready_info)
    info: dict[str, Any]


class Beat(Reply, tag="beat"):
    """The heartbeat (worker.py: Worker.heartbeat): seconds since the engine loop last began a
    turn."""
    stuck_s: float
    compiling: bool
    loop: Literal["none", "alive", "ended"]


class Rejected(Reply, tag="rejected"):
    """A command the engine refuses; tickets.rejection makes it the API's error. kind "context"
    fills in the three counts, "invalid" (a 400) and "too_large" (a 413: an answer beyond a bound)
    may name the request's field (param); "server" messages are made to be shown, "internal" ones
    are logged, never echoed."""
    id: str
    kind: Literal["context", "template", "invalid", "too_large", "server", "internal"]
    message: str
    param: str | None = None
    n_prompt_tokens: int | None = None
    max_tokens: int | None = None
    n_ctx: int | None = None

    # (decoding too: a frame without them is a FrameError)
    def __post_init__(self) -> None:
        if self.kind == "context" and None in (self.n_prompt_tokens, self.max_tokens, self.n_ctx):
            raise ValueError("a context rejection names n_prompt_tokens, max_tokens and n_ctx")


class EventFrame(Reply, tag="ev"):
    """One of a request's events, as the engine made it (with its server-side logprobs filled
    in)."""
    id: str
    event: Event


class Stats(Reply, tag="stats"):
    id: str
    stats: dict[str, Any]                       # Engine.stats()


class Saved(Reply, tag="saved"):
    """The expert profile written (Engine.save_expert_profile)."""
    id: str
    path: str
    routed: int


class Answer(Reply, tag="answer"):
    """A quick question's answer: tokenize's tokens, detokenize's content, a slot action's result
    (engine/slot_files.py), embed's vectors."""
    id: str
    tokens: list[Any] | None = None             # [id, ...] or [{"id", "piece"}, ...] (with_pieces)
    content: str | None = None
    slot: dict[str, Any] | None = None
    # embed's: a vector an input ([T][h] each with pooling none)
    embeddings: list[Any] | None = None
    n_tokens: list[int] | None = None           # embed's: the tokens each input read


AnyCommand = Union[Submit, Cancel, GetStats, SaveExpertProfile, Shutdown, Tokenize,  # noqa: UP007
                   Detokenize, SlotAction, Embed]
AnyReply = Union[Progress, Ready, Beat, Rejected, EventFrame, Stats, Saved, Answer]  # noqa: UP007


# ---- the wire ------------------------------------------------------------------------------------


class FrameError(ValueError):
    """A frame that is none of the protocol's: says which frame (its tag, and its id when it has
    one) and what is wrong with it (msgspec's words, which name the field: "Expected `int`, got
    `str` - at `$.ids[0]`")."""

    def __init__(self, message: str, tag: str | None = None, rid: str | None = None):
        super().__init__(message)
        self.tag, self.id = tag, rid


def _enc_hook(obj: Any) -> Any:
    # numpy scalars and arrays in engine stats
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_untyped = msgspec.msgpack.Decoder()


class _Frames:
    """A typed decoder for one direction: `what` says whose frames they are, for the error."""

    def __init__(self, kind: Any, what: str, tag_field: str | None):
        self._decoder = msgspec.msgpack.Decoder(kind)
        self.what, self.tag_field = what, tag_field
        members = getattr(kind, "__args__", (kind,))
        self.tags = {m.__struct_config__.tag for m in members} if tag_field else set()

    def __call__(self, body: bytes) -> Any:
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as e:
            raise self._error(body, str(e)) from None
        except msgspec.DecodeError as e:
            raise FrameError(f"a frame {self.what} that is not msgpack: {e}") from None

    def _error(self, body: bytes, why: str) -> FrameError:
        # it decoded as msgpack, only not as one of our frames
        raw = _untyped.decode(body)
        if not isinstance(raw, dict):
            return FrameError(f"a frame {self.what} that is a {type(raw).__name__}, not a map: "
                              f"{why}")
        rid = raw.get("id") if isinstance(raw.get("id"), str) else None
        if self.tag_field is None:
            return FrameError(f"the start-up frame {self.what} is malformed: {why}", None, rid)
        tag = raw.get(self.tag_field)
        if tag not in self.tags:
            return FrameError(f"an unknown frame {self.what}: {self.tag_field} = {tag!r} (known: "
                              f"{', '.join(sorted(self.tags))})", None, rid)
        return FrameError(f"a malformed {tag!r} frame {self.what}: {why}", tag, rid)


decode_start = _Frames(Start, "from the server", None)
decode_command = _Frames(AnyCommand, "from the server", "op")
decode_reply = _Frames(AnyReply, "from the engine", "t")


def pack(frame: Start | Command | Reply) -> bytes:
    body = _encoder.encode(frame)
    return _HEADER.pack(len(body)) + body


def length(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes is beyond the limit of {MAX_FRAME}: the stream is "
                         "corrupt")
    return n


def read_frame(f: BinaryIO, decode: Callable[[bytes], Any]) -> Any | None:
    """One frame from a blocking file, decoded by `decode` (decode_start, decode_command); None at
    end of file. A malformed frame raises FrameError after its bytes are read, so the stream stays
    in step."""
    header = _read_exact(f, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(f, length(header))
    return None if body is None else decode(body)


def _read_exact(f: BinaryIO, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
