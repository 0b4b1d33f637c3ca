"""Model families as pure functions over pytree weights."""

from .load import expert_tensor_bytes, load_experts, load_nextn_experts, load_params
from .mtp import has_mtp, mtp_forward
from .params import EXPERT_TENSORS, LayerWeights, Mlp, Router
from .transformer import Group, RunOptions, forward, new_kv_cache
from .weights import QTensor, linear

__all__ = [
           "EXPERT_TENSORS",
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
