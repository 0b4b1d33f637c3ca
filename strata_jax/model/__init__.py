"""Model families as pure functions over pytree weights."""

from .load import load_params
from .transformer import Group, RunOptions, forward, new_kv_cache
from .weights import QTensor, linear

__all__ = ["Group", "QTensor", "RunOptions", "forward", "linear", "load_params", "new_kv_cache"]
