"""Load a GGUF model into Hugging Face transformers (torch, CPU): the oracle for our model families.

transformers' GGUF loader maps only some metadata keys to its configs; the rest fall back to the
config class's defaults, which for our small synthetic models are wrong. So we load its config, set
what it missed from our ModelSpec, and load the weights with that config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strata_jax.gguf import GGUFModel, ModelSpec

# Our architecture name -> transformers' model_type.
HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                 "qwen3moe": "qwen3_moe"}


def hf_config_overrides(spec: ModelSpec) -> dict[str, Any]:
    """Config fields transformers' GGUF loader leaves at its defaults (or gets wrong) for these
    files."""
    out: dict[str, Any] = {"head_dim": spec.head_dim, "tie_word_embeddings": spec.tied_output}
    if spec.is_moe:
        # the loaders ignore expert_feed_forward_length
        out["moe_intermediate_size"] = spec.expert_ffn
        out["norm_topk_prob"] = spec.expert_weights_norm
    if spec.shared_ffn:
        out["shared_expert_intermediate_size"] = spec.shared_ffn
    return out


def load_hf_model(path: str | Path, dtype: Any = None):
    """`AutoModelForCausalLM` for the (one-file) GGUF at `path`, in eval mode, float32 unless
    `dtype`. Raises if transformers left any parameter unloaded (it would otherwise be random)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    spec = GGUFModel.open(path).spec
    if spec.architecture not in HF_MODEL_TYPE or (spec.architecture == "llama" and spec.is_moe):
        raise ValueError(f"{path}: transformers has no GGUF loader for a {spec.architecture} model"
                         + (" with experts" if spec.is_moe else ""))
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key, value in hf_config_overrides(spec).items():
        setattr(config, key, value)
    model, info = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                       config=config, dtype=dtype or torch.float32,
                                                       output_loading_info=True)
    unloaded = sorted(set(info["missing_keys"]) | {str(k) for k in info["mismatched_keys"]})
    if unloaded:
        raise ValueError(f"{path}: transformers did not load {len(unloaded)} parameters from it: "
                         f"{unloaded[:5]}")
    return model.eval()


def load_state(module, state: dict, path: str | Path, shared: tuple[str, ...] = ()) -> None:
    """`state` (name -> numpy array) into a torch module; raises if a parameter is left unloaded (it
    would be random) or a name is not the module's. `shared`: prefixes of parameters tied to another
    module's."""
    import numpy as np
    import torch

    tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
               for k, v in state.items()}
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith(shared)]
    if missing or unexpected:
        raise ValueError(f"{path}: transformers' model left {missing[:5]} unloaded, has no "
                         f"{unexpected[:5]}")


def use_own_nextn_head(mtp, t: dict, layer: int, spec: ModelSpec) -> None:
    """transformers' MtpModel with the NextN block's own embedding and head where the file has them
    (blk.N.nextn.embed_tokens / shared_head_head), else the main model's it was tied to."""
    import torch

    b = f"blk.{layer}.nextn."
    if b + "embed_tokens.weight" in t:
        mtp.embed_tokens = torch.nn.Embedding.from_pretrained(
            torch.from_numpy(t[b + "embed_tokens.weight"]))
    if b + "shared_head_head.weight" in t:
        head = torch.nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        head.weight.data = torch.from_numpy(t[b + "shared_head_head.weight"])
        mtp.shared_head = head
