"""Other layouts of a family's tensors, read as the one the engine knows.

Any MoE file converted with `convert_hf_to_gguf.py --fuse-gate-up-exps` holds each layer's expert
gate and up projections as one `blk.N.ffn_gate_up_exps.weight` [experts, 2 x ffn, hidden], gate rows
first (llama.cpp's build_moe_ffn splits its product the same way). `split_gate_up_exps` makes
ffn_gate_exps and ffn_up_exps of it as views of the same mapped file (no copy): each expert's half
is whole rows, contiguous in the file, so the expert tiers read an expert's gate or up blocks from
it as from a split file.

qwen3next files converted before llama.cpp split the Gated DeltaNet input projection keep it as one
`blk.N.ssm_in.weight` [qkvz, hidden] in transformers' `in_proj_qkvz` order: per k-head group g the
rows [q_g (dk), k_g (dk), v_g (r x dv), z_g (r x dv)], r = v-heads / k-heads (llama.cpp reads it on
its "legacy (slower) path", src/models/qwen3next.cpp). Today's files hold the same rows as
`attn_qkv` [all q | all k | all v] and `attn_gate` [all z]. A row is whole GGUF blocks whatever the
type, so the two are made here by gathering ssm_in's rows (a copy in RAM, once, at open): the rest
of the engine sees one layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:                     # reader.py calls this module
    from .tensor_info import TensorInfo


def read_as_today(metadata: dict[str, Any],
                  tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """`tensors` with every layout this module knows turned into the engine's (the same dict if none
    applies)."""
    return split_gate_up_exps(split_ssm_in(metadata, tensors))


def split_gate_up_exps(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """Each fused ffn_gate_up_exps [E, 2f, h] as ffn_gate_exps and ffn_up_exps [E, f, h] views (gate
    first)."""
    fused = [n for n, t in tensors.items()
             if n.endswith(".ffn_gate_up_exps.weight") and len(t.shape) == 3
             and t.shape[1] % 2 == 0]
    if not fused:
        return tensors
    out = dict(tensors)
    for name in fused:
        t, b = tensors[name], name[:-len("ffn_gate_up_exps.weight")]
        if b + "ffn_gate_exps.weight" in tensors or b + "ffn_up_exps.weight" in tensors:
            continue
        f = t.shape[1] // 2
        del out[name]
        for part, rows in (("ffn_gate_exps.weight", slice(0, f)),
                           ("ffn_up_exps.weight", slice(f, 2 * f))):
            data = t.data[:, rows]
            out[b + part] = replace(t, name=b + part, shape=(t.shape[0], f, t.shape[2]),
                                    n_bytes=data.nbytes, data=data)
    return out


def split_ssm_in(metadata: dict[str, Any], tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """`tensors` with every qwen3next layer's legacy ssm_in replaced by attn_qkv and attn_gate
    (unchanged for any other file). The head counts come from the metadata (ssm.group_count,
    .time_step_rank, .state_size); a ssm_in whose rows do not match them is left for the tensor
    check to name."""
    arch = metadata.get("general.architecture")
    if arch != "qwen3next" or not any(n.endswith(".ssm_in.weight") for n in tensors):
        return tensors
    try:
        hk, hv, d = (int(metadata[f"{arch}.ssm.{k}"])
                     for k in ("group_count", "time_step_rank", "state_size"))
    except (KeyError, TypeError, ValueError):
        return tensors                       # the metadata check names the missing key
    if hk <= 0 or hv % hk:
        return tensors
    r = hv // hk
    group = 2 * d + 2 * r * d                # one k-head's rows: q, k, v x r, z x r
    at = [g * group for g in range(hk)]
    qkv_rows = np.concatenate([np.arange(a, a + d) for a in at]
                              + [np.arange(a + d, a + 2 * d) for a in at]
                              + [np.arange(a + 2 * d, a + 2 * d + r * d) for a in at])
    z_rows = np.concatenate([np.arange(a + 2 * d + r * d, a + group) for a in at])
    out = dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(".ssm_in.weight") or len(t.shape) != 2 or t.shape[0] != hk * group:
            continue
        b = name[:-len("ssm_in.weight")]
        if b + "attn_qkv.weight" in tensors:
            continue
        del out[name]
        out[b + "attn_qkv.weight"] = _rows(t, b + "attn_qkv.weight", qkv_rows)
        out[b + "attn_gate.weight"] = _rows(t, b + "attn_gate.weight", z_rows)
    return out


def _rows(t: TensorInfo, name: str, rows: np.ndarray) -> TensorInfo:
    data = np.ascontiguousarray(t.data[rows])
    return replace(t, name=name, shape=(len(rows), t.shape[1]), n_bytes=data.nbytes, data=data)
