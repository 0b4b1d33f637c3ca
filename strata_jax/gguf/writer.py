"""GGUF writing shared by the makers and the tools that copy a file: tensors at 64-byte
boundaries, and a copied `general.alignment` that pads what it says."""

from __future__ import annotations

from typing import Any

from gguf import GGUFValue, GGUFValueType, GGUFWriter, Keys

# Tensors start at 64-byte boundaries (GGUF's default is 32): XLA's CPU runtime uses a host array in
# place only there, so every tensor of a made file is read from its pages, never copied
# (model/weights.py in_place); llama.cpp reads general.alignment from every part
ALIGNMENT = 64


class AlignedWriter(GGUFWriter):
    """GGUFWriter with ALIGNMENT, said in every part of a split file (GGUFWriter keeps its keys in
    the first part only, but pads every part to its alignment)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_custom_alignment(ALIGNMENT)

    def add_shard_kv_data(self) -> None:
        super().add_shard_kv_data()
        for kv in self.kv_data[1:]:
            kv[Keys.General.ALIGNMENT] = GGUFValue(ALIGNMENT, GGUFValueType.UINT32)


def add_key(writer: GGUFWriter, key: str, value: Any, vtype: GGUFValueType,
            sub: GGUFValueType | None = None) -> None:
    """writer.add_key_value, except that a copied general.alignment also sets the writer's padding:
    a file that says 64 but is padded to GGUFWriter's 32 would be read at the wrong offsets."""
    if key == Keys.General.ALIGNMENT:
        writer.add_custom_alignment(int(value))
    else:
        writer.add_key_value(key, value, vtype, sub)
