"""Model families as pure functions over pytree weights."""

from . import hybrid, transformer
from .load import expert_tensor_bytes, load_experts, load_nextn_experts, load_params
from .mtp import has_mtp, mtp_forward
from .params import EXPERT_TENSORS, LayerWeights, Mlp, Router
from .transformer import ForwardOut, Group, RunOptions, new_kv_cache
from .weights import QTensor, linear


def forward(params: dict, spec, opts: RunOptions, groups: tuple[Group, ...], cache: dict,
            kv_len: int, with_hidden: bool = False, host=None, counts=None) -> ForwardOut:
    """One window of the model's family: transformer.forward, or hybrid.forward for the Gated
    DeltaNet hybrids (qwen3next, qwen35moe). The family is the spec's, static: a program holds one
    of them."""
    family = hybrid if spec.deltanet is not None else transformer
    return family.forward(params, spec, opts, groups, cache, kv_len, with_hidden, host, counts)


__all__ = [
           "EXPERT_TENSORS",
           "ForwardOut",
           "Group",
           "LayerWeights",
           "Mlp",
           "QTensor",
           "Router",
           "RunOptions",
           "expert_tensor_bytes",
           "forward",
           "has_mtp",
           "linear",
           "load_experts",
           "load_nextn_experts",
           "load_params",
           "mtp_forward",
           "new_kv_cache",
]
