"""Real models' shapes for `strata-jax make-model --shape NAME`: random weights at the size of a
model people serve, to measure the expert tiers where the file tier is real (a model larger than
RAM).

Each shape is make_model options (the fields of the Hugging Face config, in make_model's names);
options given beside --shape override it (`--shape qwen3-30b-a3b --quant Q8_0 --experts 160`).
Only sizes and layout are the real model's: the weights are random, the tokenizer is the built-in
one padded to the real vocabulary, and the routing is random (uniform, or skewed with
--router-skew): neither is a real model's routing.
"""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B config.json: 30.5B parameters, 3.3B active; Q4_K ~17 GiB, Q8_0 ~30 GiB
    "qwen3-30b-a3b": {
        "arch": "qwen3moe", "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4,
        "head_dim": 128, "ffn": 6144, "experts": 128, "experts_used": 8, "expert_ffn": 768,
        "vocab": 151936, "context": 40960, "rope_theta": 1_000_000.0, "rms_eps": 1e-6,
        "quant": "Q4_K", "name": "random Qwen3-30B-A3B shape"},
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (families-spec.md 1.5): 48 layers, every 4th
    # gated attention, the rest Gated DeltaNet; 512 experts, top-10, and a gated shared expert;
    # one MTP layer. ~80B parameters; Q4_K ~45 GiB
    "qwen3-next-80b-a3b": {
        "arch": "qwen3next", "layers": 48, "hidden": 2048, "heads": 16, "kv_heads": 2,
        "head_dim": 256, "ffn": 5120, "experts": 512, "experts_used": 10, "expert_ffn": 512,
        "shared_ffn": 512, "vocab": 151936, "context": 262144, "rope_theta": 10_000_000.0,
        "rms_eps": 1e-6, "ssm_conv": 4, "ssm_k_heads": 16, "ssm_v_heads": 32,
        "ssm_head_dim": 128, "full_attention_interval": 4, "nextn": 1, "quant": "Q4_K",
        "name": "random Qwen3-Next-80B-A3B shape"},
}


def with_shape(shape: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """The options of `shape` with `options` over them (ValueError naming an unknown shape)."""
    if shape is None:
        return options
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is not one of {', '.join(SHAPES)}")
    return {**SHAPES[shape], **options}
