"""Open a GGUF model (one file, or all parts of a split one) with its tensors memory-mapped in
place.

    model = GGUFModel.open("Qwen3-30B-A3B-Q4_K_M-00001-of-00003.gguf")   # any part finds the others
    model.metadata["general.architecture"]      # plain Python values, merged over the parts
    t = model.tensors["blk.0.ffn_up_exps.weight"]
    t.qtype, t.shape, t.data                     # GGMLQuantizationType, numpy-order shape, uint8 memmap view
    model.spec                                   # ModelSpec: the numbers a model family needs

Opening reads only the headers: tensor bytes are pages of the file that the OS reads when touched.
"""  # noqa: E501

from __future__ import annotations

import itertools
import math
import re
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quant_types import SUPPORTED, block_size, supported_names, type_size

from .errors import (
    GGUFError,
    MissingSplitPartError,
    MissingTensorError,
    NotGGUFError,
    SplitMismatchError,
    TensorSizeError,
    TruncatedGGUFError,
    UnsupportedTensorTypeError,
)
from .header import Header, RawTensor, ValueType, parse_header
from .legacy import read_as_today
from .spec import ModelSpec
from .tensor_info import TensorInfo

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


class GGUFModel:
    """A GGUF model: metadata, tensors (memory-mapped), and the parts it came from."""

    def __init__(self, paths: tuple[Path, ...], metadata: dict[str, Any],
                 metadata_types: dict[str, ValueType], tensors: dict[str, TensorInfo]):
        self.paths = paths
        self.metadata = metadata
        self.metadata_types = metadata_types  # key -> (GGUFValueType, element type of arrays)
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path, *, strict: bool = True) -> GGUFModel:
        """Open `path`, or the split model it is one part of (then every part is found and checked).

        Always checked: the GGUF magic and version, the header, every tensor's bytes lie inside its
        file, are aligned, do not overlap, and are whole blocks; split parts are all there and
        agree. With `strict` (the default) also: every tensor type is one the kernels handle, the
        architecture is supported, and the tensors a model family needs are there with the shapes
        its metadata implies (that builds `spec`). `strict=False` is for tools that describe any
        GGUF (`strata-jax inspect`).
        """
        paths = split_part_paths(Path(path))
        headers = [_read_header(p) for p in paths]
        _check_split(paths, headers)
        metadata = dict(headers[0].metadata)
        types = dict(headers[0].types)
        # llama.cpp's gguf-split keeps all metadata in part 1; keep any extra keys
        for h in headers[1:]:
            for key, value in h.metadata.items():
                if key not in metadata and not key.startswith("split."):
                    metadata[key] = value
                    types[key] = h.types[key]
        tensors: dict[str, TensorInfo] = {}
        for h in headers:
            for t in _tensor_infos(h, strict=strict):
                if t.name in tensors:
                    other = tensors[t.name].path
                    raise SplitMismatchError(h.path, f"tensor {t.name!r} appears twice" + (
                        "" if other == h.path else f" (it is also in {other.name})"),
                        "The file is corrupt, or the parts come from different models: fetch it "
                        "again")
                tensors[t.name] = t
        model = cls(tuple(paths), metadata, types, read_as_today(metadata, tensors))
        tensors = model.tensors
        if strict:
            if not tensors:
                raise MissingTensorError(paths[0],
                                         "the file holds no tensors (a vocabulary-only GGUF?)",
                                         "Read its tokenizer with strata_jax.gguf.load_tokenizer, "
                                         "or give a model file")
            model.spec.check_tensors({name: (t.shape, t.path) for name, t in tensors.items()},
                                     paths[0])
        return model

    @cached_property
    def spec(self) -> ModelSpec:
        """The model's hyper-parameters (raises UnsupportedArchitectureError/MetadataError if it has
        none)."""
        return ModelSpec.from_metadata(self.metadata, {n: t.shape for n, t in self.tensors.items()},
                                       path=self.paths[0])

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def n_bytes(self) -> int:
        """Bytes of tensor data over all parts."""
        return sum(t.n_bytes for t in self.tensors.values())

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    def __repr__(self) -> str:
        return (f"GGUFModel({self.paths[0].name!r}, parts={len(self.paths)}, "
                f"tensors={len(self.tensors)})")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a GGUF file (or of a split model: part 1's, where llama.cpp keeps it),
    without checking tensors or the architecture. Works on vocabulary-only files (llama.cpp's
    ggml-vocab-*.gguf)."""
    path = Path(path)
    paths = split_part_paths(path)
    return _read_header(paths[0]).metadata


def split_part_paths(path: Path) -> list[Path]:
    """All parts of the split model `path` belongs to (by llama.cpp's NAME-0000i-of-0000N.gguf
    naming), in order; just [path] for a one-file model. Raises MissingSplitPartError naming the
    parts not there."""
    m = SPLIT_NAME.match(path.name)
    if not m or int(m["count"]) <= 1:
        if not path.is_file():
            raise GGUFError(path, "no such file", "Check the path")
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise MissingSplitPartError(
            path, f"part {paths.index(missing[0]) + 1} of {count} of this split model is missing: "
                  f"{missing[0]} ({len(missing)} of {count} parts missing: "
                  f"{', '.join(p.name for p in missing)})",
            "Put all parts in one folder (or merge them with llama.cpp's gguf-split --merge)")
    return paths


def _read_header(path: Path) -> Header:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise GGUFError(path, f"cannot read it ({e.strerror})",
                        "Check the path and its permissions") from None
    if size == 0:
        raise NotGGUFError(path, "not a GGUF file (it is empty)",
                           "Give the path of a .gguf model file")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    try:
        header = parse_header(path, buf)
    finally:
        buf.release()
    header.memmap = data  # the tensor views below are slices of this map
    return header


def _check_split(paths: list[Path], headers: list[Header]) -> None:
    # compared and added below: a string or a list there must be an error, not a TypeError
    for h in headers:
        for key in SPLIT_KEYS:
            value = h.metadata.get(key)
            if (value is not None
                    and (not isinstance(value, int) or isinstance(value, bool) or value < 0)):
                raise GGUFError(h.path,
                                f"metadata key {key!r} is {str(value)[:100]!r}, not a count",
                                "The file is corrupt: re-download or re-convert it")
    first = headers[0].metadata
    count = first.get("split.count", 1)
    if len(paths) == 1:
        if count > 1:
            raise MissingSplitPartError(
                paths[0], f"this is part {first.get('split.no', 0) + 1} of a {count}-part split "
                          "model, but its name does not say which (llama.cpp names parts "
                          "NAME-00001-of-0000N.gguf)",
                "Rename the parts to that pattern, or merge them with llama.cpp's gguf-split "
                "--merge")
        return
    expected_tensors = first.get("split.tensors.count")
    for i, h in enumerate(headers):
        no, n = h.metadata.get("split.no"), h.metadata.get("split.count")
        if no != i or n != len(paths):
            raise SplitMismatchError(
                h.path, f"its split metadata says part {no if no is None else no + 1} of {n}, "
                        f"its name says part {i + 1} of {len(paths)}",
                "The parts come from different splits: fetch the model again")
    total = sum(len(h.tensors) for h in headers)
    if expected_tensors is not None and total != expected_tensors:
        raise SplitMismatchError(paths[0], f"split.tensors.count is {expected_tensors} but the "
                                           f"{len(paths)} parts hold {total} tensors",
                                           "Fetch the model again")


def _tensor_infos(h: Header, *, strict: bool) -> list[TensorInfo]:
    infos = []
    for raw in h.tensors:
        qtype = _qtype(h.path, raw, strict=strict)
        bs, ts = block_size(qtype), type_size(qtype)
        shape = tuple(int(d) for d in reversed(raw.ne))
        if raw.ne[0] % bs:
            raise TensorSizeError(h.path, f"tensor {raw.name!r} has rows of {raw.ne[0]} values, "
                                          f"not a whole number of {qtype.name} blocks of {bs}",
                                          "The file is corrupt: re-convert it")
        row_bytes = raw.ne[0] // bs * ts
        n_bytes = math.prod(shape[:-1]) * row_bytes  # Python ints: corrupt dims must not overflow
        start = h.data_start + raw.offset
        if raw.offset % h.alignment:
            raise GGUFError(h.path, f"tensor {raw.name!r} starts at data offset {raw.offset}, not "
                                    f"a multiple of the alignment {h.alignment}",
                                    "The file is corrupt: re-convert it")
        if start + n_bytes > h.file_size:
            raise TruncatedGGUFError(
                h.path, f"truncated: tensor {raw.name!r} ({qtype.name} {list(shape)}) needs bytes "
                        f"{start:,}..{start + n_bytes:,} but the file has only {h.file_size:,} "
                        "bytes",
                "The download or copy did not finish: fetch the file again")
        data = h.memmap[start:start + n_bytes].reshape(*shape[:-1], row_bytes)
        infos.append(TensorInfo(raw.name, qtype, shape, n_bytes, start, h.path, data))
    _check_overlaps(h, infos)
    return infos


def _qtype(path: Path, raw: RawTensor, *, strict: bool) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(raw.ggml_type)
        GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedTensorTypeError(
            path,
            f"tensor {raw.name!r} has type number {raw.ggml_type}, unknown to the gguf package",
            f"Use a model quantized to one of: {supported_names()}") from None
    if strict and qtype not in SUPPORTED:
        raise UnsupportedTensorTypeError(
            path, f"tensor {raw.name!r} is stored as {qtype.name}, which strata-jax's kernels do "
                  "not handle",
            f"Use a model quantized to one of: {supported_names()}")
    return qtype


def _check_overlaps(h: Header, infos: list[TensorInfo]) -> None:
    ordered = sorted(infos, key=lambda t: t.offset)
    for a, b in itertools.pairwise(ordered):
        if a.offset + a.n_bytes > b.offset:
            raise TensorSizeError(
                h.path, f"tensor {a.name!r} has shape {list(a.shape)} of {a.qtype.name}, which "
                        f"needs {a.n_bytes:,} bytes, but only {b.offset - a.offset:,} bytes lie "
                        f"before the next tensor ({b.name!r}): its size does not match its shape",
                        "The file is corrupt: re-convert it")
