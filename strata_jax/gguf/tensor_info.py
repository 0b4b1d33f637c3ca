"""One tensor of a GGUF file, its bytes left in place (reader.py makes them; legacy.py rewrites old
layouts' tensors as views of them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gq


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor, its bytes left where they are in the file.

    `shape` is numpy order (ggml's ne reversed): token_embd is (vocab, hidden), ffn_up_exps is
    (experts, expert_ffn, hidden). `data` is a read-only uint8 memmap view [*shape[:-1], row_bytes]:
    each row is the GGUF blocks of one row of values.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    offset: int  # absolute, in `path`
    path: Path
    data: np.ndarray = field(repr=False)

    @property
    def n_values(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        return self.data.shape[-1]

    def dequantize(self) -> np.ndarray:
        """The values as float32 [*shape] (with the gguf package's reference code: for checks, not
        speed)."""
        return np.asarray(gq.dequantize(self.data, self.qtype),
                          dtype=np.float32).reshape(self.shape)
