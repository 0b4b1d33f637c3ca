"""Model families as pure functions over pytree weights."""

from .load import expert_tensor_bytes, load_experts, load_params
from .transformer import Group, RunOptions, forward, new_kv_cache
from .weights import QTensor, linear

__all__ = ["Group", "QTensor", "RunOptions", "expert_tensor_bytes", "forward", "linear", "load_experts", "load_params",
           "new_kv_cache"]
