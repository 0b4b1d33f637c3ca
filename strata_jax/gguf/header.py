"""One GGUF file's header: its metadata and its tensor directory, parsed from a memory map.

Only the header is touched; tensor data stays on disk until someone reads a tensor. We parse the
header ourselves (the format is small: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
rather than with `gguf.GGUFReader` because that reader builds a numpy view per array element
(seconds for a 150k-token vocabulary) and raises bare ValueErrors/IndexErrors on broken files; here
every failure is a `GGUFError` naming the file and what was being read (the key, the array item, the
tensor).

A header may come from anywhere, so every size it claims is checked before anything that size is
built: against what the rest of the file can hold (an array of 2**62 items in a 1 KB file is refused
at once) and against the bounds below, far above what real models hold, so that a hostile file costs
at most about half a GB of Python objects (three arrays of 4M numbers, measured) and about a second
of parsing. Nesting is bounded too: no RecursionError.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from .errors import GGUFError, HeaderLimitError, NotGGUFError, TruncatedGGUFError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# ---- bounds on what a header may claim (each comment: why it is far from what real models need)
# Arrays within arrays: llama.cpp writes flat arrays of numbers or strings only; gguf-py could nest
# them.
MAX_ARRAY_DEPTH = 4
# Items in one array: the longest real arrays, a vocabulary's tokens (262,144 for Gemma 3) and
# merges (~450K for o200k-style vocabularies), are under a tenth of it.
MAX_ARRAY_ITEMS = 1 << 22
# One string value: the longest real ones, chat templates, are tens of KB.
MAX_STRING_BYTES = 16 << 20
# One string inside an array: tokens and merges are at most a few hundred bytes (the tokenizer holds
# tokens given to it as a dict to the same bound: vocab.MAX_TOKEN_BYTES).
MAX_ARRAY_STRING_BYTES = 64 << 10
# The whole key-value section: a 256K-token vocabulary with its merges, scores and types is ~15 MB.
# This is what caps the Python objects a header makes (at most ~8 per byte of file: about half a
# GB).
MAX_METADATA_BYTES = 64 << 20
# Keys: real files have tens to a few hundred.
MAX_METADATA_KEYS = 1 << 16
# A key or a tensor name: the GGUF spec's bound for keys (ggml's for tensor names is 63 bytes).
MAX_NAME_BYTES = (1 << 16) - 1
# Tensors in one file: the largest MoE models hold a few thousand (even with experts stored one
# tensor each, as old Mixtral files did, 8x22B holds under 2,000).
MAX_TENSORS = 1 << 16
# A tensor's values (the product of its dimensions): ggml counts them in int64.
MAX_ELEMENTS = (1 << 63) - 1

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_TYPES = {int(t): t for t in GGUFValueType}
# The fewest bytes a value of each type takes: what an array's count is checked against before
# reading it.
_MIN_BYTES = {t: struct.calcsize("<" + f) for t, f in _SCALARS.items()} | {
    GGUFValueType.STRING: 8,    # its length
    GGUFValueType.ARRAY: 12,    # its element type and count
}
_MIN_KV_BYTES = 8 + 4 + 1         # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dimension count, one dimension, type, offset
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

_STRING_WHY = {
    MAX_STRING_BYTES: "chat templates, the longest real strings, are tens of KB",
    MAX_ARRAY_STRING_BYTES: "tokens and merges are at most a few hundred bytes",
    MAX_NAME_BYTES: "the GGUF spec's bound for keys",
}
_CORRUPT = "The file is corrupt, or made to break GGUF readers: re-download or re-convert the model"
_FETCH_AGAIN = "The download or copy did not finish: fetch the file again"

# A value's GGUF type: (type, element type for arrays or None). Kept so metadata can be written back
# as is.
ValueType = tuple[GGUFValueType, GGUFValueType | None]


@dataclass(frozen=True)
class RawTensor:
    """A tensor directory entry as stored: ggml dims (fastest first) and offset from the data
    start."""

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


class _Cursor:
    """Reads the header front to back. Every read is checked against `end`: the end of the file, or
    while reading metadata, MAX_METADATA_BYTES past its start. `where` arguments name what is read,
    for errors."""

    def __init__(self, path: Path, buf: memoryview):
        self.path = path
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.end = self.size

    def take(self, n: int, where: str) -> int:
        """Advance over n bytes and return where they start."""
        start = self.pos
        if start + n > self.end:
            raise self._past_end(where, start + n)
        self.pos = start + n
        return start

    def _past_end(self, where: str, needed: int) -> GGUFError:
        if needed <= self.size:  # inside the file: past the metadata's bound
            return HeaderLimitError(self.path, f"{where}: the metadata runs past "
                                               f"{MAX_METADATA_BYTES:,} bytes, strata-jax's bound "
                                               "(real models hold under 20 MB)", _CORRUPT)
        return TruncatedGGUFError(self.path, f"truncated: the header is cut short in {where} (it "
                                             f"needs at least {needed:,} bytes, the file has "
                                             f"{self.size:,})", _FETCH_AGAIN)

    def u32(self, where: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, where))[0]

    def u64(self, where: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, where))[0]

    def scalar(self, fmt: str, where: str) -> Any:
        return struct.unpack_from("<" + fmt, self.buf,
                                  self.take(struct.calcsize("<" + fmt), where))[0]

    def vtype(self, where: str) -> GGUFValueType:
        number = self.u32(where)
        vtype = _TYPES.get(number)
        if vtype is None:
            raise GGUFError(self.path,
                            f"{where}: value type {number} is not a GGUF type (0 to {max(_TYPES)})",
                            _CORRUPT)
        return vtype

    def check_count(self, where: str, claim: str, n: int, min_bytes: int, limit: int,
                    why: str) -> None:
        """Refuse a claim of n things of at least min_bytes each that cannot fit in what is left of
        the file or of the metadata's bound, or that is beyond `limit` (`why`: what real files
        hold)."""
        need, file_left = n * min_bytes, self.size - self.pos
        if need > file_left:
            if n <= limit:  # a plausible size: the file was cut short
                raise TruncatedGGUFError(self.path, "truncated: the header is cut short in "
                                                    f"{where}: {claim} cannot fit in the "
                                                    f"{file_left:,} bytes left (the file has "
                                                    f"{self.size:,})", _FETCH_AGAIN)
            raise HeaderLimitError(self.path, f"{where}: {claim} cannot fit in the {file_left:,} "
                                              "bytes left in the file", _CORRUPT)
        if need > self.end - self.pos:
            raise self._past_end(f"{where} ({claim})", self.pos + need)
        if n > limit:
            raise HeaderLimitError(self.path, f"{where}: {claim}, more than the {limit:,} "
                                              f"strata-jax reads ({why})",
                                   _CORRUPT)

    def string(self, where: str, limit: int) -> str:
        n = self.u64(where)
        self.check_count(where, f"a string of {n:,} bytes", n, 1, limit, _STRING_WHY[limit])
        start = self.take(n, where)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(self.path,
                            f"{where}: the string at byte {start:,} is not UTF-8 ({e.reason})",
                            _CORRUPT) from None

    def strings(self, n: int, where: str) -> list[str]:
        """n strings of an array: one tight loop, as vocabularies hold hundreds of thousands.
        Anything amiss is read again by `string`, which says what."""
        buf, pos, end, unpack = self.buf, self.pos, self.end, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(n):
            if pos + 8 <= end:
                length = unpack(buf, pos)[0]
                stop = pos + 8 + length
                if length <= MAX_ARRAY_STRING_BYTES and stop <= end:
                    try:
                        append(str(buf[pos + 8:stop], "utf-8"))
                        pos = stop
                        continue
                    except UnicodeDecodeError:
                        pass
            self.pos = pos
            append(self.string(f"{where}[{i}]", MAX_ARRAY_STRING_BYTES))  # raises, saying why
            pos = self.pos
        self.pos = pos
        return out

    def value(self, vtype: GGUFValueType, where: str) -> Any:
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.scalar(fmt, where)
        if vtype == GGUFValueType.STRING:
            return self.string(where, MAX_STRING_BYTES)
        return self.array(where, depth=1)[0]

    def array(self, where: str, depth: int) -> tuple[list[Any], GGUFValueType]:
        if depth > MAX_ARRAY_DEPTH:  # checked before reading on: nesting cannot recurse without end
            raise HeaderLimitError(self.path, f"{where}: arrays nested more than {MAX_ARRAY_DEPTH} "
                                              "deep (llama.cpp writes no nested arrays)", _CORRUPT)
        sub = self.vtype(f"{where} (its element type)")
        n = self.u64(where)
        self.check_count(where, f"an array of {n:,} items", n, _MIN_BYTES[sub], MAX_ARRAY_ITEMS,
                         "a vocabulary's tokens and merges, the longest real arrays, hold under 1M")
        fmt = _SCALARS.get(sub)
        if fmt is not None:  # numbers: one numpy read, not n struct calls
            start = self.take(_MIN_BYTES[sub] * n, where)
            return (np.frombuffer(self.buf, dtype=np.dtype("<" + fmt), count=n,
                                  offset=start).tolist(), sub)
        if sub == GGUFValueType.STRING:
            return self.strings(n, where), sub
        return [self.array(f"{where}[{i}]", depth + 1)[0] for i in range(n)], sub


def parse_header(path: Path, buf: memoryview) -> Header:
    """Parse the header in `buf` (the whole file, memory-mapped). Raises a `GGUFError` naming
    `path`."""
    size = len(buf)
    if size < 4 or buf[:4].tobytes() != MAGIC:
        found = buf[:4].tobytes() if size else b""
        raise NotGGUFError(path, f"not a GGUF file (it starts with {found!r}, a GGUF file starts "
                                 f"with {MAGIC!r})",
                           "Give the path of a .gguf model file")
    cur = _Cursor(path, buf)
    cur.take(4, "the magic")
    version = _read_version(cur)
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata key count")
    metadata, types = _read_metadata(cur, n_kv)
    cur.check_count("the tensor directory", f"{n_tensors:,} tensors", n_tensors, _MIN_TENSOR_BYTES,
                    MAX_TENSORS, "the largest models hold a few thousand")
    tensors = [_read_tensor(cur, i) for i in range(n_tensors)]

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(path, f"general.alignment is {alignment!r}, not a power of two",
                        "The file is corrupt: re-convert it")
    data_start = -(-cur.pos // alignment) * alignment
    return Header(path, version, metadata, types, tensors, alignment, data_start, size)


def _read_version(cur: _Cursor) -> int:
    version = cur.u32("the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            raise NotGGUFError(cur.path, "a big-endian GGUF file, which strata-jax does not read",
                               "Convert it to little-endian with gguf-py's gguf_convert_endian.py")
        raise NotGGUFError(cur.path,
                           f"GGUF version {version}; strata-jax reads versions {VERSIONS}",
                           "Re-convert the model with a recent llama.cpp")
    return version


def _read_metadata(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, ValueType]]:
    cur.check_count("the metadata", f"{n_kv:,} keys", n_kv, _MIN_KV_BYTES, MAX_METADATA_KEYS,
                    "real files have a few hundred at most")
    cur.end = min(cur.size, cur.pos + MAX_METADATA_BYTES)
    metadata: dict[str, Any] = {}
    types: dict[str, ValueType] = {}
    for i in range(n_kv):
        at = cur.pos
        key = cur.string(f"metadata key number {i + 1:,} (at byte {at:,})", MAX_NAME_BYTES)
        where = f"metadata key {_show(key)}"
        vtype = cur.vtype(where)
        if vtype == GGUFValueType.ARRAY:
            value, sub = cur.array(where, depth=1)
            types[key] = (vtype, sub)
        else:
            value = cur.value(vtype, where)
            types[key] = (vtype, None)
        if key in metadata:
            raise GGUFError(cur.path, f"{where} appears twice (second at byte {at:,})",
                            "The file is corrupt: re-download or re-convert it")
        metadata[key] = value
    cur.end = cur.size
    return metadata, types


def _read_tensor(cur: _Cursor, i: int) -> RawTensor:
    name = cur.string(f"the name of tensor number {i + 1:,}", MAX_NAME_BYTES)
    where = f"tensor {_show(name)}"
    n_dims = cur.u32(where)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(cur.path, f"{where} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})",
                        "The file is corrupt: re-download or re-convert it")
    ne = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.take(8 * n_dims, where))
    if min(ne) == 0 or math.prod(ne) > MAX_ELEMENTS:  # ggml itself divides by each dimension
        raise GGUFError(cur.path, f"{where} has dimensions {list(ne)}: each must be at least 1 and "
                                  f"their product at most {MAX_ELEMENTS:,} (ggml counts values in "
                                  "int64)",
                        "The file is corrupt: re-download or re-convert it")
    ggml_type = cur.u32(where)
    offset = cur.u64(where)
    return RawTensor(name, ggml_type, tuple(ne), offset)


def _show(name: str) -> str:
    """A key or tensor name for a message: quoted, and cut if a hostile file made it long."""
    return repr(name) if len(name) <= 100 else repr(name[:100]) + f"... ({len(name):,} characters)"
