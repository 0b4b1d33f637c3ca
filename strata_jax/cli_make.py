"""`strata-jax make-model` and `strata-jax upcycle`: the commands that write GGUF models
(strata_jax/makers/)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields

_MAKE_MODEL_HELP = {
    "arch": "model family", "layers": "transformer blocks", "hidden": "embedding width",
    "heads": "attention heads", "kv_heads": "key/value heads",
    "head_dim": "head size (default hidden/heads)", "ffn": "dense FFN width",
    "experts": "experts per layer (default 8 for the MoE families; with llama: Mixtral-style MoE)",
    "experts_used": "experts per token (top-k)", "expert_ffn": "FFN width of one expert",
    "shared_ffn": "qwen2moe's shared expert width",
    "vocab": "vocabulary size (default 512, or the tokenizer's)",
    "context": "training context length", "rope_theta": "rope.freq_base",
    "rms_eps": "RMS norm epsilon", "quant": "type of every weight matrix",
    "expert_quant": "type of the expert tensors (default --quant; MXFP4 for --arch gpt-oss)",
    "attn_quant": "type of the attention weights (default --quant)",
    "embed_quant": "type of token_embd and output (default --quant)",
    "more_bits_quant": "as llama.cpp's Q4_K_M: type of ffn_down (dense, shared, experts) and "
                       "attn_v in the layers it gives more bits (i < n/8, i >= 7n/8, (i - n/8) %% "
                       "3 == 2); e.g. --quant Q4_K --more-bits-quant Q6_K", "seed": "random seed",
    "router_skew": "0: uniform expert popularity; > 0: expert i's router row scaled by "
                   "(rank+1)^-SKEW (0.5: the hottest tenth of the experts get ~40%% of the "
                   "routings, token by token). Neither is a real model's routing",
    "split": "write N parts in llama.cpp's gguf-split layout",
    "tokenizer_from": "copy tokenizer.* keys (and the vocabulary size) from this GGUF instead of "
                      "the built-in byte-level BPE", "name": "general.name",
    "leading_dense": "glm4moe, deepseek2: leading dense-FFN layers before the MoE ones (default 1)",
    "nextn": "glm4moe, qwen3next, qwen35moe, deepseek2: NextN (MTP) layers stored after the main "
    "ones (blk.N.nextn.*; the hybrids and deepseek2: 0 or 1)",
    "nextn_head": "glm4moe, qwen3next, qwen35moe, deepseek2: give the NextN layer its own "
                  "embed_tokens and shared_head_head",
    "qk_norm": "glm4moe: per-head q/k norms (as GLM-4.5 355B)",
    "rope_dims": "rope.dimension_count (default: the head size; glm4moe: half of it; "
                 "qwen3next/qwen35moe: a quarter)",
    "expert_weights_scale": "scale of the routed experts' weights (default 1; glm4moe: 2.5)",
    "ssm_conv": "qwen3next/qwen35moe: taps of the Gated DeltaNet layers' causal conv "
                "(ssm.conv_kernel)",
    "ssm_k_heads": "qwen3next/qwen35moe: the DeltaNet layers' q/k heads (ssm.group_count)",
    "ssm_v_heads": "qwen3next/qwen35moe: their v heads, a multiple of the k heads "
                   "(ssm.time_step_rank)",
    "ssm_head_dim": "qwen3next/qwen35moe: their head size (ssm.state_size)",
    "full_attention_interval": "qwen3next/qwen35moe: every N-th layer is (gated) attention, the "
                               "others DeltaNet",
    "q_lora": "deepseek2: attention.q_lora_rank (default 48; 0: a Lite-style attn_q)",
    "kv_lora": "deepseek2: attention.kv_lora_rank, the cached latent's width (default 32)",
    "nope_dim": "deepseek2: a head's key size without rope (default 16)",
    "v_head_dim": "deepseek2: a head's value size (default 16)",
    "expert_groups": "deepseek2: expert_group_count (default 4)",
    "expert_groups_used": "deepseek2: expert_group_used_count, the groups top-k picks from "
                          "(default 2)",
    "legacy_kv_b": "deepseek2: write the legacy attn_kv_b instead of attn_k_b / attn_v_b",
    "sliding_window": "gpt-oss: attention.sliding_window of its windowed (even) layers (default "
                      "8)",
    "yarn_factor": "gpt-oss, deepseek2: write YaRN rope keys with this factor (default 0: plain "
                   "rope)",
    "yarn_original_context": "gpt-oss with --yarn-factor: rope.scaling.original_context_length",
}


def add_make_model(sub: argparse._SubParsersAction) -> None:
    from strata_jax.makers.make_model import ARCHS, ModelOptions
    from strata_jax.makers.shapes import SHAPES

    p = sub.add_parser("make-model", help="write a synthetic GGUF with random weights",
                       description="Write a GGUF model with random weights (random quant blocks "
                                   "with sane scales) in llama.cpp's layout. Norms stay F32; a "
                                   "weight whose rows are not whole blocks of the chosen type is "
                                   "stored as F16 instead (and said so).")
    p.add_argument("out", help="output path (with --split N: OUT-0000i-of-0000N.gguf next to it)")
    p.add_argument("--shape", choices=list(SHAPES), default=None,
                   help="start from a real model's sizes (random weights; the other flags "
                        "override it), e.g. --shape qwen3-30b-a3b --quant Q8_0 --split 3")
    defaults = ModelOptions()
    for f in fields(ModelOptions):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        shown = f" (default {default})" if default is not None else ""
        if f.name == "arch":
            shown = f": {', '.join(ARCHS)}{shown}"
        if f.name == "tied":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help="no output.weight: share token_embd (default --no-tied)")
            continue
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=_MAKE_MODEL_HELP.get(f.name, ""))
            continue
        kind = {"rope_theta": float, "rms_eps": float, "router_skew": float,
                "expert_weights_scale": float, "yarn_factor": float}.get(f.name, str if f.name in (
            "arch", "quant", "expert_quant", "attn_quant", "embed_quant", "more_bits_quant",
            "tokenizer_from", "name") else int)
        p.add_argument(flag, type=kind, default=argparse.SUPPRESS,
                       metavar=f.name.split("_")[-1].upper(),
                       choices=ARCHS if f.name == "arch" else None,
                       help=_MAKE_MODEL_HELP.get(f.name, "") + shown)
    p.set_defaults(run=run_make_model)


def run_make_model(args: argparse.Namespace) -> int:
    from strata_jax.gguf import GGUFModel
    from strata_jax.gguf.summary import fmt_bytes
    from strata_jax.makers.make_model import ModelOptions, make_model, model_bytes

    options = {f.name: getattr(args, f.name) for f in fields(ModelOptions) if hasattr(args, f.name)}
    print(f"writing {fmt_bytes(model_bytes(args.shape, **options))} of weights to {args.out}",
          flush=True)
    paths = make_model(args.out, shape=args.shape, progress=ProgressLine(), **options)
    model = GGUFModel.open(paths[0])
    for p in paths:
        print(f"wrote {p} ({fmt_bytes(p.stat().st_size)})")
    print(f"{model.spec.architecture}: {sum(t.n_values for t in model.tensors.values()):,} "
          f"parameters in {len(model.tensors)} tensors")
    return 0


class ProgressLine:
    """make_model's progress on one stderr line, redrawn at most twice a second: GiB written, of
    how many, and the rate."""

    def __init__(self) -> None:
        self.started = self.shown = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.shown < 0.5 and done < total:
            return
        self.shown = now
        rate = done / max(now - self.started, 1e-9) / 2**20
        end = "\n" if done >= total else ""
        print(f"\r  {done / 2**30:7.2f} / {total / 2**30:.2f} GiB  {100 * done / total:5.1f}%  "
              f"{rate:6.0f} MiB/s", end=end, file=sys.stderr, flush=True)


def add_upcycle(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("upcycle",
                       help="turn a dense llama GGUF into a MoE one that computes the same",
                                   description="Copy each FFN of a dense llama GGUF into E experts "
                                               "and add a random router (top-k weights "
                                               "renormalized): the MoE model computes what the "
                                               "dense one does.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_upcycle)


def run_upcycle(args: argparse.Namespace) -> int:
    from strata_jax.gguf import GGUFModel
    from strata_jax.makers.upcycle import upcycle

    out = upcycle(args.src, args.dst, args.experts, args.top_k, args.seed)
    spec = GGUFModel.open(out).spec
    print(f"wrote {out}: {spec.n_layers} layers of {spec.n_experts} experts, "
          f"top-{spec.n_experts_used}")
    return 0
