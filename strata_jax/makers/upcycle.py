"""Upcycle a dense llama GGUF into a mixture of experts: each FFN copied into E experts, plus a
router.

The router is random, the top-k router weights are renormalized to sum to one (llama's MoE does
that), and every expert is the same FFN, so the MoE model computes what the dense one does:
whichever experts a token picks, sum_k w_k * FFN(x) = FFN(x). A real model thus runs through the MoE
and expert-tier paths and still writes sense. The experts keep the dense FFN's quant blocks byte for
byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from strata_jax.gguf import GGUFModel
from strata_jax.gguf.writer import add_key

_FFN = {"ffn_gate": "ffn_gate_exps", "ffn_up": "ffn_up_exps", "ffn_down": "ffn_down_exps"}


def upcycle(src: str | Path, dst: str | Path, experts: int = 8, top_k: int = 2, seed: int = 0,
            router_std: float = 0.02) -> Path:
    if experts < 2 or not 1 <= top_k <= experts:
        raise ValueError(f"--experts {experts} --top-k {top_k}: need at least 2 experts and 1 <= "
                         "top-k <= experts")
    model = GGUFModel.open(src)
    spec = model.spec
    if spec.architecture != "llama" or spec.is_moe:
        raise ValueError(f"{src}: upcycle takes a dense llama model; this one is "
                         f"{spec.architecture}{' with experts' if spec.is_moe else ''}")
    arch = spec.architecture
    writer = GGUFWriter(dst, arch)
    for key, value in model.metadata.items():
        if key not in ("general.architecture", "general.name") and not key.startswith("split."):
            add_key(writer, key, value, *model.metadata_types[key])
    writer.add_key_value(f"{arch}.expert_count", experts, GGUFValueType.UINT32)
    writer.add_key_value(f"{arch}.expert_used_count", top_k, GGUFValueType.UINT32)
    writer.add_key_value(f"{arch}.expert_feed_forward_length", spec.ffn, GGUFValueType.UINT32)
    writer.add_key_value(f"{arch}.expert_weights_norm", True, GGUFValueType.BOOL)
    name = model.metadata.get("general.name", Path(src).stem)
    writer.add_key_value("general.name", f"{name} (upcycled {experts}x top-{top_k})",
                         GGUFValueType.STRING)

    rng = np.random.default_rng(seed)
    # name, byte shape, type, data
    plan: list[tuple[str, tuple[int, ...], GGMLQuantizationType, object]] = []
    for name, t in model.tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _FFN:
            blocks = t.data                                              # [rows, row_bytes]
            plan.append((f"blk.{parts[1]}.{_FFN[parts[2]]}.weight", (experts, *blocks.shape),
                         t.qtype, lambda b=blocks: np.broadcast_to(b, (experts, *b.shape))))
            if parts[2] == "ffn_gate":
                router = (rng.standard_normal((experts, spec.hidden))
                          * router_std).astype(np.float32)
                plan.append((f"blk.{parts[1]}.ffn_gate_inp.weight", (experts, spec.hidden * 4),
                             GGMLQuantizationType.F32, lambda r=router: r.view(np.uint8)))
        else:
            plan.append((name, t.data.shape, t.qtype, lambda d=t.data: d))
    # shapes in bytes: the writer derives the values' shape
    for name, byte_shape, qtype, _ in plan:
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                               raw_dtype=qtype)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(Path(dst))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, _, make in plan:
        writer.write_tensor_data(np.ascontiguousarray(make()))
    writer.close()
    return Path(dst)
