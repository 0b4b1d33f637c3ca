"""One GGUF file's header: its metadata and its tensor directory, parsed from a memory map.

Only the header is touched; tensor data stays on disk until someone reads a tensor. We parse the header
ourselves (the format is small: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) rather than
with `gguf.GGUFReader` because that reader builds a numpy view per array element (seconds for a 150k-token
vocabulary) and raises bare ValueErrors/IndexErrors on broken files; here every failure is a `GGUFError`
naming the file and the offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from .errors import GGUFError, NotGGUFError, TruncatedGGUFError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}

# A value's GGUF type: (type, element type for arrays or None). Kept so metadata can be written back as is.
ValueType = tuple[GGUFValueType, GGUFValueType | None]


@dataclass(frozen=True)
class RawTensor:
    """A tensor directory entry as stored: ggml dims (fastest first) and offset from the data start."""

    name: str
    ggml_type: int
    ne: tuple[int, ...]
    offset: int


@dataclass
class Header:
    path: Path
    version: int
    metadata: dict[str, Any]
    types: dict[str, ValueType]
    tensors: list[RawTensor]
    alignment: int
    data_start: int  # absolute offset of the tensor data section
    file_size: int
    memmap: np.ndarray | None = None  # the whole file, uint8; tensor views are slices of it


class _Short(Exception):
    """Raised inside the parser when a read runs past the end of the file."""

    def __init__(self, needed: int):
        self.needed = needed


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        """Advance over n bytes and return where they start."""
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise _Short(start + n)
        self.pos = start + n
        return start

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.buf, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        start = self.take(n)
        return self.buf[start:start + n].tobytes().decode("utf-8")

    def value(self, vtype: GGUFValueType) -> Any:
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.scalar(fmt)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()[0]
        raise ValueError(f"unknown metadata value type {int(vtype)}")

    def array(self) -> tuple[list[Any], GGUFValueType]:
        sub = GGUFValueType(self.scalar("I"))
        n = self.scalar("Q")
        fmt = _SCALARS.get(sub)
        if fmt is not None:  # numbers: one numpy read, not n struct calls
            size = struct.calcsize(fmt) * n
            start = self.take(size)
            return np.frombuffer(self.buf, dtype=np.dtype("<" + fmt), count=n, offset=start).tolist(), sub
        return [self.value(sub) for _ in range(n)], sub


def parse_header(path: Path, buf: memoryview) -> Header:
    """Parse the header in `buf` (the whole file, memory-mapped). Raises a `GGUFError` naming `path`."""
    size = len(buf)
    if size < 4 or buf[:4].tobytes() != MAGIC:
        found = buf[:4].tobytes() if size else b""
        raise NotGGUFError(path, f"not a GGUF file (it starts with {found!r}, a GGUF file starts with {MAGIC!r})",
                           "Give the path of a .gguf model file")
    cur = _Cursor(buf)
    cur.take(4)
    try:
        version = cur.scalar("I")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in VERSIONS:
                raise NotGGUFError(path, "a big-endian GGUF file, which strata-jax does not read",
                                   "Convert it to little-endian with gguf-py's gguf_convert_endian.py")
            raise NotGGUFError(path, f"GGUF version {version}; strata-jax reads versions {VERSIONS}",
                               "Re-convert the model with a recent llama.cpp")
        n_tensors = cur.scalar("Q")
        n_kv = cur.scalar("Q")
        metadata: dict[str, Any] = {}
        types: dict[str, ValueType] = {}
        for _ in range(n_kv):
            at = cur.pos
            key = cur.string()
            vtype = GGUFValueType(cur.scalar("I"))
            if vtype == GGUFValueType.ARRAY:
                value, sub = cur.array()
                types[key] = (vtype, sub)
            else:
                value = cur.value(vtype)
                types[key] = (vtype, None)
            if key in metadata:
                raise GGUFError(path, f"metadata key {key!r} appears twice (second at byte {at})",
                                "The file is corrupt: re-download or re-convert it")
            metadata[key] = value
        tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(path, f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})",
                                "The file is corrupt: re-download or re-convert it")
            ne = struct.unpack_from(f"<{n_dims}Q", buf, cur.take(8 * n_dims))
            ggml_type = cur.scalar("I")
            offset = cur.scalar("Q")
            tensors.append(RawTensor(name, ggml_type, tuple(ne), offset))
    except _Short as short:
        raise TruncatedGGUFError(
            path, f"truncated: the header is cut short (it needs at least {short.needed:,} bytes, "
                  f"the file has {size:,})",
            "The download or copy did not finish: fetch the file again") from None
    except UnicodeDecodeError as e:
        raise GGUFError(path, f"a string in the header near byte {cur.pos:,} is not UTF-8 ({e.reason})",
                        "The file is corrupt: re-download or re-convert it") from None
    except ValueError as e:  # an unknown value type number
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(path, f"unreadable header near byte {cur.pos:,}: {e}",
                        "The file is corrupt: re-download or re-convert it") from None

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(path, f"general.alignment is {alignment!r}, not a power of two",
                        "The file is corrupt: re-convert it")
    data_start = -(-cur.pos // alignment) * alignment
    return Header(path, version, metadata, types, tensors, alignment, data_start, size)
