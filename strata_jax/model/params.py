"""A decoder layer's weights as typed pytrees: which parts a layer has is a field that is set or
None, not a string key to look for, so a family's differences (q/k/v biases, q/k norms, experts in
place of the FFN, a shared expert, an expert-choosing bias) read as `lp.router is not None`.

Every class is a dataclass pytree (flattened in C++, see weights.QTensor) whose fields are all data:
a None field is an empty subtree, so a program's inputs hold only the parts a layer has, and two
layers with the same parts and shapes share one program (engine/execute/stepped.py groups them by
tree structure).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import jax

from .weights import Weight

# the routed experts' names in `LayerWeights.experts`
EXPERT_TENSORS = ("exp_gate", "exp_up", "exp_down")


def _pytree(cls):
    return jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in fields(cls)],
                                            meta_fields=[])


@_pytree
@dataclass(frozen=True)
class Mlp:
    """SwiGLU, down(silu(gate x) * up x): a dense layer's FFN, or a MoE layer's shared expert.
    gate_inp [h]: qwen2moe's sigmoid gate on the shared expert's output (ffn_gate_inp_shexp), else
    None."""
    gate: Weight
    up: Weight
    down: Weight
    gate_inp: jax.Array | None = None


@_pytree
@dataclass(frozen=True)
class Router:
    """A MoE layer's expert choice: weight [E, h] float32 (not transposed: see load.py); bias [E]:
    GLM-4.5's exp_probs_b, added to the scores to choose only, else None."""
    weight: jax.Array
    bias: jax.Array | None = None
    # gpt-oss's ffn_gate_inp.bias [E]: added to the logits themselves (choice and weights)
    logit_bias: jax.Array | None = None


@_pytree
@dataclass(frozen=True)
class ExpertBiases:
    """gpt-oss's per-expert biases (ffn_{gate,up,down}_exps.bias), float32: gate and up [E, f], down
    [E, h]. Small, so they stay on the device with the layer's other resident weights and are read
    by each row's true expert id, wherever the expert's matrices are (all on the device, or an
    arena slot): they need not travel with the matrices. A layer with them runs the clamped SwiGLU
    (model/gpt_oss.py)."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array


@_pytree
@dataclass(frozen=True)
class ExpertSide:
    """What a MoE layer's expert stages (model/stages.py: the expert tiers) read besides the routed
    experts' matrices: the shared expert (or None) and gpt-oss's expert biases (or None), both
    resident on the device."""
    shared: Mlp | None = None
    biases: ExpertBiases | None = None


@_pytree
@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. Attention: attn_norm, wq, wk, wv, wo, and where the family has them the
    q/k/v biases (qwen2*, glm4moe) and per-head q/k norms (qwen3*). Then ffn_norm and either `mlp`
    (a dense layer) or `router` with `experts` (EXPERT_TENSORS -> [E, n, k] each; None while the
    expert tiers hold them) and an optional `shared` expert."""
    attn_norm: jax.Array
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    ffn_norm: jax.Array
    bq: jax.Array | None = None
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    mlp: Mlp | None = None
    router: Router | None = None
    experts: dict[str, Weight] | None = None
    shared: Mlp | None = None
    # gpt-oss: attn_output's bias [h], the sink logit a head [H] (attn_sinks), a sliding-window
    # layer's window (int32 scalar; None: a full layer. Its presence is static: the layer keeps its
    # KV in a ring, transformer.attention) and the experts' biases
    bo: jax.Array | None = None
    sinks: jax.Array | None = None
    window: jax.Array | None = None
    expert_biases: ExpertBiases | None = None

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def with_experts(self, experts: dict[str, Weight] | None) -> LayerWeights:
        return replace(self, experts=experts)

    @classmethod
    def from_named(cls, t: dict) -> LayerWeights:
        """From load.py's short names (wq, w_gate, router, exp_gate, sh_up, ...) -> the typed layer.
        A dense FFN or a router that is only partly there is a broken file: GGUFModel's checks name
        it first."""
        def mlp(prefix: str, gate_inp: str | None = None) -> Mlp | None:
            if prefix + "gate" not in t:
                return None
            return Mlp(t[prefix + "gate"], t[prefix + "up"], t[prefix + "down"],
                       t.get(gate_inp) if gate_inp else None)

        experts = {n: t[n] for n in EXPERT_TENSORS if n in t} or None
        biases = (ExpertBiases(t["exp_gate_b"], t["exp_up_b"], t["exp_down_b"])
                  if "exp_gate_b" in t else None)
        return cls(t["attn_norm"], t["wq"], t["wk"], t["wv"], t["wo"], t["ffn_norm"],
                   bq=t.get("bq"), bk=t.get("bk"), bv=t.get("bv"), q_norm=t.get("q_norm"),
                   k_norm=t.get("k_norm"),
                   mlp=mlp("w_"),
                   router=Router(t["router"], t.get("exp_bias"), t.get("router_b"))
                          if "router" in t else None,
                   experts=experts, shared=mlp("sh_", "sh_router"), bo=t.get("bo"),
                   sinks=t.get("sinks"), window=t.get("window"), expert_biases=biases)


@_pytree
@dataclass(frozen=True)
class DeltaNetWeights:
    """A Gated DeltaNet layer of the hybrid families (deltanet.py): attn_norm, qkv (attn_qkv: q and
    k of every k-head, v of every v-head), z (attn_gate: the output gate), conv [K, C] (ssm_conv1d,
    float32), dt_bias and ssm_a [Hv] (ssm_a = -exp(A_log), the converter's), ssm_norm [dv], ssm_out;
    beta and alpha as qwen3next's one ssm_ba or qwen35moe's ssm_beta and ssm_alpha. The FFN is a MoE
    layer's, as LayerWeights' (router, experts, shared), so layers.moe and the expert tiers read it
    the same way."""
    attn_norm: jax.Array
    qkv: Weight
    z: Weight
    conv: jax.Array
    dt_bias: jax.Array
    ssm_a: jax.Array
    ssm_norm: jax.Array
    ssm_out: Weight
    ffn_norm: jax.Array
    ssm_ba: Weight | None = None
    ssm_beta: Weight | None = None
    ssm_alpha: Weight | None = None
    router: Router | None = None
    experts: dict[str, Weight] | None = None
    shared: Mlp | None = None
    mlp: Mlp | None = None
    # as LayerWeights' (layers.moe and the stages read it): None, the hybrids' experts have none
    expert_biases: ExpertBiases | None = None

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def with_experts(self, experts: dict[str, Weight] | None) -> DeltaNetWeights:
        return replace(self, experts=experts)

    @classmethod
    def from_named(cls, t: dict) -> DeltaNetWeights:
        """From load.py's short names (qkv, z, conv, ..., router, exp_gate, sh_up, ...)."""
        common = LayerWeights.from_named(t | {n: None for n in ("wq", "wk", "wv", "wo")})
        return cls(t["attn_norm"], t["qkv"], t["z"], t["conv"], t["dt_bias"], t["ssm_a"],
                   t["ssm_norm"],
                   t["ssm_out"], t["ffn_norm"], ssm_ba=t.get("ssm_ba"), ssm_beta=t.get("ssm_beta"),
                   ssm_alpha=t.get("ssm_alpha"), router=common.router, experts=common.experts,
                   shared=common.shared, mlp=common.mlp)

