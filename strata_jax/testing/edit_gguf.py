"""Copy a GGUF with changes, to make the broken or unusual files that error paths are tested with.

    rewrite_gguf(good, bad, set_metadata={"general.architecture": "gptneox"})
    rewrite_gguf(good, bad, tensor_shapes={"blk.0.attn_q.weight": (128, 64)})   # declared shape
        only
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from quant_types import block_size, type_size
from strata_jax.gguf import GGUFModel
from strata_jax.gguf.writer import add_key


def rewrite_gguf(src: str | Path, dst: str | Path, *, set_metadata: Mapping[str, Any] | None = None,
                 drop_metadata: Iterable[str] = (), drop_tensors: Iterable[str] = (),
                 tensor_shapes: Mapping[str, tuple[int, ...]] | None = None,
                 tensor_values: Mapping[str, np.ndarray] | None = None,
                 add_tensors: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write `src` (one file, any types) to `dst` with metadata keys set or dropped, tensors
    dropped, tensors' declared shapes changed (numpy order; their bytes stay as they were), or F32
    tensors' values replaced (tensor_values: name -> float32 array of the tensor's shape), or new
    F32 tensors added after the others (add_tensors: name -> float32 array). A new key's type is
    inferred (str, bool, int as UINT32, float as FLOAT32, a non-empty list as an array of its first
    item's type); an existing key keeps its type."""
    model = GGUFModel.open(src, strict=False)
    metadata = {k: v for k, v in model.metadata.items() if k not in set(drop_metadata)}
    types = dict(model.metadata_types)
    for key, value in (set_metadata or {}).items():
        metadata[key] = value
        if key not in types:
            types[key] = (GGUFValueType.ARRAY,
                          _infer(value[0])) if isinstance(value, list) and value else \
                (_infer(value), None)
    writer = GGUFWriter(dst, metadata["general.architecture"])
    for key, value in metadata.items():
        if key != "general.architecture":
            add_key(writer, key, value, *types[key])
    shapes, dropped = dict(tensor_shapes or {}), set(drop_tensors)
    values = dict(tensor_values or {})
    for name, t in model.tensors.items():
        if name in values:
            if t.qtype != GGMLQuantizationType.F32 or tuple(values[name].shape) != tuple(t.shape):
                raise ValueError(f"{name}: only an F32 tensor's values are replaced, by an array "
                                 f"of shape {t.shape}")
            writer.add_tensor(name, np.ascontiguousarray(values.pop(name), np.float32))
            continue
        if name not in dropped:
            shape = shapes.get(name, t.shape)  # the writer takes uint8 data's shape in bytes
            byte_shape = (*shape[:-1], shape[-1] // block_size(t.qtype) * type_size(t.qtype))
            writer.add_tensor(name, np.ascontiguousarray(t.data), raw_shape=byte_shape,
                              raw_dtype=t.qtype)
    for name, value in (add_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def _infer(value: Any) -> GGUFValueType:
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    raise TypeError(f"cannot infer a GGUF type for {value!r}")
