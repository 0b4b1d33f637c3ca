"""GGUF quant types: names, block geometry and the lookup tables some of them need.

Block geometry comes from the gguf package (`GGML_QUANT_SIZES`) and the IQ tables from its reference
implementation (`gguf.quants`), so that our kernels and the oracle read the same constants.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

QType = GGMLQuantizationType

# The types the kernels handle, in the order the issue lists them.
SUPPORTED: tuple[QType, ...] = tuple(
    QType[name]
    for name in (
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "MXFP4",
    )
)

QK_K = 256


class UnsupportedQuantType(ValueError):
    """A tensor type the kernels do not handle (the message names it and lists the supported
    ones)."""


def as_qtype(qtype: QType | str | int) -> QType:
    """Accept a `GGMLQuantizationType`, its name ("IQ4_XS", any case) or its number."""
    if isinstance(qtype, QType):
        t = qtype
    elif isinstance(qtype, str):
        try:
            t = QType[qtype.upper()]
        except KeyError:
            raise UnsupportedQuantType(f"unknown quant type {qtype!r}; supported: "
                                       f"{supported_names()}") from None
    else:
        try:
            t = QType(int(qtype))
        except ValueError:
            raise UnsupportedQuantType(f"unknown quant type number {qtype!r}; supported: "
                                       f"{supported_names()}") from None
    if t not in SUPPORTED:
        raise UnsupportedQuantType(f"quant type {t.name} is not supported by the kernels; "
                                   f"supported: {supported_names()}")
    return t


def supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED)


def block_size(qtype: QType) -> int:
    """Values in one block."""
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: QType) -> int:
    """Bytes in one block."""
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: QType, n_values: int) -> int:
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n_values % bs:
        raise ValueError(f"{qtype.name} stores values in blocks of {bs}; a row of {n_values} "
                         "values is not a whole number of blocks")
    return n_values // bs * ts


@cache
def table(name: str) -> np.ndarray:
    """Lookup tables of the IQ types, as flat arrays the kernels index.

    grid tables are [entries * width] float32 (width 8 for IQ2_*, 4 for IQ3_*), `ksigns` is [128]
    int32 (7 sign bits -> 8 with even parity), `kvalues` is [16] float32 (IQ4's non-linear levels),
    `mxfp4` is [16] float32 (MXFP4's e2m1 values, doubled: 0, 1, 2, 3, 4, 6, 8, 12 and their
    negatives).
    """
    if name == "ksigns":
        return np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int32)
    if name == "kvalues":
        return np.array(gq.IQ4_NL.kvalues, dtype=np.float32)
    if name == "mxfp4":
        return np.array(gq.MXFP4.kvalues, dtype=np.float32)
    cls = {"iq2xxs": gq.IQ2_XXS, "iq2xs": gq.IQ2_XS, "iq2s": gq.IQ2_S, "iq3xxs": gq.IQ3_XXS,
           "iq3s": gq.IQ3_S}[name]
    cls.init_grid()
    return np.ascontiguousarray(cls.grid, dtype=np.float32).reshape(-1)


# The tables each type's body looks up (passed to Pallas kernels as inputs, in this order).
TABLES: dict[QType, tuple[str, ...]] = {
    QType.IQ4_NL: ("kvalues",),
    QType.IQ4_XS: ("kvalues",),
    QType.IQ3_XXS: ("iq3xxs", "ksigns"),
    QType.IQ3_S: ("iq3s",),
    QType.IQ2_XXS: ("iq2xxs", "ksigns"),
    QType.IQ2_XS: ("iq2xs", "ksigns"),
    QType.IQ2_S: ("iq2s",),
    QType.MXFP4: ("mxfp4",),
}
