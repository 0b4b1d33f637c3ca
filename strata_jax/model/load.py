"""GGUF tensors -> the parameter pytree of transformer.forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..gguf import GGUFModel
from .mla import MLA_NORMS, MLA_PER_HEAD, MLA_TENSORS, MlaWeights
from .params import EXPERT_TENSORS, DeltaNetWeights, LayerWeights
from .weights import QTensor, to_device

# GGUF tensor name (after "blk.N.") -> our short name.
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_output.weight": "wo", "attn_q.bias": "bq", "attn_k.bias": "bk",
    "attn_v.bias": "bv", "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down", "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "exp_gate", "ffn_up_exps.weight": "exp_up",
    "ffn_down_exps.weight": "exp_down", "ffn_gate_shexp.weight": "sh_gate",
    "ffn_up_shexp.weight": "sh_up", "ffn_down_shexp.weight": "sh_down",
    "ffn_gate_inp_shexp.weight": "sh_router",
    "post_attention_norm.weight": "ffn_norm",  # glm4moe's name for the norm before the FFN
    "exp_probs_b.bias": "exp_bias",            # glm4moe's expert-choosing bias
    # gpt-oss's (params.LayerWeights: bo, sinks, Router.logit_bias, ExpertBiases)
    "attn_output.bias": "bo", "attn_sinks.weight": "sinks", "ffn_gate_inp.bias": "router_b",
    "ffn_gate_exps.bias": "exp_gate_b", "ffn_up_exps.bias": "exp_up_b",
    "ffn_down_exps.bias": "exp_down_b",
}
# A Gated DeltaNet layer's own tensors (the hybrid families; params.DeltaNetWeights), beside the MoE
# ones above.
_DELTANET_TENSORS = {
    "attn_qkv.weight": "qkv", "attn_gate.weight": "z", "ssm_conv1d.weight": "conv",
    "ssm_dt.bias": "dt_bias", "ssm_a": "ssm_a", "ssm_norm.weight": "ssm_norm",
    "ssm_out.weight": "ssm_out", "ssm_ba.weight": "ssm_ba", "ssm_beta.weight": "ssm_beta",
    "ssm_alpha.weight": "ssm_alpha",
}
# A NextN (MTP) block's own tensors (after "blk.N.nextn."): see mtp.py.
_NEXTN_TENSORS = {"eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
                  "embed_tokens.weight": "embed", "shared_head_head.weight": "head",
                  "shared_head_norm.weight": "head_norm"}
# Small tensors stay float32 whatever the mode: norms, biases, routers (the router's top-k decides
# which experts run, so it is computed in float32 as llama.cpp does).
_ALWAYS_FLOAT = {"attn_norm", "ffn_norm", "q_norm", "k_norm", "bq", "bk", "bv", "router",
                 "sh_router", "exp_bias", "bo", "sinks", "router_b", "exp_gate_b", "exp_up_b",
                 "exp_down_b", "enorm", "hnorm", "head_norm", "conv", "dt_bias", "ssm_a",
                 "ssm_norm", *MLA_NORMS}



def load_params(model: GGUFModel, mode: str, dtype: str, progress: bool = False,
                experts: bool = True, pack: bool = False) -> dict:
    """mode "blocks": matrices stay GGUF blocks (QTensor); "dequantized": float `dtype` copies.
    `progress`: a progress bar over the tensors on the console. `experts=False` leaves the routed
    experts out (the expert tiers hold them; `load_experts` adds them later when they all fit on the
    device). `pack` (blocks mode, the cpu backend's int8 math): the matrices that only products read
    are packed (weights.to_device); the embedding table (gathered by rows) is not. The routed
    experts: see load_experts (packed when all are resident; the tiers hand them over as GGUF
    blocks)."""
    from tqdm import tqdm

    spec = model.spec
    t = model.tensors
    bar = tqdm(total=len(t), desc="loading weights", unit="tensor", disable=not progress,
               leave=False)

    def get(name: str, short: str):
        bar.update(1)
        m = "dequantized" if short in _ALWAYS_FLOAT or short in MLA_PER_HEAD else mode
        # The embedding table is gathered by rows; every other float matrix is kept transposed ([k,
        # n]): on XLA:CPU x @ W runs twice as fast as x @ W^T for a few rows (the decode case).
        return to_device(t[name], m, jnp.float32 if short in _ALWAYS_FLOAT else dtype,
                         transpose=short not in ("embed", "router", "exp_gate_b", "exp_up_b",
                                                 "exp_down_b", *MLA_PER_HEAD),
                         pack=pack and short not in EXPERT_TENSORS
                              and short not in ("embed", "router"))

    def layer(i: int) -> LayerWeights | DeltaNetWeights:
        prefix = f"blk.{i}."
        deltanet = spec.kind(i) == "deltanet"
        names = _LAYER_TENSORS | _DELTANET_TENSORS if deltanet else _LAYER_TENSORS
        if spec.mla is not None:
            names = _LAYER_TENSORS | MLA_TENSORS
        named = {short: get(prefix + suffix, short) for suffix, short in names.items()
                 if prefix + suffix in t and (experts or short not in EXPERT_TENSORS)}
        if spec.mla is not None:
            return MlaWeights.from_named(named, spec.mla)
        if i in spec.ring_layers:
            # gpt-oss's sliding-window layers carry their window (None: a full layer): its presence
            # says, statically, that the layer's KV is a ring (transformer.attention), so the two
            # kinds build programs of their own (the layer-stepped stages' kinds too)
            named["window"] = jnp.int32(spec.window(i))
        return (DeltaNetWeights if deltanet else LayerWeights).from_named(named)

    params: dict = {"embed": get("token_embd.weight", "embed"),
                    "norm": get("output_norm.weight", "norm")}
    params["norm"] = params["norm"].astype(jnp.float32)
    if spec.tied_output:   # a float table is kept both ways: rows to embed, transposed to project
        params["output"] = (params["embed"] if isinstance(params["embed"], QTensor)
                            else params["embed"].T.copy())
        if pack and isinstance(params["embed"], QTensor):
            # the head packed too, a copy beside the table's GGUF rows (SmolLM2: 30 MB, 1/5 of a
            # decode step read twice as fast); the embedding keeps gathering its rows from the
            # file's pages
            params["output"] = to_device(t["token_embd.weight"], mode, dtype, pack=True)
    else:
        params["output"] = get("output.weight", "output")
    params["layers"] = [layer(i) for i in range(spec.n_layers)]
    if spec.n_nextn:
        params["mtp"] = _load_nextn(params, t, spec.n_layers, layer, get)
    bar.close()
    return params


def _load_nextn(params: dict, t, i: int, layer, get) -> dict:
    """The first NextN (MTP) block, blk.{i}: its decoder layer, eh_proj, enorm, hnorm, and its
    embedding, head and head norm, which a file may leave out: then the main model's are used, as
    llama.cpp and vLLM share them (DeepSeek-V3's MTP shares the embedding and output head with the
    main model)."""
    prefix = f"blk.{i}.nextn."
    own = {short: get(prefix + suffix, short) for suffix, short in _NEXTN_TENSORS.items()
                  if prefix + suffix in t}
    return {"layer": layer(i), "embed": own.pop("embed", params["embed"]),
            "head": own.pop("head", params["output"]),
            "head_norm": own.pop("head_norm", params["norm"]), **own}



def load_experts(model: GGUFModel, params: dict, mode: str, dtype: str, pack: bool = False) -> None:
    """Put every routed expert on the device, into `params` (loaded with experts=False), exactly as
    load_params(experts=True) would have; `pack`: each expert packed (to_device), as resident
    weights are."""
    layers = params["layers"]
    for i, lp in enumerate(layers):
        layers[i] = lp.with_experts(_experts(model, i, mode, dtype, pack))
    if "mtp" in params:
        mtp = params["mtp"]
        mtp["layer"] = mtp["layer"].with_experts(_experts(model, model.spec.n_layers, mode,
                                                          dtype, pack))


def load_nextn_experts(model: GGUFModel, params: dict, mode: str, dtype: str) -> int:
    """Put the NextN (MTP) layer's routed experts on the device (the expert tiers hold only the main
    layers'): -> their device bytes (0 when there is no such layer or they are there already)."""
    if "mtp" not in params or params["mtp"]["layer"].experts is not None:
        return 0
    experts = _experts(model, model.spec.n_layers, mode, dtype)
    params["mtp"]["layer"] = params["mtp"]["layer"].with_experts(experts)
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(experts))


def _experts(model: GGUFModel, i: int, mode: str, dtype: str, pack: bool = False) -> dict | None:
    """Layer i's routed experts on the device (EXPERT_TENSORS -> weight), or None for a dense
    layer."""
    names = {short: f"blk.{i}.{suffix}" for suffix, short in _LAYER_TENSORS.items()
                    if short in EXPERT_TENSORS}
    out = {short: to_device(model.tensors[name], mode, dtype, pack=pack)
           for short, name in names.items()
           if name in model.tensors}
    return out or None


def expert_tensor_bytes(model: GGUFModel, mode: str, dtype: str) -> int:
    """Device bytes of every routed expert in `mode` (GGUF blocks, or float `dtype`)."""
    item = jnp.dtype(dtype).itemsize
    return sum(t.n_values * item if mode == "dequantized" else t.n_bytes
               for name, t in model.tensors.items()
               if name.startswith("blk.")
               and _LAYER_TENSORS.get(name.split(".", 2)[2]) in EXPERT_TENSORS)
