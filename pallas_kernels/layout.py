"""How a row of a GGUF tensor splits into the blocks a dequant body works on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quant_types import TABLES, QType, as_qtype, block_size, type_size

from .bodies import BODIES, FLOAT_BODIES, FLOAT_BYTES

# A quant type's name with this suffix ("Q4_1+packed"): the weight's bytes are in the cpu kernels'
# packed layout (cpu/packed.h: 8 rows' blocks interleaved, made at load for --cpu-math int8), read
# by no other path.
PACKED_SUFFIX = "+packed"


@dataclass(frozen=True)
class Layout:
    qtype: QType
    values: int            # values in one body block (a power of two: Triton needs one)
    nbytes: int            # bytes in one body block
    body: Callable
    tables: tuple[str, ...]
    packed: bool = False   # the bytes are in cpu/packed.h's layout, not GGUF rows

    def blocks_in(self, row_bytes: int) -> int:
        if row_bytes % self.nbytes:
            raise ValueError(f"{self.qtype.name}: a row of {row_bytes} bytes is not a whole number "
                             f"of {self.nbytes}-byte blocks")
        return row_bytes // self.nbytes


def layout_for(qtype, row_bytes: int) -> Layout:
    """The body-block layout of `qtype` for rows of `row_bytes` bytes.

    Plain float types have no blocks in GGUF; they are cut into runs of up to 32 values (the largest
    power of two dividing the row) so that the same machinery handles them. A name ending in
    PACKED_SUFFIX gives its type's layout with `packed` set.
    """
    if isinstance(qtype, str) and qtype.endswith(PACKED_SUFFIX):
        lay = layout_for(qtype[:-len(PACKED_SUFFIX)], row_bytes)
        return Layout(lay.qtype, lay.values, lay.nbytes, lay.body, lay.tables, packed=True)
    qtype = as_qtype(qtype)
    if qtype in FLOAT_BODIES:
        per = FLOAT_BYTES[qtype]
        if row_bytes % per:
            raise ValueError(f"{qtype.name}: a row of {row_bytes} bytes is not a whole number of "
                             "values")
        n = 32
        while (row_bytes // per) % n:
            n //= 2
        return Layout(qtype, n, n * per, FLOAT_BODIES[qtype](n), ())
    return Layout(qtype, block_size(qtype), type_size(qtype), BODIES[qtype], TABLES.get(qtype, ()))
