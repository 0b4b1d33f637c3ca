"""The deepseek2 family (DeepSeek-V2/V3/R1, Kimi K2) as ModelSpec reads it: Multi-head Latent
Attention's sizes (MlaSpec), its tensors, and the group-limited router's keys
(../shared/reference/families-spec.md 3; llama.cpp src/models/deepseek2.cpp).

The KV cache of an MLA model holds one entry a token and layer: the normalized latent c (kv_lora)
and the shared rope key (rope): so in the cache's terms the model has ONE kv head of
kv_lora + rope values (llama.cpp's attention.key_length), and its values (kv_lora,
attention.value_length) are a view of the keys' first kv_lora values, not stored
(ModelSpec.cached_value_dim). The per-head sizes of the decompressed attention are MlaSpec's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import MetadataError

MLA_ARCHITECTURES: tuple[str, ...] = ("deepseek2",)


@dataclass(frozen=True)
class MlaSpec:
    q_lora: int  # attention.q_lora_rank; 0: no q compression (DeepSeek-V2-Lite: attn_q)
    kv_lora: int  # attention.kv_lora_rank: the latent's width
    nope: int  # the per-head key part without rope (key_length_mla - rope)
    rope: int  # rope.dimension_count: the shared rope key's width
    v_head: int  # value_length_mla: a head's value width after decompression
    # rope.scaling.yarn_log_multiplier, the converter's x0.1 undone (mscale_all_dim); 0: none
    yarn_log_mul: float = 0.0
    legacy_kv_b: bool = False  # the file has attn_kv_b (split at load) instead of attn_k_b/v_b

    @property
    def qk_head(self) -> int:
        """A head's query/key width before absorption (nope + rope): the kq scale's 1/sqrt."""
        return self.nope + self.rope


def mla_fields(get, shapes: Mapping[str, tuple[int, ...]], n_heads: int,
               path) -> dict[str, Any]:
    """ModelSpec's fields for a deepseek2 file: the cache's view (one kv head of kv_lora + rope, a
    value view of kv_lora), the MlaSpec and the router's expert groups. A legacy file (no *_mla
    keys, attn_kv_b) gives the per-head sizes in key_length / value_length instead."""
    kv_lora = get.int("attention.kv_lora_rank")
    rope = get.int("rope.dimension_count")
    key_mla = get.int("attention.key_length_mla", 0)
    if key_mla:
        nope, v_head = key_mla - rope, get.int("attention.value_length_mla")
    else:
        nope, v_head = get.int("attention.key_length") - rope, get.int("attention.value_length")
    log_mul = get.float("rope.scaling.yarn_log_multiplier", 0.0) / 0.1
    mla = MlaSpec(q_lora=get.int("attention.q_lora_rank", 0), kv_lora=kv_lora, nope=nope,
                  rope=rope, v_head=v_head, yarn_log_mul=log_mul,
                  legacy_kv_b=any(n.endswith(".attn_kv_b.weight") for n in shapes))
    for name, value in (("kv_lora_rank", kv_lora), ("nope head size", nope),
                        ("value head size", v_head), ("rope dims", rope)):
        if value <= 0:
            raise MetadataError(path, f"deepseek2's {name} is {value}",
                                "The metadata cannot be right: re-convert the model")
    groups = get.int("expert_group_count", 1) or 1
    return {"n_kv_heads": 1, "head_dim": kv_lora + rope, "value_dim": kv_lora, "mla": mla,
            "expert_groups": groups,
            "expert_groups_used": get.int("expert_group_used_count", groups) or groups,
            "expert_bias": any(n.endswith(".exp_probs_b.bias") for n in shapes) if shapes
                           else True}


def mla_tensor_shapes(spec, b: str) -> Iterator[tuple[str, tuple[tuple[int, ...], bool]]]:
    """Block `b`'s (= "blk.N.") attention tensors, numpy order (GGUF's dims reversed)."""
    m, h, H = spec.mla, spec.hidden, spec.n_heads
    q = H * m.qk_head
    if m.q_lora:
        yield from {b + "attn_q_a.weight": ((m.q_lora, h), True),
                    b + "attn_q_a_norm.weight": ((m.q_lora,), True),
                    b + "attn_q_b.weight": ((q, m.q_lora), True)}.items()
    else:
        yield b + "attn_q.weight", ((q, h), True)
    yield from {b + "attn_kv_a_mqa.weight": ((m.kv_lora + m.rope, h), True),
                b + "attn_kv_a_norm.weight": ((m.kv_lora,), True),
                b + "attn_output.weight": ((h, H * m.v_head), True)}.items()
    if m.legacy_kv_b:
        yield b + "attn_kv_b.weight", ((H * (m.nope + m.v_head), m.kv_lora), True)
    else:
        yield from {b + "attn_k_b.weight": ((H, m.kv_lora, m.nope), True),
                    b + "attn_v_b.weight": ((H, m.v_head, m.kv_lora), True)}.items()


def check_mla(spec, bad) -> None:
    """deepseek2's own checks (bad(problem) -> the MetadataError to raise)."""
    g, used = spec.expert_groups, spec.expert_groups_used
    if spec.is_moe and (spec.n_experts % g or not 1 <= used <= g):
        raise bad(f"expert_group_count {g} must divide expert_count {spec.n_experts}, and "
                  f"expert_group_used_count {used} be 1..{g}")
    if spec.is_moe and spec.n_experts_used > used * (spec.n_experts // g):
        raise bad(f"expert_used_count {spec.n_experts_used} is more than the "
                  f"{used} x {spec.n_experts // g} experts of the groups kept")
    if spec.rope_scaling is not None and spec.rope_scaling.type not in ("yarn", "none"):
        raise bad(f"deepseek2 with rope scaling {spec.rope_scaling.type!r}: only YaRN is run")
