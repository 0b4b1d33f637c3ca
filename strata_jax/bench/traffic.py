"""Weight bytes one decode step reads for one sequence, and the tokens/s bound that memory bandwidth
sets.

A decode step of one sequence reads every weight once (dense) or the top-k experts' share of the
expert weights (MoE), plus one row of the embedding table. The bytes depend on how the weights are
kept: GGUF blocks (what llama.cpp reads, and our engine in `weights="blocks"` mode), or float copies
made at load (`weights="dequantized"`: 4 bytes a weight in float32). Norms, biases and routers are
float32 in both (model/load.py). KV cache reads are left out: at the short contexts the bench
decodes at they are small next to the weights (SmolLM2 at position 100: 2.3 MB of KV against 81 MB
of Q4_1 weights).
"""

from __future__ import annotations

from strata_jax.gguf import GGUFModel

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _always_float(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))


def bytes_per_token(model: GGUFModel, weights: str = "blocks", dtype: str = "float32") -> dict:
    """`weights`: "blocks" (GGUF block bytes) or "dequantized" (float `dtype` copies). Returns the
    bytes a decode step of one sequence reads, the part of them that is expert weights, and the
    model's total."""
    spec = model.spec
    used = spec.n_experts_used / spec.n_experts if spec.n_experts else 1.0
    read = experts = total = 0.0
    for name, t in model.tensors.items():
        if _always_float(name, t.shape):
            size = 4 * t.n_values
        elif weights == "dequantized":
            size = _ITEMSIZE[dtype] * t.n_values
        else:
            size = t.n_bytes
        total += size
        if name == "token_embd.weight":
            step = size / t.shape[0]                     # one row is gathered
            if spec.tied_output:
                # and the output projection reads the whole table
                step += size
        elif "_exps." in name:
            step = size * used
            experts += step
        else:
            step = size
        read += step
    return {"bytes_per_token": read, "expert_bytes_per_token": experts, "weight_bytes": total,
            "weights": weights, "dtype": dtype if weights == "dequantized" else None,
            "experts_used": f"{spec.n_experts_used} of {spec.n_experts}" if spec.n_experts
                            else None}


def bound(bandwidth: float, traffic: dict, reached: float | None) -> dict:
    tps = bandwidth / traffic["bytes_per_token"]
    return {**traffic, "tokens_per_second": tps, "reached": reached,
            "fraction": reached / tps if reached else None}
