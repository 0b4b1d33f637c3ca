"""Frames between the server and its engine process: msgpack maps, each behind a 4-byte big-endian length.

Server -> engine (`op`):  prepare {id, prompt, params, chat_template_kwargs} | submit {id, ids, params}
                          | cancel {id} | stats {id} | expert_profile {id, path} | shutdown
                          | tokenize {id, content, add_special, parse_special, with_pieces} | detokenize {id, tokens}
Engine -> server (`t`):   progress {stage, n, total, what} | ready {info} | prepared {id, ids, max_tokens, think}
                          | rejected {id, kind, message, ...} | ev {id, k, x, tok, fr, st, err, lp} | stats {id, stats}
                          | saved {id, path, routed} | answer {id, tokens | content} (tokens.py)
The first frame the server writes is the engine's start-up: {model, engine (EngineConfig as a dict)}.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

import msgspec

MAX_FRAME = 1 << 30
_HEADER = struct.Struct(">I")


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
_decoder = msgspec.msgpack.Decoder()


def pack(obj: Any) -> bytes:
    body = _encoder.encode(obj)
    return _HEADER.pack(len(body)) + body


def unpack(body: bytes) -> Any:
    return _decoder.decode(body)


def length(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes is beyond the limit of {MAX_FRAME}: the stream is corrupt")
    return n


def read_frame(f: BinaryIO) -> Any | None:
    """One frame from a blocking file; None at end of file."""
    header = _read_exact(f, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(f, length(header))
    return None if body is None else unpack(body)


def _read_exact(f: BinaryIO, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
